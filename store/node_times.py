"""Per-trace node times: written when a trace is ingested, read by ``diff-runs`` instead of the events.

# NOTE: [Node-time table]
Mapping a trace's events onto FX nodes (NOTE: [Node time per step] in
:mod:`graphdeck.analysis.diff.times`) reads every event of the trace: ~0.25 s CPU for a trace of
24k events, 4.2 of the 4.5 s of a diff of two 8-rank runs (bench/RESULTS.md). The ingest does it
once, right after the trace is stored (:func:`record`, called by
:func:`graphdeck.store.traces.ingest_trace`), and keeps the result as one :class:`NodeTimeSet`
per (trace, ``method``) with one :class:`NodeTime` row per node that ran: graph id and node name,
``total_ns`` and ``count`` over the whole trace and ``steps_ns_json`` (ns per profiled step).
Other per-node consumers (the ``time`` overlay) read ``total_ns``; a mapper of its own writes its
rows under another ``method``.

A set is the mapping of the trace against the rank's graphs *as they were then*. Graphs or kernel
links stored after the trace (an import that brings the trace first, ``link_kernels`` after a
live capture's ingest, a merge into a run that already had rows) can change it, so each set
records the rank's state (AOT graphs: how many and the newest id; kernel links: how many) and
:func:`load` refuses a set whose rank has moved on. A refused or absent set — a store written
before schema 5, a trace ingested by an older graphdeck, an ingest whose mapping failed — is not an
error: the reader maps the events as before and says so (``RankTimes.times_from``). The verdicts
are the same either way; only the time differs.

Shapes and units: ``steps_ns_json`` is a JSON list of ``NodeTimeSet.steps`` ints (ns); ``total_ns``
int ns (time before the first profiled step included); ``count`` int calls.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import delete, func, insert, inspect, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.store.schema import Graph, KernelNode, NodeTime, NodeTimeSet, Trace

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

#: The mapper of :mod:`graphdeck.analysis.diff.times` and its version: bump it when that
#: mapping changes, so sets written by an older graphdeck are recomputed rather than trusted.
METHOD = "run_diff/2"  # 2: one mapping with every other consumer (map_trace), CPU Inductor kernels too
AOT_KINDS = ("aot_forward", "aot_backward", "aot_inference")


@dataclass
class TraceNodeTimes:
    """One trace's node times. ``nodes[i]`` = (graph id, node name) has ``step_ns[i]`` (int64 ns,
    ``steps`` long), ``total_ns[i]`` and ``count[i]``; ``missing`` says why nothing mapped. The
    arrays are None only in a result made without mapping (:func:`no_graphs`, ``nodes`` empty).
    numpy is imported where the arrays are made, not here: a trace ingested into a run without
    graphs never loads it (issue 26 item 4)."""

    trace_id: int
    steps: int = 1
    source: str | None = None
    mapped_calls: int = 0
    unmapped_calls: int = 0
    missing: str | None = None
    nodes: list[tuple[int, str]] = field(default_factory=list)
    step_ns: np.ndarray | None = field(default_factory=lambda: _zeros((0, 1)))
    total_ns: np.ndarray | None = field(default_factory=lambda: _zeros(0))
    count: np.ndarray | None = field(default_factory=lambda: _zeros(0))


def _zeros(shape) -> np.ndarray:
    import numpy as np

    return np.zeros(shape, dtype=np.int64)


def no_graphs(trace_id: int, rank: int) -> TraceNodeTimes:
    """What :func:`graphdeck.analysis.diff.times.trace_node_times` gives for a rank without
    AOT graphs (same ``missing`` text), made without numpy or the mapper: no nodes, arrays None."""
    return TraceNodeTimes(trace_id, missing=f"rank {rank}: no AOTAutograd graph stored to map trace {trace_id} onto",
                          step_ns=None, total_ns=None, count=None)


def rank_states(session: Session, run_id: int, rank: int | None = None) -> dict[int, tuple[int, int | None, int]]:
    """rank → ``(AOT graphs of the rank, newest such graph id or None, kernel links of the rank)``
    of run ``run_id`` (every rank with either, or only ``rank``; a rank with neither reads
    ``(0, None, 0)``): what a node-time set or a trace's kept kernel links were computed against.
    Two grouped queries for all ranks."""
    g = select(Graph.rank, func.count(Graph.id), func.max(Graph.id)).where(Graph.run_id == run_id,
                                                                           Graph.kind.in_(AOT_KINDS))
    k = select(KernelNode.rank, func.count(KernelNode.id)).where(KernelNode.run_id == run_id)
    if rank is not None:
        g, k = g.where(Graph.rank == rank), k.where(KernelNode.rank == rank)
    out: dict[int, tuple[int, int | None, int]] = defaultdict(lambda: (0, None, 0))
    for r, n, last in session.execute(g.group_by(Graph.rank)):
        out[r] = (int(n), last, 0)
    for r, n in session.execute(k.group_by(KernelNode.rank)):
        out[r] = (*out[r][:2], int(n))
    return out


def rank_state(session: Session, run_id: int, rank: int) -> tuple[int, int | None, int]:
    """:func:`rank_states` of one rank."""
    return rank_states(session, run_id, rank)[rank]


def has_table(session: Session) -> bool:
    """Whether the store has the node-time tables (schema 5 on; an older store opened read-only
    has not: ``graphdeck.store.migrate.OPTIONAL_TABLES``)."""
    return inspect(session.connection()).has_table(NodeTimeSet.__tablename__)


def valid_set(session: Session, trace_id: int, run_id: int, rank: int,
              method: str = METHOD) -> tuple[NodeTimeSet | None, str | None]:
    """The node-time set of trace ``trace_id`` (of run ``run_id``, rank ``rank``) if it can be
    trusted: ``(set, None)``, else ``(None, why)`` (NOTE: [Node-time table]); never raises for a
    missing or stale set."""
    if not has_table(session):
        return None, "the store predates the node-time table (schema < 5)"
    head = session.execute(select(NodeTimeSet).where(NodeTimeSet.trace_id == trace_id,
                                                     NodeTimeSet.method == method)).scalar_one_or_none()
    if head is None:
        older = session.scalars(select(NodeTimeSet.method).where(NodeTimeSet.trace_id == trace_id)).first()
        if older is not None:
            return None, f"trace {trace_id}'s node times were kept by an older mapping ({older}, not {method})"
        return None, f"trace {trace_id} was stored without node times (ingested before they were kept)"
    if (head.graphs_count, head.last_graph_id, head.kernel_nodes_count) != rank_state(session, run_id, rank):
        return None, f"rank {rank}'s graphs or kernel links changed after trace {trace_id} was ingested"
    return head, None


def load(session: Session, trace_id: int, run_id: int, rank: int,
         method: str = METHOD) -> tuple[TraceNodeTimes | None, str | None]:
    """The stored node times of trace ``trace_id`` (of run ``run_id``, rank ``rank``) by (graph id,
    node name): ``(times, None)``, or ``(None, why)`` when there is no set to trust (:func:`valid_set`);
    never raises for a missing or stale set."""
    head, why = valid_set(session, trace_id, run_id, rank, method)
    if head is None:
        return None, why
    import numpy as np

    rows = session.connection().execute(select(NodeTime.graph_id, NodeTime.node_name, NodeTime.total_ns, NodeTime.count,
                                  NodeTime.steps_ns_json).where(NodeTime.set_id == head.id)
                           .order_by(NodeTime.id)).all()
    out = TraceNodeTimes(trace_id, steps=head.steps, source=head.source, mapped_calls=head.mapped_calls,
                         unmapped_calls=head.unmapped_calls, missing=head.missing)
    out.nodes = [(r[0], r[1]) for r in rows]
    out.total_ns = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
    out.count = np.fromiter((r[3] for r in rows), dtype=np.int64, count=len(rows))
    if rows:
        out.step_ns = np.array(json.loads("[" + ",".join(r[4] for r in rows) + "]"), dtype=np.int64)
    else:
        out.step_ns = np.zeros((0, head.steps), dtype=np.int64)
    if out.step_ns.shape != (len(rows), head.steps):
        return None, f"trace {trace_id}'s stored node times are malformed"
    return out, None


def store(session: Session, run_id: int, rank: int, times: TraceNodeTimes,
          state: tuple[int, int | None, int], method: str = METHOD) -> int:
    """Write ``times`` as the set of ``(times.trace_id, method)``, replacing an older one, in the
    caller's transaction; ``state`` is :func:`rank_state` read *before* the mapping. Returns the
    set's id."""
    session.execute(delete(NodeTimeSet).where(NodeTimeSet.trace_id == times.trace_id, NodeTimeSet.method == method))
    head = NodeTimeSet(trace_id=times.trace_id, run_id=run_id, rank=rank, method=method, source=times.source,
                       steps=times.steps, mapped_calls=times.mapped_calls, unmapped_calls=times.unmapped_calls,
                       missing=times.missing and times.missing[:2000], graphs_count=state[0],
                       last_graph_id=state[1], kernel_nodes_count=state[2])
    session.add(head)
    session.flush()
    if times.nodes:
        steps = times.step_ns.tolist()
        session.execute(insert(NodeTime), [
            {"set_id": head.id, "graph_id": g, "node_name": n, "total_ns": int(t), "count": int(c),
             "steps_ns_json": json.dumps(s, separators=(",", ":"))}
            for (g, n), t, c, s in zip(times.nodes, times.total_ns.tolist(), times.count.tolist(), steps)])
    return head.id


def record(engine: Engine, trace_id: int, by_kernel: dict | None = None) -> int | None:
    """Map trace ``trace_id`` onto its rank's graphs and store the result (NOTE: [Node-time
    table]); returns the set's id. ``by_kernel``: the trace's ``map_trace`` kernel → node links
    when the caller has them (the ingest: :func:`graphdeck.analysis.traces.export_map.record_links`).
    Best effort, for the ingest: any failure is logged and gives None (readers then map the events
    themselves)."""
    from graphdeck.store.db import retrying, write_session

    try:
        with Session(engine) as s:
            if not has_table(s):
                return None
            run_id, rank = s.execute(select(Trace.run_id, Trace.rank).where(Trace.id == trace_id)).one()
            state = rank_state(s, run_id, rank)  # before the mapping: a graph added meanwhile makes it stale
            if state[0]:
                from graphdeck.analysis.diff.times import trace_node_times

                times = trace_node_times(s, run_id, rank, trace_id, by_kernel=by_kernel)
            else:  # nothing to map onto: the mapper's answer without loading it (and numpy)
                times = no_graphs(trace_id, rank)

        def write() -> int:
            with write_session(engine) as s:
                return store(s, run_id, rank, times, state)

        return retrying(write)
    except Exception:  # noqa: BLE001 - the trace is stored; only the shortcut is missing
        log.exception("trace %s: could not keep its node times", trace_id)
        return None


def refresh(engine: Engine, trace_id: int) -> int | None:
    """:func:`record` again when trace ``trace_id``'s set is missing or stale (e.g. the capture
    linked kernels to nodes after the ingest); the set's id, None when it could not be written.
    Best effort: never raises."""
    try:
        with Session(engine) as s:
            run_id, rank = s.execute(select(Trace.run_id, Trace.rank).where(Trace.id == trace_id)).one()
            head, _why = valid_set(s, trace_id, run_id, rank)
            if head is not None:
                return head.id
    except Exception:  # noqa: BLE001 - the caller (a capture) must not fail for a shortcut
        log.exception("trace %s: could not check its node times", trace_id)
        return None
    return record(engine, trace_id)
