"""The kernel → node links export-trace writes, computed with less work than a full mapping.

# NOTE: [Export kernel links]
``graphdeck export-trace`` needs of :func:`graphdeck.analysis.traces.trace_map.map_trace` only
``by_kernel`` (GPU event id → ``(graph id, [node names])``) and ``comm_label`` (GPU event id →
what a collective carries), for every rank it writes. :func:`kernel_links` gives the same two
dicts (the same keys, values and order) as ``map_trace`` on the same events, skipping what only the
other results need: launch chains are built only for kernels (not memcpy/memset) and only on the
threads of their launches, no ``Link`` objects or innermost operators are made, and the optimizer
step / unmapped bookkeeping and the per-node times are left out, and a wrapper call's table
choice is kept per (region, call names), which repeat every step. The kernel tables, twin
graphs and collective mapping are ``trace_map``'s own functions. A trace where ``map_trace``
takes its CPU path (no kernel time and no communication kernel: NOTE: [CPU trace mapping]) is
handed to ``map_trace`` whole. tests/test_export_trace.py checks the equality on the 2 x H200 DDP
store and on HTA's NCCL traces.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from sqlalchemy.orm import Session

from graphdeck.analysis.traces.trace_analysis import CommRule
from graphdeck.analysis.traces.trace_data import CPU_RANGE_CATS, GPU_KERNEL_CATS, RUNTIME_CATS, Ev
from graphdeck.analysis.traces.trace_links import _chains
from graphdeck.analysis.traces.trace_map import (
    _REGION,
    WRAPPER_PREFIX,
    KernelMapping,
    _map_comm,
    _tables,
    map_trace,
    wrapper_kernel_nodes,
)
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Trace


def kernel_links(session: Session, trace_id: int, events: list[Ev]) -> tuple[dict[int, tuple[int, list[str]]],
                                                                              dict[int, str]]:
    """``(by_kernel, comm_label)`` of trace ``trace_id`` as :func:`~graphdeck.analysis.traces.
    trace_map.map_trace` gives them (NOTE: [Export kernel links]). ``events``: the trace's ``X``
    events ordered by start (:func:`~graphdeck.analysis.traces.trace_data.load_events`).

    Raises NotFoundError when the trace does not exist."""
    trace = session.get(Trace, trace_id)
    if trace is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    runtime_by_corr: dict[int, Ev] = {}
    per_thread: dict[tuple[str, str], list[Ev]] = defaultdict(list)
    kernels: list[Ev] = []
    for e in events:  # as link_gpu_events sorts them, kernels only (memcpy/memset map to nothing)
        cat = e.cat
        if cat in GPU_KERNEL_CATS:
            kernels.append(e)
        elif cat in RUNTIME_CATS:
            if e.corr is not None:
                runtime_by_corr.setdefault(e.corr, e)
            per_thread[(e.pid, e.tid)].append(e)
        elif cat in CPU_RANGE_CATS:
            per_thread[(e.pid, e.tid)].append(e)
    wanted = {k.corr for k in kernels if k.corr is not None}
    threads = {(rt.pid, rt.tid) for c in wanted if (rt := runtime_by_corr.get(c)) is not None}
    chains = _chains({lane: items for lane, items in per_thread.items() if lane in threads}, wanted)
    tables = _tables(session, trace.run_id, trace.rank)
    wrappers: dict[int, list[tuple[Ev, Ev | None]]] = defaultdict(list)
    wrapper_ev: dict[int, tuple[Ev, str | None]] = {}
    comm, comm_kernels, kernel_ns = CommRule(), [], 0
    for k in kernels:
        kernel_ns += k.dur
        rt = runtime_by_corr.get(k.corr) if k.corr is not None else None
        chain = chains.get(rt.id, ()) if rt is not None else ()
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
        wrappers[chain[at].id].append((k, chain[at + 1] if at + 1 < len(chain) else None))
    if not kernel_ns and not comm_kernels:  # map_trace's CPU path (NOTE: [CPU trace mapping])
        full = map_trace(session, trace_id, events)
        return full.by_kernel, full.comm_label
    out = KernelMapping(trace_id)
    for k, gid, got in wrapper_kernel_nodes(session, trace, tables, wrappers, wrapper_ev):
        if got:
            out.by_kernel[k.id] = (gid, list(got[0]))
    _map_comm(session, trace, comm_kernels, out, Counter(), Counter())
    return out.by_kernel, out.comm_label
