"""The capture agent's live watch: a heartbeat per rank in the store, and hang evidence written
while the job still hangs.

# NOTE: [Live watch]
# Each agent runs one daemon thread that, every ``GRAPHDECK_HEARTBEAT_S`` seconds (default
# :data:`DEFAULT_INTERVAL_S`; ``0`` turns the watch off), reads
#   - the rank's training step (optimizer steps taken, as the gradient evidence counts them),
#   - per process group the last collective enqueued and completed, from the Flight Recorder's
#     in-memory status (``_dump_fr_trace(includeCollectives=False)``: ~4 µs, no entries copied),
# and updates the rank's one ``graphdeck_heartbeat`` compile record in place (payload below).
# A group whose last enqueued collective is past its last completed one, unchanged for longer
# than the threshold (``GRAPHDECK_WATCH_THRESHOLD_S``, default :data:`THRESHOLD_FRACTION` of the
# default group's collective timeout), is *stalled*: the rank says so in its heartbeat. Every
# agent reads the run's heartbeats at each beat; when one is stalled, each live rank's watcher
# thread — the training thread stays where it is, blocked in its collective or wherever it
# is — writes the rank's full Flight Recorder dump (reason ``stall``) and its Python stacks
# (``graphdeck_stacks``: every thread's frames, the main thread's innermost frame first in
# line for the report). The lowest stalled rank then waits (up to :data:`GATHER_BEATS` beats)
# for the other live ranks' stacks and writes the hang report
# (:func:`graphdeck.analysis.ranks.live.write_hang_report`). Nothing is stopped, signalled or
# raised: the job ends as it would without graphdeck (by its collective timeout, typically).
#
# Heartbeat payload (JSON): ``{"t": wall s, "step": int | None, "groups": {pg: {"desc", "enqueued",
# "completed", "since": wall s the pair last changed, "in_flight": bool | None (the entries asked)}}, "stalled": {"group", "seq", "for_s"} | None,
# "threshold_s", "timeout_s", "interval_s", "ended": None | "close" | "exit", "beats": int}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import warnings
import weakref

#: compile_events names (the same as graphdeck.analysis.ranks.live, which reads them; kept here so that
#: starting the agent imports no analysis).
HEARTBEAT, STACKS, REQUEST = "graphdeck_heartbeat", "graphdeck_stacks", "graphdeck_watch_request"

DEFAULT_INTERVAL_S = 2.0
#: Steps of time outside the compiled step kept in the heartbeat: the latest, and the longest.
OUTSIDE_RECENT, OUTSIDE_KEPT = 32, 16
THRESHOLD_FRACTION = 0.5
GATHER_BEATS = 3


def fr_status() -> tuple[dict, dict]:
    """``(pg_status, pg_config)`` of this process's Flight Recorder without its entries
    (``{pg: {"last_enqueued_collective", "last_started_collective", "last_completed_collective"}}``,
    ``{pg: {"name", "desc", "ranks"}}``); empty dicts without a distributed build or recorder."""
    try:
        import pickle

        import torch

        d = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeCollectives=False))
        return d.get("pg_status") or {}, d.get("pg_config") or {}
    except Exception:  # noqa: BLE001 - no distributed build, no recorder
        return {}, {}


def _enqueued() -> int | None:
    """Collectives this process enqueued so far, over its groups (the recorder's status); None
    without a recorder."""
    status, _config = fr_status()
    try:
        return sum(int(st.get("last_enqueued_collective", -1) or 0) for st in status.values()) if status else None
    except (TypeError, ValueError, AttributeError):  # a recorder of another version: cannot tell
        return None


def _entry_pending(pg: str, seq: int) -> bool:
    """Whether the recorder's entry of collective ``seq`` of group ``pg`` is neither retired nor
    completed. No such entry (the newest entry is always in the ring buffer, so the recorder is not
    recording) or no readable dump: False — no stall is claimed on the lagging status alone."""
    try:
        import pickle

        import torch

        d = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
    except Exception:  # noqa: BLE001 - no distributed build, no recorder
        return False
    for e in reversed(d.get("entries") or []):
        g = e.get("process_group")
        if e.get("collective_seq_id") == seq and not e.get("is_p2p") and (g[0] if isinstance(g, (list, tuple)) else g) == pg:
            return not e.get("retired") and e.get("state") != "completed"
    return False


def group_descs() -> dict[str, str]:
    """``{pg name: group_desc}`` of this process's process groups (the recorder's ``pg_config``
    names only groups that registered with it: none on gloo); empty without torch.distributed."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return {str(n): pg.group_desc for pg, n in list(c10d._world.pg_names.items())
                if getattr(pg, "group_desc", None)}
    except Exception:  # noqa: BLE001 - a torch without these internals
        return {}


def default_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds, None before it exists."""
    try:
        import torch.distributed as dist

        from graphdeck.capture.process_groups import _timeout_s

        if dist.is_available() and dist.is_initialized():
            return _timeout_s(dist.distributed_c10d._get_default_group())
    except Exception:  # noqa: BLE001 - a torch without these internals
        return None
    return None


def python_stacks() -> dict:
    """Every thread's Python stack now: ``{"t": wall s, "threads": [{"name", "main", "frames":
    [[file, line, function, source text], ...]}]}`` (outermost frame first), the main thread first.
    Reads the frames only (``sys._current_frames``): no thread is stopped."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)]
        threads.append({"name": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    threads.sort(key=lambda t: not t["main"])
    return {"t": time.time(), "threads": threads}


class Heartbeat:
    """One rank's heartbeat thread (NOTE: [Live watch]). Never raises into training."""

    def __init__(self, agent, interval_s: float, threshold_s: float | None):
        self._agent = weakref.ref(agent)
        self.interval_s = interval_s
        self.threshold_fixed = threshold_s
        self.beats = 0
        self.cpu_s = 0.0  # this thread's CPU time in beats (bench/bench_heartbeat.py)
        self._row: int | None = None
        self._seen: dict[str, tuple] = {}  # pg -> ((enqueued, completed), since)
        self._step_hook = None  # NOTE: only without gradient evidence (_own_steps)
        self._step_counts: dict[int, int] = {}
        self._confirmed: dict[tuple, bool] = {}  # (pg, (enqueued, completed)) -> in flight per the entries
        self._handled: set = set()  # stalls answered (their (rank, group, seq))
        self._reported: set = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._own_steps()  # from the start: steps before the first beat count too
        self.step_open = False  # NOTE: [Time outside the compiled step]
        self._step_end: float | None = None
        self._outside: dict[int, float | None] = {}  # step -> seconds from the last optimizer step to its forward
        self._enqueued_at_end: int | None = None
        self._end_hook = None
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._end_hook = register_optimizer_step_post_hook(self._step_ended)
        except Exception:  # noqa: BLE001 - a torch without the hook
            self._end_hook = None
        self._compile_cb = None
        try:  # Dynamo's compile start (before it traces) ends the time outside the step too
            import torch
            from torch._dynamo.callback import callback_handler

            me = weakref.ref(self)

            def compile_started(_args) -> None:
                hb = me()
                if hb is not None and hb.step_open and torch.is_grad_enabled():
                    a = hb._agent()
                    if a is not None:
                        hb.entered(a)

            self._compile_cb = callback_handler.register_start_callback(compile_started)
        except Exception:  # noqa: BLE001 - a torch without the callback
            self._compile_cb = None
        self._thread = threading.Thread(target=self._loop, name="graphdeck-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, agent) -> Heartbeat | None:
        """A running heartbeat for ``agent`` per ``GRAPHDECK_HEARTBEAT_S`` and
        ``GRAPHDECK_WATCH_THRESHOLD_S``, or None when switched off or unreadable (one warning)."""
        try:
            interval = float(os.environ.get("GRAPHDECK_HEARTBEAT_S", DEFAULT_INTERVAL_S))
            thr = os.environ.get("GRAPHDECK_WATCH_THRESHOLD_S")
            if interval <= 0:
                return None
            return cls(agent, interval, float(thr) if thr else None)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: no live watch: {type(exc).__name__}: {exc}")
            return None

    # -------------------------------------------------------------- time outside the compiled step
    # NOTE: [Time outside the compiled step]
    # A rank that spends long between two training steps (its data loader, an evaluation only it
    # runs) arrives late at the next step's collectives while its peers wait there. Per step, the
    # wall seconds from the end of the rank's last optimizer step (a global post-step hook) to its
    # next grad-enabled call of a compiled graph (the capture's call wrapper: an evaluation under
    # no_grad does not end it), or the start of a grad-enabled compile (Dynamo's start callback,
    # else the backend's call: a recompile's time is the compile's, judged as compile skew), are
    # kept in the heartbeat as ``"outside": {step: s | None}`` — None when a collective was
    # enqueued in between (a pipeline stage's receive, DDP's buffer broadcast: the time holds
    # waits for peers) — the last :data:`OUTSIDE_RECENT` steps and the :data:`OUTSIDE_KEPT`
    # longest. Two clock reads and two reads of the recorder's status a step (~14 µs,
    # bench/bench_heartbeat.py); the compiled call reads one flag. Judged by
    # analysis/ranks/time_verdicts.py's ``outside_finding`` against the collective timeout.

    def _step_ended(self, *_a, **_k) -> None:  # an optimizer post-step hook: never raises
        self._step_end = time.time()
        self._enqueued_at_end = _enqueued()
        self.step_open = True

    def entered(self, agent) -> None:
        """A grad-enabled compiled call while a step is open: the step's time outside ends now."""
        self.step_open = False
        if self._step_end is None:
            return
        try:
            step = agent.training_step()
        except Exception:  # noqa: BLE001 - capture never breaks training
            return
        if step is None:
            return
        out = self._outside
        # a collective issued in between (a pipeline stage's receive, DDP's buffer broadcast): the
        # time holds waits for peers, not only this rank's own work — kept as unknown (None)
        gap = round(time.time() - self._step_end, 3)
        out[step] = gap if _enqueued() == self._enqueued_at_end else None
        if len(out) > OUTSIDE_RECENT + OUTSIDE_KEPT:
            recent = sorted(out)[-OUTSIDE_RECENT:]
            longest = sorted(out, key=lambda k: out[k] or 0.0)[-OUTSIDE_KEPT:]
            self._outside = {k: out[k] for k in sorted({*recent, *longest})}

    # ------------------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._agent() is None:
                return  # the agent was collected: nothing left to watch
            t0 = time.thread_time()
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - capture never breaks training
                if self.beats == 0:
                    warnings.warn(f"graphdeck: live watch beat failed: {type(exc).__name__}: {exc}")
            self.cpu_s += time.thread_time() - t0

    def stop(self, ended: str) -> None:
        """Stop the thread and write a last heartbeat saying how the rank ended (``close``/``exit``)."""
        if self._stop.is_set():
            return  # ended once (close, then the exit hook): the first word stays
        self._stop.set()
        try:
            self.beat(ended=ended, watch=False)
            if self._step_hook:
                self._step_hook.remove()
            if self._end_hook is not None:
                self._end_hook.remove()
            if self._compile_cb is not None:
                from torch._dynamo.callback import callback_handler

                if self._compile_cb in callback_handler.start_callbacks:
                    callback_handler.start_callbacks.remove(self._compile_cb)
        except Exception:  # noqa: BLE001 - capture never breaks training
            pass

    def beat(self, ended: str | None = None, watch: bool = True) -> None:
        """One heartbeat: update this rank's row; when a rank is stalled, answer it."""
        agent = self._agent()
        if agent is None or agent._store_failed is not None:
            return
        writer = agent._writer
        if writer is None:
            return  # opened by the training thread (watch, compile): never raced from here
        with self._lock:
            payload = self._payload(agent, ended)
            others = self._write(writer, payload, read=watch)
        self.beats += 1
        if watch:
            self._answer(agent, writer, payload, others)

    def _payload(self, agent, ended: str | None) -> dict:
        now = time.time()
        status, config = fr_status()
        timeout = default_timeout_s()
        threshold = self.threshold_fixed
        if threshold is None and timeout:
            threshold = THRESHOLD_FRACTION * timeout
        groups, stalled = {}, None
        descs = group_descs() if status else {}
        for pg, st in status.items():
            pair = (st.get("last_enqueued_collective", -1), st.get("last_completed_collective", -1))
            prev = self._seen.get(pg)
            since = prev[1] if prev is not None and prev[0] == pair else now
            self._seen[pg] = (pair, since)
            desc = ((config.get(pg) or {}).get("desc") if isinstance(config.get(pg), dict) else None) or descs.get(pg)
            # in flight per the recorder's entries, asked once a suspect pair has held two beats
            # (None: not asked); a collective only the lagging status calls open is not a stall
            in_flight = None
            if pair[0] > pair[1] and now - since >= min(2 * self.interval_s, threshold or float("inf")) and not ended:
                in_flight = self._pending(pg, pair)
            groups[pg] = {"desc": desc, "enqueued": pair[0], "completed": pair[1], "since": since,
                          "in_flight": in_flight}
            if threshold is not None and in_flight and now - since > threshold:
                if stalled is None or since < stalled["since"]:
                    stalled = {"group": pg, "desc": desc, "seq": pair[0], "since": since,
                               "for_s": round(now - since, 3)}
        ev = getattr(agent, "_evidence", None)
        step = getattr(ev, "_opt_steps", None) if ev is not None else self._own_steps()
        return {"t": now, "step": step, "groups": groups, "stalled": stalled,
                "outside": {str(k): v for k, v in self._outside.copy().items()},
                "threshold_s": threshold, "timeout_s": timeout, "interval_s": self.interval_s,
                "ended": ended, "beats": self.beats, "pid": os.getpid()}

    def _own_steps(self) -> int | None:
        """Optimizer steps taken, counted here when the gradient evidence (which counts them) is
        off: a global post-step hook counting the steps of the first optimizer seen (several
        optimizers step once each a training step). None until one steps."""
        if self._step_hook is None:
            try:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                counts = self._step_counts

                def count(opt, *_a, **_k):
                    counts.setdefault(id(opt), 0)
                    counts[id(opt)] += 1

                self._step_hook = register_optimizer_step_post_hook(count)
            except Exception:  # noqa: BLE001 - a torch without the hook
                self._step_hook = False
        return next(iter(self._step_counts.values()), None)

    def _pending(self, pg: str, pair: tuple) -> bool:
        """Whether collective ``pair[0]`` of group ``pg`` is really still in flight: the status's
        completed count lags on gloo (a collective that returned can read as not completed for
        good), so a suspect pair is confirmed once from the recorder's entries (no stacks: ~14 ms
        for 2,000 entries), the answer kept while the pair stays the same."""
        key = (pg, pair)
        if key not in self._confirmed:
            self._confirmed = {k: v for k, v in self._confirmed.items() if k[0] != pg}
            self._confirmed[key] = _entry_pending(pg, pair[0])
        return self._confirmed[key]

    def _write(self, writer, payload: dict, read: bool) -> dict[int, dict]:
        """Update (first beat: insert) this rank's row; returns the other ranks' latest heartbeats."""
        from sqlalchemy import insert, select, update

        from graphdeck.store.db import retrying
        from graphdeck.store.schema import CompileEvent

        text = json.dumps(payload, separators=(",", ":"))
        table = CompileEvent.__table__

        # only this rank's own row and the heartbeat rows are touched: no need to wait for the
        # queued writes (NOTE: [Writes off the compiling thread]); the hang report's reads do
        engine = writer.wait_open().engine if hasattr(writer, "wait_open") else writer.engine

        def do():  # SQLAlchemy Core on one connection: the ORM session cost ~2 ms a beat
            with engine.begin() as conn:
                rid = self._row
                if rid is None or not conn.execute(update(table).where(table.c.id == rid).values(payload=text)).rowcount:
                    rid = conn.execute(insert(table).values(run_id=writer.run_id, rank=writer.rank, name=HEARTBEAT,
                                                            compile_id=None, metadata_json="{}", payload=text)
                                       ).inserted_primary_key[0]
                rows = conn.execute(select(table.c.rank, table.c.name, table.c.payload).where(
                    table.c.run_id == writer.run_id, table.c.name.in_((HEARTBEAT, REQUEST)))
                    .order_by(table.c.id)).all() if read else []
            return rid, rows

        self._row, rows = retrying(do)
        out: dict[int, dict] = {}
        for r, name, p in rows:  # a watch's request (the latest) as rank -1
            if name == REQUEST:
                r = -1
            elif r == writer.rank:
                continue
            try:
                out[r] = json.loads(p or "{}")
            except ValueError:
                continue
        return out

    # ------------------------------------------------------------------------------ a stall
    def _answer(self, agent, writer, mine: dict, others: dict[int, dict]) -> None:
        beats = {writer.rank: mine, **others}
        stalls = {(r, b["stalled"]["group"], b["stalled"]["seq"]) for r, b in beats.items()
                  if b.get("stalled") and not b.get("ended")}
        new = stalls - self._handled
        if not new:
            return
        self._handled |= stalls
        if agent._flight is not None:
            agent._flight.write("stall")
        writer.write_compile_events([{"name": STACKS, "compile_id": None,
                                      "metadata": {"reason": "stall", "step": mine.get("step")},
                                      "payload": json.dumps(python_stacks(), separators=(",", ":"))}])
        # the lowest stalled rank reports; for a watch's request alone (rank -1), the lowest rank
        ranks = sorted(r for r, _g, _s in stalls if r >= 0) or sorted(r for r in beats if r >= 0)
        if not ranks or ranks[0] != writer.rank or (stalls & self._reported):
            return
        self._reported |= stalls
        asked = beats.get(-1) if all(r < 0 for r, _g, _s in stalls) else None  # a watch's request alone
        self._gather_and_report(writer, beats, (asked or mine).get("threshold_s"))

    def _gather_and_report(self, writer, beats: dict[int, dict], threshold_s: float | None) -> None:
        """As the lowest stalled rank: wait for the live ranks' stacks, then write the report."""
        from sqlalchemy import select
        from sqlalchemy.orm import Session

        from graphdeck.analysis.ranks.live import REPORT, write_hang_report
        from graphdeck.store.schema import CompileEvent

        detected = time.time()
        with Session(writer.engine) as s:  # stacks written since the run's last report are this stall's
            after = s.scalar(select(CompileEvent.id).where(CompileEvent.run_id == writer.run_id,
                                                           CompileEvent.name == REPORT)
                             .order_by(CompileEvent.id.desc()).limit(1)) or 0
        live = {r for r, b in beats.items() if r >= 0 and not b.get("ended")
                and detected - float(b.get("t") or 0) < GATHER_BEATS * float(b.get("interval_s") or self.interval_s)}
        deadline = detected + GATHER_BEATS * self.interval_s
        while True:
            with Session(writer.engine) as s:
                have = {r for (r,) in s.execute(select(CompileEvent.rank).where(
                    CompileEvent.run_id == writer.run_id, CompileEvent.name == STACKS,
                    CompileEvent.id > after)) if r in live}
            if have >= live or time.time() > deadline:
                break
            time.sleep(min(0.25, self.interval_s / 4))
        text = write_hang_report(writer.engine, writer.run_id, rank=writer.rank, detected_at=detected,
                                 threshold_s=threshold_s)
        if text:
            print("\n".join(f"graphdeck: {line}" for line in text), file=sys.stderr, flush=True)


__all__ = ["DEFAULT_INTERVAL_S", "HEARTBEAT", "Heartbeat", "STACKS", "THRESHOLD_FRACTION", "fr_status",
           "python_stacks"]
