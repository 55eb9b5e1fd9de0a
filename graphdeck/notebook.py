"""graphdeck from a notebook: a store's runs, graphs and traces as pandas DataFrames and networkx
graphs, and the same check reports the CLI prints (issue 23, item 4; in the spirit of HTA's
``TraceAnalysis``).

    >>> import graphdeck
    >>> store = graphdeck.open("graphdeck.db")            # doctest: +SKIP
    >>> run = store.run("demo")                           # doctest: +SKIP
    >>> g = run.graphs(kind="aot_forward", rank=0)[0]      # doctest: +SKIP
    >>> g.nodes_frame().head()                            # doctest: +SKIP
    >>> nx_graph = g.to_networkx()                        # doctest: +SKIP
    >>> run.check_grads().verdict, run.check_ranks().verdict  # doctest: +SKIP

Everything reads the store read-only (:func:`graphdeck.store.db.open_engine`); a report is the
object ``graphdeck check-grads`` / ``check-ranks`` renders, so ``report.to_text()`` is the CLI's
text and ``report.verdict`` its exit status. Needs ``pandas`` and ``networkx`` (the ``notebook``
extra: ``pip install "graphdeck[notebook]"``).

Raises: :class:`~graphdeck.errors.NotFoundError` for a store, run, rank or trace that does not
exist; :class:`ImportError` naming the extra when pandas/networkx are missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.errors import NotFoundError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import networkx
    import pandas

NODE_COLUMNS = ["idx", "name", "op", "target", "module_path", "shape", "dtype", "device", "size_bytes", "seq_nr",
                "stack_trace"]
EDGE_COLUMNS = ["src_idx", "dst_idx", "src", "dst", "arg_pos", "size_bytes"]
EVENT_COLUMNS = ["ts_ns", "dur_ns", "ph", "name", "cat", "pid", "tid", "correlation", "args"]


def _pandas():
    try:
        import pandas
    except ImportError as exc:  # pragma: no cover - the notebook extra
        raise ImportError('graphdeck.open(...) frames need pandas: pip install "graphdeck[notebook]"') from exc
    return pandas


def open(store: str) -> Store:  # noqa: A001 - graphdeck.open(store), like builtins.open for a file
    """The store at ``store`` (a SQLite path or a SQLAlchemy URL), read-only."""
    from graphdeck.store.db import open_engine

    return Store(open_engine(str(store), read_only=True), str(store))


class Store:
    """A graphdeck store: :meth:`runs`, :meth:`run`."""

    def __init__(self, engine, url: str):
        self.engine, self.url = engine, url

    def runs(self) -> pandas.DataFrame:
        """One row per run: ``id``, ``name``, ``world_size``, ``created_at``."""
        from graphdeck.store.schema import Run

        with Session(self.engine) as s:
            rows = s.execute(select(Run.id, Run.name, Run.world_size, Run.created_at).order_by(Run.id)).all()
        return _pandas().DataFrame([tuple(r) for r in rows], columns=["id", "name", "world_size", "created_at"])

    def run(self, name_or_id: str | int) -> RunHandle:
        """The run named (or numbered) ``name_or_id``; NotFoundError otherwise."""
        from graphdeck.store.schema import Run

        with Session(self.engine) as s:
            run = s.scalar(select(Run).where(Run.name == str(name_or_id)))
            if run is None and str(name_or_id).isdigit():
                run = s.get(Run, int(name_or_id))
            if run is None:
                raise NotFoundError(f"run {name_or_id!r} not found in {self.url}")
            return RunHandle(self, run.id, run.name, run.world_size)

    def __repr__(self) -> str:
        return f"graphdeck.Store({self.url!r})"


@dataclass
class RunHandle:
    """One run of a :class:`Store`."""

    store: Store
    id: int
    name: str
    world_size: int | None

    def graphs(self, kind: str | None = None, rank: int | None = None) -> list[GraphHandle]:
        """The run's graphs in capture order (``kind``: ``dynamo``, ``aot_forward``, ``aot_backward``,
        ``ddp_partition``, …; ``rank``: one rank)."""
        from graphdeck.store.schema import Graph

        q = select(Graph.id, Graph.rank, Graph.kind, Graph.name, Graph.compile_id, Graph.num_nodes).where(
            Graph.run_id == self.id)
        if kind is not None:
            q = q.where(Graph.kind == kind)
        if rank is not None:
            q = q.where(Graph.rank == rank)
        with Session(self.store.engine) as s:
            rows = s.execute(q.order_by(Graph.rank, Graph.ordinal, Graph.id)).all()
        return [GraphHandle(self.store, *r) for r in rows]

    def graphs_frame(self) -> pandas.DataFrame:
        """One row per graph: ``id``, ``rank``, ``kind``, ``name``, ``compile_id``, ``num_nodes``."""
        return _pandas().DataFrame([(g.id, g.rank, g.kind, g.name, g.compile_id, g.num_nodes) for g in self.graphs()],
                                   columns=["id", "rank", "kind", "name", "compile_id", "num_nodes"])

    def trace(self, rank: int) -> TraceHandle:
        """The newest finished profiler trace of ``rank``; NotFoundError when it has none."""
        from graphdeck.store.schema import Trace

        with Session(self.store.engine) as s:
            row = s.execute(select(Trace.id, Trace.name, Trace.start_ns, Trace.end_ns).where(
                Trace.run_id == self.id, Trace.rank == rank, Trace.status.in_(("ok", "truncated")))
                .order_by(Trace.id.desc())).first()
        if row is None:
            raise NotFoundError(f"run {self.name!r} has no trace of rank {rank}")
        return TraceHandle(self.store, row[0], rank, row[1], row[2], row[3])

    def check_grads(self, **options):
        """The report ``graphdeck check-grads STORE --run NAME`` prints (``GradReport``: ``verdict``
        PASS/FAIL/INCOMPLETE, ``findings``, ``to_text()``/``to_json()``/``to_junit()``); ``options``
        go to :func:`graphdeck.analysis.gradients.core.validate_backward` (``allow``, ``include_buffers``,
        ``expected_params``)."""
        from graphdeck.analysis.gradients.core import validate_backward

        return validate_backward(self.store.engine, self.name, **options)

    def check_ranks(self):
        """The report ``graphdeck check-ranks STORE --run NAME`` prints (``verdict`` OK/FAIL/INCOMPLETE)."""
        from graphdeck.analysis.ranks.core import rank_report
        from graphdeck.store.schema import Run

        with Session(self.store.engine) as s:
            return rank_report(s, s.get(Run, self.id))


@dataclass
class GraphHandle:
    """One stored FX graph."""

    store: Store
    id: int
    rank: int
    kind: str
    name: str
    compile_id: str | None
    num_nodes: int

    def nodes_frame(self) -> pandas.DataFrame:
        """One row per node in graph order: ``idx``, ``name``, ``op`` (placeholder, call_function, …),
        ``target`` (``aten.mm.default``), ``module_path`` (``transformer/h/0/attn``), ``shape`` (list of
        ints or symbols, a list of lists for tuples), ``dtype``, ``device``, ``size_bytes``, ``seq_nr``
        (autograd sequence number), ``stack_trace``."""
        from graphdeck.store.schema import InternedString as String
        from graphdeck.store.schema import Node

        target, module, stack = aliased(String), aliased(String), aliased(String)
        q = (select(Node.idx, Node.name, Node.op, target.value, module.value, Node.shape_json, Node.dtype, Node.device,
                    Node.size_bytes, Node.seq_nr, stack.value)
             .join(target, target.id == Node.target_id)
             .outerjoin(module, module.id == Node.module_path_id)
             .outerjoin(stack, stack.id == Node.stack_trace_id)
             .where(Node.graph_id == self.id).order_by(Node.idx))
        with Session(self.store.engine) as s:
            rows = [list(r) for r in s.execute(q)]
        for r in rows:
            r[5] = json.loads(r[5]) if r[5] else None
        return _pandas().DataFrame(rows, columns=NODE_COLUMNS)

    def edges_frame(self) -> pandas.DataFrame:
        """One row per data edge: ``src_idx``/``dst_idx`` (node indices), ``src``/``dst`` (names),
        ``arg_pos`` (which argument of ``dst``), ``size_bytes`` of the tensor it carries."""
        from graphdeck.store.schema import Edge, Node

        with Session(self.store.engine) as s:
            names = dict(s.execute(select(Node.idx, Node.name).where(Node.graph_id == self.id)).all())
            rows = s.execute(select(Edge.src_idx, Edge.dst_idx, Edge.arg_pos, Edge.size_bytes)
                             .where(Edge.graph_id == self.id).order_by(Edge.dst_idx, Edge.arg_pos)).all()
        return _pandas().DataFrame([(a, b, names.get(a), names.get(b), pos, size) for a, b, pos, size in rows],
                                   columns=EDGE_COLUMNS)

    def to_networkx(self) -> networkx.MultiDiGraph:
        """The graph as a ``networkx.MultiDiGraph``: nodes keyed by name with the columns of
        :meth:`nodes_frame` as attributes, one edge per data edge (``arg_pos``, ``size_bytes``)."""
        try:
            import networkx
        except ImportError as exc:  # pragma: no cover - the notebook extra
            raise ImportError('to_networkx() needs networkx: pip install "graphdeck[notebook]"') from exc
        g = networkx.MultiDiGraph(graph_id=self.id, rank=self.rank, kind=self.kind, name=self.name)
        nodes = self.nodes_frame()
        for rec in nodes.to_dict("records"):
            g.add_node(rec["name"], **rec)
        for rec in self.edges_frame().to_dict("records"):
            g.add_edge(rec["src"], rec["dst"], arg_pos=rec["arg_pos"], size_bytes=rec["size_bytes"])
        return g


@dataclass
class TraceHandle:
    """One rank's stored profiler trace (times in ns since the Unix epoch where the trace gave its base)."""

    store: Store
    id: int
    rank: int
    name: str
    start_ns: int | None
    end_ns: int | None

    def events_frame(self, window: tuple[float, float] | None = None, *, limit: int | None = None) -> pandas.DataFrame:
        """The trace's stored events (``X`` complete and ``i`` instant) in time order: ``ts_ns``,
        ``dur_ns``, ``ph``, ``name``, ``cat``, ``pid``, ``tid``, ``correlation``, ``args`` (dict).
        ``window``: ``(t0_ms, t1_ms)`` since the trace's start, events overlapping it; ``limit``:
        the first rows only."""
        from graphdeck.store.schema import InternedString as String
        from graphdeck.store.schema import TraceEvent

        name, cat = aliased(String), aliased(String)
        q = (select(TraceEvent.ts_ns, TraceEvent.dur_ns, TraceEvent.ph, name.value, cat.value, TraceEvent.pid,
                    TraceEvent.tid, TraceEvent.correlation, TraceEvent.args_json)
             .join(name, name.id == TraceEvent.name_id).outerjoin(cat, cat.id == TraceEvent.cat_id)
             .where(TraceEvent.trace_id == self.id))
        if window is not None:
            base = self.start_ns or 0
            t0, t1 = base + int(window[0] * 1e6), base + int(window[1] * 1e6)
            q = q.where(TraceEvent.ts_ns <= t1, TraceEvent.ts_ns + TraceEvent.dur_ns >= t0)
        q = q.order_by(TraceEvent.ts_ns, TraceEvent.id)
        if limit is not None:
            q = q.limit(limit)
        with Session(self.store.engine) as s:
            rows = [list(r) for r in s.execute(q)]
        for r in rows:
            r[8] = _args(r[8])
        return _pandas().DataFrame(rows, columns=EVENT_COLUMNS)


    def idle_frame(self, kind: str = "gpu", by: str = "step", kernel_wait_us: float = 30.0) -> pandas.DataFrame:
        """Idle time by cause (NOTE: [Idle time by cause] in :mod:`graphdeck.analysis.traces.idle`;
        what the trace page and ``GET /api/runs/<run>/idle`` show), int ns. ``kind="gpu"``: GPU
        stream idle as ``host_wait_ns`` / ``kernel_wait_ns`` / ``other_ns`` (HTA's rule, gaps shorter
        than ``kernel_wait_us`` between queued kernels are kernel wait) with ``host_wait_sync_ns`` and
        ``other_cross_stream_ns``, one row per ``by="step"`` (``step``) or ``by="stream"``
        (``device``, ``stream``); ``kind="cpu"``: each step's host time by cause (``compiled_ns``,
        ``data_loader_ns``, ``collectives_ns``, ``optimizer_ns``, ``eager_ops_ns``,
        ``python_other_ns``...). ``attrs``: ``total`` (and ``outside_steps``, ``reason`` where given).
        Raises :class:`~graphdeck.errors.UsageError` for another ``kind`` or ``by``."""
        from graphdeck.analysis.traces.analyze import TraceData
        from graphdeck.analysis.traces.idle import cpu_time, gpu_idle

        if (kind, by) not in (("gpu", "step"), ("gpu", "stream"), ("cpu", "step")):
            raise UsageError(f"idle_frame: kind={kind!r} by={by!r}: use kind 'gpu' by 'step' or 'stream', or kind 'cpu'")
        with Session(self.store.engine) as s:
            data = TraceData(s, self.id)
            doc = gpu_idle(data, round(kernel_wait_us * 1000)) if kind == "gpu" else cpu_time(data)
        frame = _pandas().DataFrame(doc["streams" if by == "stream" else "steps"])
        frame.attrs.update({k: v for k, v in doc.items() if k not in ("steps", "streams")})
        return frame

    def backward_frame(self) -> pandas.DataFrame:
        """Backward time by forward module (NOTE: [Backward by forward module] in
        :mod:`graphdeck.analysis.traces.backward`; what the trace page and
        ``GET /api/traces/<id>/backward`` show): one row per forward module (or forward op when
        the trace has no module ranges), ``module``, ``backward_ns``, ``backward_ops``, ``ops``
        (backward node → ns), ``forward_ops``; largest first. The result's ``attrs`` hold
        ``backward_ns``, ``attributed_ns``, ``unattributed``, ``by`` and ``note``."""
        from graphdeck.analysis.traces.backward import backward_by_module

        with Session(self.store.engine) as s:
            got = backward_by_module(s, self.id)
        frame = _pandas().DataFrame([vars(r) for r in got.rows],
                                    columns=["module", "backward_ns", "backward_ops", "ops", "forward_ops"])
        frame.attrs.update({k: v for k, v in got.to_dict().items() if k != "rows"})
        return frame


def _args(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        out = json.loads(text)
    except ValueError:
        return {"_raw": text}
    return out if isinstance(out, dict) else {"_value": out}
