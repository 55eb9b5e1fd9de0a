"""The kernel → node links export-trace writes: kept at trace ingest, or computed with less work than
a full mapping.

# NOTE: [Export kernel links]
``graphdeck export-trace`` needs of :func:`graphdeck.analysis.traces.mapping.map_trace` only
``by_kernel`` (GPU event id → ``(graph id, [node names])``) and ``comm_label`` (GPU event id →
what a collective carries), for every rank it writes. :func:`kernel_links` gives the same two
dicts (the same keys, values and order) as ``map_trace`` on the same events, skipping what only the
other results need: launch chains are built only for kernels (not memcpy/memset) and only on the
threads of their launches, no ``Link`` objects or innermost operators are made, and the optimizer
step / unmapped bookkeeping and the per-node times are left out, and a wrapper call's table
choice is kept per (region, call names), which repeat every step. The kernel tables, twin
graphs and collective mapping are ``mapping``'s own functions. A trace where ``map_trace``
takes its CPU path (no kernel time and no communication kernel: NOTE: [CPU trace mapping]) is
handed to ``map_trace`` whole. tests/test_export_trace.py checks the equality on the 2 x H200 DDP
store and on HTA's NCCL traces.

# NOTE: [Stored kernel links]
The part of those links that costs (launch chains, wrapper calls → kernel tables: ~0.13 s CPU of
a 50k-event rank, a quarter of its export) is computed once when the trace is ingested, in the
ingesting process (:func:`record_links`, called by :func:`graphdeck.store.traces.ingest_trace`
like the collective index), and kept as one ``trace_links`` row (:class:`graphdeck.store.schema.
TraceLinks`). ``links_json`` is ``{"trace": trace id, "groups": [[graph id, [node, ...]], ...],
"kernels": [event id deltas, ascending], "group": [index into groups, one per kernel],
"comm": [event id deltas of the communication kernels no wrapper call launched]}``. Export
(:func:`stored_links`) reads that row and maps only the communication kernels (``_map_comm``,
a few hundred a trace), so the collective labels always follow the records of the export's time.
The ingest reads the trace for them a few profiler steps at a time (NOTE: [Bounded launch sweep]
in launch_sweep.py; the host ranges only when the rank has kernel tables to use them), so its
memory does not grow with the trace (so does :func:`refresh_links`); export's :func:`kernel_links` reads its events whole.
For a rank without kernel tables the ingest does not read the kernels again: the collective index's
pass over them (:func:`~graphdeck.analysis.traces.collectives.build_index`) fills a
:class:`KernelTally` (their total time, the communication kernels) that :func:`record_links` takes.

Stale links are never used: the row records what they were computed against — the rank's AOT
graphs and kernel links (:func:`graphdeck.store.node_times.rank_states`, as the node-time table
does) and the trace's ``X`` events (count, first and last id) — and export recomputes them
(:func:`kernel_links`) when any of these differ, when a graph id in them is not of the trace's
run, or when the row's ``trace`` is another trace (a row copied by ``store/merge.py`` into a store
where the ids moved), when the store has no ``trace_links`` table (schema < 6, a trace ingested
by an older graphdeck), or when the trace takes ``map_trace``'s CPU path (no row is kept for it).
A capture that links kernels after its own ingest refreshes the row (:func:`refresh_links`).
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import accumulate
from sys import intern
from typing import NamedTuple

import orjson
from sqlalchemy import delete, func, inspect, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule
from graphdeck.analysis.traces.data import Ev
from graphdeck.analysis.traces.launch_sweep import Launch, bounded, launches, stream_kernels
from graphdeck.analysis.traces.links import _chains
from graphdeck.analysis.traces.mapping import (
    _REGION,
    WRAPPER_PREFIX,
    KernelMapping,
    _map_comm,
    _tables,
    map_trace,
    wrapper_kernel_nodes,
)
from graphdeck.errors import NotFoundError
from graphdeck.store.node_times import rank_states
from graphdeck.store.schema import Graph, Trace, TraceEvent, TraceLinks

log = logging.getLogger(__name__)

#: ``trace_links.method`` of the links below; bump it when the mapping changes, so rows written by an
#: older graphdeck are recomputed rather than trusted.
METHOD = "export/1"
ByKernel = dict[int, tuple[int, list[str]]]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a block that yields nothing. Reading a trace
    makes ~50k row tuples (and, to compute its links, as many events and their launch chains) that
    all stay alive: each few hundred of them start a collection, and the full ones walk them all
    again, finding nothing (no cycles are made here) — a fifth of a recomputing export's CPU."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Call(NamedTuple):
    """What :func:`~graphdeck.analysis.traces.mapping.wrapper_kernel_nodes` reads of a kernel's
    calling op (id, start ns, name)."""

    id: int
    ts: int
    name: str


def _compute(session: Session, trace: Trace, kernels: Iterable[Launch],
             tables: dict[int, dict] | None = None) -> tuple[ByKernel, list[Ev], bool]:
    """``(by_kernel of the kernels wrapper calls launched, communication kernels launched by
    none, cpu_path)`` of ``trace`` (NOTE: [Export kernel links]); ``cpu_path``: ``map_trace`` would
    take its CPU path (the first two are then empty). ``kernels``: ``(kernel, launch call, chain)``
    by the kernels' ``(ts, id)`` (:func:`~graphdeck.analysis.traces.launch_sweep.launches` of a
    list, or a bounded sweep of the stored trace: NOTE: [Bounded launch sweep]); ``tables``: the
    rank's kernel tables when the caller read them."""
    tables = _tables(session, trace.run_id, trace.rank) if tables is None else tables
    wrappers: dict[int, list[tuple[Ev, Ev | None]]] = defaultdict(list)
    wrapper_ev: dict[int, tuple[Ev, str | None]] = {}
    calls: dict[int, _Call] = {}
    comm, comm_kernels, kernel_ns = CommRule(), [], 0
    for k, _rt, chain in kernels:
        kernel_ns += k.dur
        at = None
        if tables:
            for i in range(len(chain) - 1, -1, -1):
                if chain[i].name.startswith(WRAPPER_PREFIX):
                    at = i
                    break
        if at is None:
            if comm.is_comm(k.name):
                comm_kernels.append(k)
            continue
        region = next((m.group(1) for e in reversed(chain[:at]) if (m := _REGION.match(e.name))), None)
        wrapper_ev[chain[at].id] = (chain[at], region)
        call = chain[at + 1] if at + 1 < len(chain) else None
        if call is not None:  # kept slim: a kernel's id, its call's id, start and (shared) name
            call = calls.get(call.id) or calls.setdefault(call.id, _Call(call.id, call.ts, intern(call.name)))
        wrappers[chain[at].id].append((k.id, call))
    if not kernel_ns and not comm_kernels:  # map_trace's CPU path (NOTE: [CPU trace mapping])
        return {}, [], True
    calls.clear()
    by_kernel: ByKernel = {}
    shared: dict[tuple, tuple[int, list[str]]] = {}  # one (graph, nodes) value per distinct group
    for kid, gid, got in wrapper_kernel_nodes(session, trace, tables, wrappers, wrapper_ev):
        if got:
            key = (gid, *got[0])
            value = shared.get(key)
            if value is None:
                value = shared[key] = (gid, list(got[0]))
            by_kernel[kid] = value
    return by_kernel, comm_kernels, False


def with_comm(session: Session, trace: Trace, by_kernel: ByKernel, comm_kernels: list[Ev]) -> tuple[ByKernel, dict[int, str]]:
    """``(by_kernel, comm_label)``: ``by_kernel`` (updated in place) plus the communication kernels
    ``comm_kernels`` mapped onto the nodes of the parameters they carry (``mapping._map_comm``)."""
    out = KernelMapping(trace.id)
    out.by_kernel = by_kernel
    _map_comm(session, trace, comm_kernels, out, Counter(), Counter())
    return out.by_kernel, out.comm_label


def kernel_links(session: Session, trace_id: int, events: list[Ev]) -> tuple[ByKernel, dict[int, str]]:
    """``(by_kernel, comm_label)`` of trace ``trace_id`` as :func:`~graphdeck.analysis.traces.
    mapping.map_trace` gives them (NOTE: [Export kernel links]), computed from the events.
    ``events``: the trace's ``X`` events ordered by start (:func:`~graphdeck.analysis.traces.
    data.load_events`).

    Raises NotFoundError when the trace does not exist."""
    trace = session.get(Trace, trace_id)
    if trace is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    by_kernel, comm_kernels, cpu_path = _compute(session, trace, launches(events, _chains))
    if cpu_path:
        full = map_trace(session, trace_id, events)
        return full.by_kernel, full.comm_label
    return with_comm(session, trace, by_kernel, comm_kernels)


def _deltas(ids: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *ids], ids)]


def encode(trace_id: int, by_kernel: ByKernel, comm_kernels: list[Ev]) -> str:
    """``links_json`` of a ``trace_links`` row (NOTE: [Stored kernel links])."""
    groups: dict[tuple, int] = {}
    ids = sorted(by_kernel)
    group = [groups.setdefault((by_kernel[i][0], *by_kernel[i][1]), len(groups)) for i in ids]
    return orjson.dumps({"trace": trace_id, "groups": [[g[0], list(g[1:])] for g in groups], "kernels": _deltas(ids),
                         "group": group, "comm": _deltas(sorted(k.id for k in comm_kernels))}).decode()


def decode(raw: str) -> tuple[int, ByKernel, list[int]]:
    """``(trace id, by_kernel, communication kernel ids)`` of a ``links_json`` (NOTE: [Stored kernel
    links]); the node lists of one group are one list object."""
    doc = orjson.loads(raw)
    groups = [(g[0], g[1]) for g in doc["groups"]]
    by_kernel = dict(zip(accumulate(doc["kernels"]), [groups[i] for i in doc["group"]]))
    return doc["trace"], by_kernel, list(accumulate(doc["comm"]))


def has_table(session: Session) -> bool:
    """Whether the store has ``trace_links`` (schema 6 on; an older store opened read-only has not)."""
    return inspect(session.connection()).has_table(TraceLinks.__tablename__)


def _fingerprint(session: Session, trace_id: int) -> tuple[int, int | None, int | None]:
    """``(count, first id, last id)`` of trace ``trace_id``'s ``X`` events: one aggregate query."""
    count, first, last = session.execute(select(func.count(TraceEvent.id), func.min(TraceEvent.id), func.max(
        TraceEvent.id)).where(TraceEvent.trace_id == trace_id, TraceEvent.ph == "X")).one()
    return int(count), first, last


class KernelTally:
    """What the links of a rank without kernel tables need of a trace's kernels, gathered while
    another pass streams them (the ingest's collective index: :func:`graphdeck.analysis.traces.
    collectives.build_index`'s ``on_kernel``), so the ingest reads them once: their total time and
    the communication kernels (without args, as :func:`record_links`' own stream reads them).
    ``complete`` is set by the caller once the pass ended without error."""

    def __init__(self) -> None:
        self.kernel_ns = 0
        self.comm: list[Ev] = []
        self.complete = False
        self._rule = CommRule()

    def __call__(self, k: Ev) -> None:
        self.kernel_ns += k.dur
        if self._rule.is_comm(k.name):
            self.comm.append(Ev(k.id, k.name, k.cat, k.ts, k.dur, k.pid, k.tid, k.corr, None))


def record_links(engine: Engine, trace_id: int, full: bool = False,
                 tally: KernelTally | None = None,
                 fingerprint: tuple[int, int | None, int | None] | None = None) -> bool | ByKernel | None:
    """Compute trace ``trace_id``'s links and keep them as its ``trace_links`` row, replacing an
    older one (NOTE: [Stored kernel links]); whether a row was written (none for a trace on
    ``map_trace``'s CPU path: an older row is then removed). Best effort, for the ingest: any
    failure is logged and gives False (export then maps the events itself).

    ``full``: return instead ``map_trace``'s whole ``by_kernel`` (the communication kernels
    mapped too: NOTE: [Export kernel links]) when a row was written, else None — what the ingest's
    node-time hook maps the trace's time with (:func:`graphdeck.store.node_times.record`), so the
    ingest maps each trace once. ``tally``: the trace's kernels as another pass saw them (used only
    when complete and the rank has no kernel tables: the kernels are then not read again).
    ``fingerprint``: the trace's ``X`` events' ``(count, first id, last id)`` as the ingest wrote
    them (NOTE: [Fingerprint at write] in graphdeck.store.trace_write), else they are counted."""
    from graphdeck.store.db import retrying, write_session

    try:
        with Session(engine) as s, gc_paused():
            if not has_table(s):
                return None if full else False
            trace = s.get(Trace, trace_id)
            state = rank_states(s, trace.run_id, trace.rank)[trace.rank]  # before the mapping: a graph added meanwhile makes it stale
            tables = _tables(s, trace.run_id, trace.rank)
            # NOTE: [Bounded launch sweep]: a few steps at a time, not the whole trace
            if tables:
                by_kernel, comm_kernels, cpu_path = bounded(s, trace_id, lambda ks: _compute(s, trace, ks, tables))
            elif tally is not None and tally.complete:  # what _compute gives without tables, from the shared pass
                by_kernel, comm_kernels = {}, tally.comm
                cpu_path = not tally.kernel_ns and not comm_kernels
                if cpu_path:
                    comm_kernels = []
            else:  # without tables a kernel's launch and host ranges are not looked at
                kernels = ((k, None, ()) for k, _ in stream_kernels(s, trace_id, args=False, launch=False))
                by_kernel, comm_kernels, cpu_path = _compute(s, trace, kernels, tables)
            count, first, last = fingerprint if fingerprint is not None else _fingerprint(s, trace_id)
            run_id, rank = trace.run_id, trace.rank
            row = None if cpu_path else dict(
                trace_id=trace_id, run_id=run_id, rank=rank, method=METHOD, graphs_count=state[0],
                last_graph_id=state[1], kernel_nodes_count=state[2], links_json=encode(trace_id, by_kernel, comm_kernels))
            whole = with_comm(s, trace, dict(by_kernel), comm_kernels)[0] if full and row is not None else None
        if row is not None:
            row.update(events_count=count, first_event_id=first, last_event_id=last)

        def write() -> None:
            with write_session(engine) as s:
                s.execute(delete(TraceLinks).where(TraceLinks.trace_id == trace_id, TraceLinks.method == METHOD))
                if row is not None:
                    s.add(TraceLinks(**row))

        retrying(write)
        return whole if full else row is not None
    except Exception:  # noqa: BLE001 - the trace is stored; only the shortcut is missing
        log.exception("trace %s: could not keep its kernel links", trace_id)
        return None if full else False


def refresh_links(engine: Engine, trace_id: int) -> bool:
    """:func:`record_links` again when trace ``trace_id``'s row is missing or its rank's graphs or
    kernel links moved on (a capture links kernels after ingesting its trace). Whether a current
    row is there afterwards. Best effort: never raises."""
    try:
        with Session(engine) as s:
            if not has_table(s):
                return False
            head = s.execute(select(TraceLinks).where(TraceLinks.trace_id == trace_id,
                                                      TraceLinks.method == METHOD)).scalar_one_or_none()
            if head is not None and (head.graphs_count, head.last_graph_id, head.kernel_nodes_count) == \
                    rank_states(s, head.run_id, head.rank)[head.rank]:
                return True
    except Exception:  # noqa: BLE001 - the caller (a capture) must not fail for a shortcut
        log.exception("trace %s: could not check its kernel links", trace_id)
        return False
    return record_links(engine, trace_id)


def stored_links(session: Session, trace: Trace, events_count: int, first_event_id: int | None,
                 last_event_id: int | None, states: dict | None = None) -> tuple[ByKernel, list[int]] | tuple[None, str]:
    """Trace ``trace``'s kept links if they can be trusted (NOTE: [Stored kernel links]):
    ``(by_kernel of the kernels wrapper calls launched, ids of the communication kernels to map)``,
    else ``(None, why)``. ``events_count``, ``first_event_id``, ``last_event_id``: of the trace's
    ``X`` events as the caller read them; ``states``: :func:`rank_states` of the trace's run, when
    the caller reads many of its traces. Never raises for a missing or stale row."""
    if not has_table(session):
        return None, "the store predates trace_links (schema < 6)"
    head = session.execute(select(TraceLinks).where(TraceLinks.trace_id == trace.id,
                                                    TraceLinks.method == METHOD)).scalar_one_or_none()
    if head is None:
        return None, f"trace {trace.id} has no kept links (ingested before they were kept, or a CPU trace)"
    if (head.events_count, head.first_event_id, head.last_event_id) != (events_count, first_event_id, last_event_id):
        return None, f"trace {trace.id}'s events are not those its links were computed on"
    state = (states if states is not None else rank_states(session, trace.run_id, trace.rank))[trace.rank]
    if (head.graphs_count, head.last_graph_id, head.kernel_nodes_count) != state:
        return None, f"rank {trace.rank}'s graphs or kernel links changed after trace {trace.id}'s links were kept"
    try:
        was, by_kernel, comm = decode(head.links_json)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
        return None, f"trace {trace.id}'s kept links are malformed"
    if was != trace.id:
        return None, f"trace {trace.id}'s kept links were computed for trace {was}"
    gids = sorted({g for g, _ in by_kernel.values()})
    for i in range(0, len(gids), 500):
        part = gids[i:i + 500]
        if session.scalar(select(func.count(Graph.id)).where(Graph.run_id == trace.run_id, Graph.id.in_(part))) != len(part):
            return None, f"trace {trace.id}'s kept links name graphs of another run"
    return by_kernel, comm
