"""GPU event → launching runtime call → enclosing CPU operator, for one stored trace.

# NOTE: [GPU to CPU links]
A kernel (memcpy, memset) on a GPU stream carries ``args.correlation``, the CUPTI/roctracer id
that its launching runtime call (``cudaLaunchKernel``, ``cuLaunchKernelEx``,
``cudaGraphLaunch``, ``hipLaunchKernel``...) carries too; the ``ac2g`` flow events repeat the
same pair. The operator that issued the launch is then the innermost ``cpu_op`` on the launch's
thread whose span contains the launch call's span. ``External id`` is not used: in traces
before ~2023 a kernel's ``External id`` repeats its correlation id (not the operator's
External id), so joining on it links a large share of kernels to unrelated operators
(``param-et_replay/linear_kineto.json.gz``: 37%). CUDA-graph replays (kernels without
``External id``) link through ``correlation`` to their ``cudaGraphLaunch`` the same way.

The sweep is per thread: spans (operators and ``record_function`` ranges) and launch calls are
sorted by start (longer first), a stack holds the spans open at each start, and a launch's
ancestors are the open spans that also end at or after it ends (Kineto rounds to µs in older
traces, so a parent may end a few ns early; such a span is not counted as enclosing).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from graphdeck.analysis.traces.data import CPU_OP_CATS, CPU_RANGE_CATS, GPU_CATS, RUNTIME_CATS, Ev
from graphdeck.analysis.traces.launch_sweep import stack_step


@dataclass(slots=True)
class Link:
    """How one GPU event was launched. ``chain`` lists the enclosing host ranges outermost first
    (operators and ``record_function`` ranges, as :class:`Ev`); ``op`` is the innermost
    operator in it (category ``cpu_op``), or None when the launch ran outside any operator."""

    gpu: Ev
    runtime: Ev | None
    op: Ev | None
    chain: tuple[Ev, ...]


def link_gpu_events(events: list[Ev]) -> dict[int, Link]:
    """``gpu event id → Link`` for every GPU event (kernel, memcpy, memset) in ``events``.

    ``events``: the trace's ``X`` events (:func:`graphdeck.analysis.traces.data.load_events`).
    A GPU event whose correlation matches no runtime call gets ``runtime=None``.
    """
    runtime_by_corr: dict[int, Ev] = {}
    per_thread: dict[tuple[str, str], list[Ev]] = defaultdict(list)
    gpu: list[Ev] = []
    for e in events:
        if e.cat in GPU_CATS:
            gpu.append(e)
        elif e.cat in RUNTIME_CATS:
            if e.corr is not None:
                runtime_by_corr.setdefault(e.corr, e)
            per_thread[(e.pid, e.tid)].append(e)
        elif e.cat in CPU_RANGE_CATS:
            per_thread[(e.pid, e.tid)].append(e)
    gpu_corr = {g.corr for g in gpu if g.corr is not None}
    chains = _chains(per_thread, gpu_corr)
    links: dict[int, Link] = {}
    for g in gpu:
        rt = runtime_by_corr.get(g.corr) if g.corr is not None else None
        chain = chains.get(rt.id, ()) if rt is not None else ()
        op = next((s for s in reversed(chain) if s.cat in CPU_OP_CATS), None)
        links[g.id] = Link(g, rt, op, chain)
    return links


def _chains(per_thread: dict[tuple[str, str], list[Ev]], wanted: set[int]) -> dict[int, tuple[Ev, ...]]:
    """Launch call id → its enclosing spans, for the launch calls whose correlation is in
    ``wanted`` (those a GPU event points at; the others are skipped)."""
    chains: dict[int, tuple[Ev, ...]] = {}
    for items in per_thread.values():
        # spans before launch calls at the same start and length: a span can enclose a launch
        # (keys built once as tuples: sorted in C, no Python call per comparison)
        keyed = sorted([(e.ts, -e.dur, e.cat in RUNTIME_CATS, e.id, e) for e in items])
        stack: list[tuple[int, int, Ev]] = []  # (start, end, span), ns
        for _ts, _neg_dur, rt, _id, e in keyed:
            want = rt and e.corr in wanted
            chain = stack_step(stack, e, rt, want)
            if want:
                chains[e.id] = chain
    return chains
