"""``TraceReplayer``: the Python face of trace replay and the trace analyses.

Example::

    >>> r = TraceReplayer(trace_file="rank0.json.gz", store="runs.db")   # doctest: +SKIP
    >>> plan = r.replay(step_interval_ms=10, highlight_ops=["mm"])       # doctest: +SKIP
    >>> plan.url                                                         # doctest: +SKIP
    '/#/traces/1/replay?step_interval_ms=10&highlight=mm'
    >>> r.overlap(comm=[r"dpsk::ep::"])["trace"]["ratio"]                 # doctest: +SKIP
    0.963

The trace is ingested into ``store`` when it is not there yet (same run, same file name, status
``ok``/``truncated``); kernel → node links are (re)built from the run's compile records. Every
analysis returns plain data (see :mod:`graphdeck.analysis.traces.analyze` and
:mod:`graphdeck.analysis.traces.collectives`).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import webbrowser
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import (
    CommRule,
    TraceData,
    analyze_trace,
    gpu_busy,
    hotspots,
    overlap,
    step_times,
)
from graphdeck.analysis.traces.collectives import align_and_match
from graphdeck.analysis.traces.mapping import link_kernels, node_time_ns
from graphdeck.errors import UsageError
from graphdeck.replay.frames import replay_frames
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run, Trace
from graphdeck.store.traces import ingest_trace


@dataclass
class ReplayPlan:
    """What :meth:`TraceReplayer.replay` prepared: ``url`` (path of the dashboard's replay page;
    absolute when a server was started), ``step``, ``step_interval_ms``, ``frames`` (see
    :class:`graphdeck.replay.frames.ReplayFrames`), ``duration_ms`` (frames × interval),
    ``source`` (``gpu`` kernels, or ``cpu`` ops/kernels of compiled regions in a CPU trace),
    ``highlights`` (per pattern: frames matched and how) and ``warnings`` (patterns that matched
    nothing; also issued as Python warnings)."""

    trace_id: int
    url: str
    step: int | None
    step_interval_ms: float
    highlight_ops: list[str]
    frames: list[dict] = field(default_factory=list)
    source: str = "gpu"
    highlights: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return len(self.frames) * self.step_interval_ms

    @property
    def highlighted(self) -> list[dict]:
        return [f for f in self.frames if f["highlight"]]


class TraceReplayer:
    """Replay and analyse one rank's Kineto trace.

    Args:
        trace_file: a ``.json`` / ``.json.gz`` Kineto trace; ingested unless already stored.
        store: the graphdeck store (SQLite path or URL); default ``GRAPHDECK_STORE`` or
            ``graphdeck.db``.
        run: the run the trace belongs to (default ``GRAPHDECK_RUN``, else the file's stem).
        rank: the rank when the file has no ``distributedInfo``.
        trace_id: an already stored trace instead of ``trace_file``.

    Raises:
        UsageError: neither ``trace_file`` nor ``trace_id``; BadInputError /
        TruncatedInputError from the ingest (a truncated file's kept events are used).
    """

    def __init__(self, trace_file: str | os.PathLike | None = None, *, store: str | os.PathLike | None = None,
                 run: str | None = None, rank: int | None = None, trace_id: int | None = None):
        if trace_file is None and trace_id is None:
            raise UsageError("TraceReplayer needs trace_file= or trace_id=")
        self.store = store or os.environ.get("GRAPHDECK_STORE", "graphdeck.db")
        self.engine = open_engine(self.store)
        if trace_id is None:
            path = Path(trace_file)
            self.run = run or os.environ.get("GRAPHDECK_RUN") or path.name.split(".")[0]
            trace_id = self._stored(path.name) or self._ingest(path, rank)
        self.trace_id = trace_id
        with Session(self.engine) as s:
            trace = s.get(Trace, trace_id)
            if trace is None:
                raise UsageError(f"no trace {trace_id} in {self.store}")
            self.run_id, self.rank = trace.run_id, trace.rank
            self.run = s.get(Run, trace.run_id).name
        self.link_stats = link_kernels(self.engine, self.run_id)

    def _stored(self, name: str) -> int | None:
        with Session(self.engine) as s:
            return s.scalar(select(Trace.id).join(Run, Run.id == Trace.run_id).where(
                Run.name == self.run, Trace.name == name, Trace.status.in_(("ok", "truncated"))).order_by(Trace.id.desc()))

    def _ingest(self, path: Path, rank: int | None) -> int:
        from graphdeck.errors import ConflictError, TruncatedInputError

        try:
            return ingest_trace(self.engine, path, run_name=self.run, rank=rank).trace_id
        except ConflictError as exc:  # the store holds these bytes already: replay that trace
            return exc.details["trace_id"]
        except TruncatedInputError as exc:  # the events before the cut are kept: replay those
            if exc.details.get("kept"):
                return exc.details["trace_id"]
            raise

    # ------------------------------------------------------------------ replay

    def replay(self, step_interval_ms: float = 10, highlight_ops=None, *, step: int | None = None,
               serve: bool = False, open_browser: bool = False, port: int = 0) -> ReplayPlan:
        """Prepare the replay of ``step`` (default the first ``ProfilerStep``): one frame per
        kernel (per op / C++ kernel of a compiled region in a CPU trace), ``step_interval_ms`` apart, frames matching ``highlight_ops`` (names or regexes)
        marked. With ``serve=True`` the dashboard is started on 127.0.0.1 (a daemon thread;
        ``port`` 0 picks a free one) and ``url`` is absolute; ``open_browser`` opens it."""
        if step_interval_ms <= 0:
            raise UsageError(f"step_interval_ms must be > 0, got {step_interval_ms}")
        highlight = [str(h) for h in (highlight_ops or [])]
        with Session(self.engine) as s:
            frames = replay_frames(s, self.trace_id, step=step, highlight_ops=highlight)
        query = [("step_interval_ms", f"{step_interval_ms:g}")] + [("highlight", h) for h in highlight]
        if frames.step is not None:
            query.append(("step", str(frames.step)))
        url = f"/#/traces/{self.trace_id}/replay?{urlencode(query)}"
        if serve or open_browser:
            url = self._serve(port) + url
            if open_browser:
                webbrowser.open(url)
        for w in frames.warnings:
            warnings.warn(w, stacklevel=2)
        return ReplayPlan(self.trace_id, url, frames.step, step_interval_ms, highlight, frames.frames, frames.source,
                          frames.highlights, frames.warnings)

    def _serve(self, port: int) -> str:
        import socket

        import uvicorn

        from graphdeck.server.app import create_app
        from graphdeck.server.settings import Settings

        if not port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(Settings(store=self.store)), host="127.0.0.1", port=port,
                                               log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server = server
        return f"http://127.0.0.1:{port}"

    # ------------------------------------------------------------------ analyses (data)

    def _data(self, session: Session) -> TraceData:
        return TraceData(session, self.trace_id)

    def analyses(self, comm=None) -> dict:
        """Every per-trace analysis (:func:`graphdeck.analysis.traces.analyze.analyze_trace`)."""
        with Session(self.engine) as s:
            return analyze_trace(s, self.trace_id, CommRule(extra=tuple(comm or ())))

    def step_times(self) -> list[dict]:
        with Session(self.engine) as s:
            return step_times(self._data(s))

    def gpu_busy(self) -> list[dict]:
        with Session(self.engine) as s:
            return gpu_busy(self._data(s))

    def hotspots(self, top: int = 10) -> dict:
        with Session(self.engine) as s:
            return hotspots(self._data(s), top)

    def idle(self, kernel_wait_us: float = 30.0) -> dict:
        """Idle time by cause (NOTE: [Idle time by cause]): ``{"gpu": ..., "cpu": ...}`` as
        :func:`graphdeck.analysis.traces.idle.idle_breakdown`, times in int ns."""
        from graphdeck.analysis.traces.idle import idle_breakdown

        with Session(self.engine) as s:
            return idle_breakdown(self._data(s), round(kernel_wait_us * 1000))

    def overlap(self, comm=None) -> dict:
        """Comm/compute overlap; ``comm``: extra communication-kernel patterns (regex)."""
        with Session(self.engine) as s:
            return overlap(self._data(s), CommRule(extra=tuple(comm or ())))

    def collectives(self, comm=None) -> dict:
        """Collectives matched across the ranks of this trace's run, clock offsets, stragglers."""
        with Session(self.engine) as s:
            return align_and_match(s, self.run_id, CommRule(extra=tuple(comm or ())))

    def node_time_ns(self, graph_id: int) -> dict[str, int]:
        with Session(self.engine) as s:
            return node_time_ns(s, graph_id, self.trace_id)
