"""Per-rank trace analyses: steps, GPU busy/idle, scheduling-delay hotspots, comm/compute overlap.

Every function reads one stored trace and returns plain data (dicts and lists, times in int64
ns); nothing here draws. Each figure is a sum over the trace's own events, as the tests check
against the file: *kernel time* is the summed ``dur`` of events of category ``kernel``
(``Kernel`` in 2021 traces) — never host-side launch operators, even the ones that carry a
``stream`` argument (Inductor's Triton launches); *busy* time is the length of the union of
GPU-event intervals (kernels, memcpy, memset) on a device, so concurrent streams are not
counted twice.

Communication kernels are told by a :class:`CommRule`: by default names starting with
``nccl`` / ``rccl`` (``ncclKernel_*``, ``ncclDevKernel_*``, RCCL); a rule can add patterns
(DeepEP's ``dpsk::ep::`` kernels, say). Where a rank has no communication kernel the overlap is
``None`` with ``reason = "no communication kernels"`` — never NaN.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import (
    GPU_CATS,
    GPU_KERNEL_CATS,
    Ev,
    intersect_ns,
    load_events,
    total_ns,
    union_ns,
)
from graphdeck.analysis.traces.links import Link, link_gpu_events

DEFAULT_COMM_PATTERNS = (r"^(void\s+)?(nccl|rccl)",)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass(frozen=True)
class CommRule:
    """Which kernels are communication: a kernel whose name matches any pattern (``re.search``,
    case-insensitive). ``extra`` adds to the defaults; ``patterns`` replaces them.

    >>> CommRule(extra=(r"dpsk::ep::",)).is_comm("void dpsk::ep::internode::combine<false>(int4*)")
    True
    """

    patterns: tuple[str, ...] = DEFAULT_COMM_PATTERNS
    extra: tuple[str, ...] = ()
    _compiled: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_compiled", tuple(re.compile(p, re.IGNORECASE) for p in (*self.patterns, *self.extra)))

    def is_comm(self, name: str) -> bool:
        return any(p.search(name) for p in self._compiled)


class TraceData:
    """One trace's events, loaded once, with the GPU → CPU links (shared by the analyses)."""

    def __init__(self, session: Session, trace_id: int):
        self.trace_id = trace_id
        self.events = load_events(session, trace_id)
        self.links: dict[int, Link] = link_gpu_events(self.events)
        self.gpu = [e for e in self.events if e.cat in GPU_CATS]
        self.kernels = [e for e in self.gpu if e.cat in GPU_KERNEL_CATS]
        self._session = session
        self._mapping = None

    @property
    def mapping(self):
        """:class:`graphdeck.analysis.traces.mapping.KernelMapping` of this trace (computed once)."""
        if self._mapping is None:
            from graphdeck.analysis.traces.mapping import map_trace

            self._mapping = map_trace(self._session, self.trace_id, self.events)
        return self._mapping

    def steps(self) -> list[Ev]:
        """The ``ProfilerStep#N`` ranges, by start (the outermost one per step number)."""
        seen: dict[str, Ev] = {}
        for e in self.events:
            if _STEP.match(e.name) and (e.name not in seen or e.dur > seen[e.name].dur):
                seen[e.name] = e
        return sorted(seen.values(), key=lambda e: e.ts)

    def launch_ts(self, k: Ev) -> int:
        link = self.links.get(k.id)
        return link.runtime.ts if link is not None and link.runtime is not None else k.ts

    def kernels_of_step(self, step: Ev | None) -> list[Ev]:
        """Kernels launched inside ``step`` (by the launch call's start; all when None)."""
        if step is None:
            return self.kernels
        return [k for k in self.kernels if step.ts <= self.launch_ts(k) < step.end]

    def label(self, k: Ev) -> str:
        """A kernel's name for people: what a collective carries (``all_reduce of DDP reducer
        bucket 3 (12 params)``), else ``graph node`` when mapped, else its launching operator."""
        if k.id in self.mapping.comm_label:
            return self.mapping.comm_label[k.id]
        got = self.mapping.by_kernel.get(k.id)
        if got is not None:
            return f"{got[1][0]} (graph {got[0]})"
        if k.id in self.mapping.optimizer_kernels:  # NOTE: [Optimizer step kernels]
            return f"optimizer step {self.mapping.optimizer_kernels[k.id]}"
        link = self.links.get(k.id)
        if link is not None and link.op is not None:
            return link.op.name
        return k.name


def _device(e: Ev) -> str:
    return e.pid


def step_times(data: TraceData) -> list[dict]:
    """Per ``ProfilerStep#N``: ``cpu_start_ns``, ``cpu_dur_ns`` (the range itself), and the GPU
    span of the kernels it launched: ``gpu_start_ns``, ``gpu_end_ns``, ``gpu_span_ns``,
    ``kernels``, ``kernel_ns`` (summed kernel time). A trace without step ranges gives one
    entry ``step = None`` covering every kernel."""
    times = StepTimes(data.steps())
    for k in data.kernels:
        times.add(k, data.launch_ts(k))
    return times.rows()


class StepTimes:
    """:func:`step_times` a kernel at a time (``add(kernel, launch ns)``, any order; ``rows()``):
    so the collective index can stream the kernels (NOTE: [Bounded launch sweep])."""

    def __init__(self, steps: list[Ev]):
        self.steps: list[Ev | None] = list(steps) or [None]
        self.acc = [[None, None, 0, 0] for _ in self.steps]  # gpu start, gpu end, kernels, kernel ns

    def add(self, k: Ev, launch: int) -> None:
        for st, acc in zip(self.steps, self.acc):
            if st is None or st.ts <= launch < st.end:  # TraceData.kernels_of_step
                acc[0] = k.ts if acc[0] is None else min(acc[0], k.ts)
                acc[1] = k.end if acc[1] is None else max(acc[1], k.end)
                acc[2] += 1
                acc[3] += k.dur

    def rows(self) -> list[dict]:
        out = []
        for st, (start, end, n, ns) in zip(self.steps, self.acc):
            out.append({
                "step": int(_STEP.match(st.name).group(1)) if st is not None else None,
                "cpu_start_ns": st.ts if st is not None else None,
                "cpu_dur_ns": st.dur if st is not None else None,
                "gpu_start_ns": start, "gpu_end_ns": end,
                "gpu_span_ns": (end - start) if start is not None else None,
                "kernels": n, "kernel_ns": ns,
            })
        return out


def gpu_busy(data: TraceData) -> list[dict]:
    """Per GPU (trace ``pid`` of its events): ``window_ns`` (first GPU event start → last end),
    ``busy_ns`` (union of kernel/memcpy/memset intervals), ``idle_ns`` = window − busy,
    ``kernel_ns`` (summed kernel durations; exceeds busy when streams overlap), ``memcpy_ns``,
    ``memset_ns``, ``kernels``, ``streams``, and ``busy_fraction``."""
    by_dev: dict[str, list[Ev]] = defaultdict(list)
    for e in data.gpu:
        by_dev[_device(e)].append(e)
    out = []
    for dev in sorted(by_dev, key=lambda d: (len(d), d)):
        evs = by_dev[dev]
        start, end = min(e.ts for e in evs), max(e.end for e in evs)
        busy = total_ns(union_ns((e.ts, e.end) for e in evs))
        window = end - start
        out.append({
            "device": dev, "window_ns": window, "busy_ns": busy, "idle_ns": window - busy,
            "busy_fraction": busy / window if window else None,
            "kernel_ns": sum(e.dur for e in evs if e.cat in GPU_KERNEL_CATS),
            "memcpy_ns": sum(e.dur for e in evs if e.cat in ("gpu_memcpy", "Memcpy")),
            "memset_ns": sum(e.dur for e in evs if e.cat in ("gpu_memset", "Memset")),
            "kernels": sum(1 for e in evs if e.cat in GPU_KERNEL_CATS),
            "streams": len({e.tid for e in evs}),
        })
    return out


def hotspots(data: TraceData, top: int = 10) -> dict:
    """Scheduling delays. ``gaps``: the ``top`` largest idle gaps between consecutive GPU events
    on one stream (``gap_ns`` = next start − previous end), each named by the event before it
    (``after``: its graph node when mapped, else its launching operator, else its name) and the
    one after. ``launch_delays``: the ``top`` largest kernel start − launch-call start
    (``delay_ns``), named the same way. ``overlapping``: pairs of GPU events on one stream that
    overlap in time (kept and drawn in an extra lane; counted here)."""
    by_stream: dict[tuple[str, str], list[Ev]] = defaultdict(list)
    for e in data.gpu:
        by_stream[(e.pid, e.tid)].append(e)
    gaps, overlapping = [], 0
    for (pid, tid), evs in by_stream.items():
        evs.sort(key=lambda e: (e.ts, e.id))
        end = None
        prev = None
        for e in evs:
            if prev is not None:
                if e.ts < end:
                    overlapping += 1
                elif e.ts > end:
                    gaps.append((e.ts - end, prev, e, pid, tid))
            if end is None or e.end > end:
                end, prev = e.end, e
    gaps.sort(key=lambda g: (-g[0], g[1].ts))
    if not by_stream and data.mapping.device == "cpu":  # a CPU trace: gaps between a compiled region's ops
        from graphdeck.analysis.traces.cpu_mapping import cpu_gaps

        return {"gaps": cpu_gaps(data.mapping, data.label, top), "launch_delays": [], "overlapping": 0,
                "device": "cpu", "launch_delays_reason": "a CPU trace: ops run where they are called, no launch waits"}
    delays = []
    for k in data.kernels:
        link = data.links.get(k.id)
        if link is not None and link.runtime is not None:
            delays.append((k.ts - link.runtime.ts, k))
    delays.sort(key=lambda d: (-d[0], d[1].ts))
    return {
        "gaps": [{"gap_ns": g, "stream": f"{pid}/{tid}", "at_ns": p.end, "after": data.label(p), "after_kernel": p.name,
                  "before": data.label(n), "before_kernel": n.name} for g, p, n, pid, tid in gaps[:top]],
        "launch_delays": [{"delay_ns": d, "kernel": k.name, "node": data.label(k), "start_ns": k.ts}
                          for d, k in delays[:top]],
        "overlapping": overlapping,
    }


def overlap(data: TraceData, rule: CommRule | None = None, top_unclassified: int = 5) -> dict:
    """Communication/computation overlap per step and for the whole trace.

    ``ratio`` = |comm ∩ compute| / |comm| with comm and compute the unions of the intervals of
    communication and other kernels (per the ``rule``); ``None`` with ``reason`` "no
    communication kernels" where a step (or the trace) has none. ``unclassified`` lists the
    ``top_unclassified`` largest non-communication kernel names by summed time, so a user can
    see what a rule might be missing (custom all-to-all kernels, say). ``cpu``: the same for
    CPU-side collectives (``gloo:all_reduce``...; :func:`graphdeck.analysis.ranks.cpu_collectives.cpu_overlap`),
    None when the trace has none."""
    rule = rule or CommRule()

    def one(ks: list[Ev]) -> dict:
        comm = [k for k in ks if rule.is_comm(k.name)]
        comp = [k for k in ks if not rule.is_comm(k.name)]
        cu, pu = union_ns((k.ts, k.end) for k in comm), union_ns((k.ts, k.end) for k in comp)
        comm_ns, both = total_ns(cu), intersect_ns(cu, pu)
        res = {"comm_kernels": len(comm), "comm_kernel_ns": sum(k.dur for k in comm), "comm_busy_ns": comm_ns,
               "compute_kernel_ns": sum(k.dur for k in comp), "compute_busy_ns": total_ns(pu), "overlap_ns": both,
               "ratio": both / comm_ns if comm_ns else None}
        if not comm:
            res["reason"] = "no communication kernels"
        return res

    whole = one(data.kernels)
    by_name: Counter = Counter()
    for k in data.kernels:
        if not rule.is_comm(k.name):
            by_name[k.name] += k.dur
    whole["unclassified"] = [{"kernel": n, "kernel_ns": ns} for n, ns in by_name.most_common(top_unclassified)]
    steps = [{"step": int(_STEP.match(st.name).group(1)), **one(data.kernels_of_step(st))} for st in data.steps()]
    from graphdeck.analysis.ranks.cpu_collectives import cpu_overlap  # gloo & co. (NOTE: [CPU-side collectives])

    return {"rule": list(rule.patterns + rule.extra), "trace": whole, "steps": steps, "cpu": cpu_overlap(data)}


def analyze_trace(session: Session, trace_id: int, rule: CommRule | None = None, top: int = 10) -> dict:
    """All per-trace analyses as one JSON-ready dict: ``distributed`` (rank, process groups:
    :func:`~graphdeck.analysis.traces.collectives.process_groups`), ``steps``, ``gpu``, ``hotspots``,
    ``overlap``, ``idle`` (idle time by cause, GPU and CPU:
    :func:`~graphdeck.analysis.traces.idle.idle_breakdown`, NOTE: [Idle time by cause]) and ``mapping`` (kernel → node coverage: ``kernel_ns``, ``mapped_ns``,
    ``mapped_fraction`` (nodes + optimizer steps + CPU overhead over all kernel time / the compiled
    ranges' wall time), ``coverage`` (the coverage of compiled graphs, with what it covers and the
    time outside them named apart: NOTE: [Trace coverage]), the largest unmapped kernels,
    ``optimizer``: kernel time of eager optimizer steps, ``warning``: the low-coverage warning or
    ``None``)."""
    from graphdeck.analysis.traces.collectives import process_groups
    from graphdeck.analysis.traces.idle import idle_breakdown
    from graphdeck.analysis.traces.kernel_source_nodes import coverage_warning
    from graphdeck.store.schema import Trace

    data = TraceData(session, trace_id)
    m = data.mapping
    trace = session.get(Trace, trace_id)
    try:
        meta = json.loads(trace.meta_json) if trace is not None else {}
    except ValueError:
        meta = {}
    return {
        "trace_id": trace_id,
        "distributed": process_groups(meta),
        "steps": step_times(data),
        "gpu": gpu_busy(data),
        "hotspots": hotspots(data, top),
        "overlap": overlap(data, rule),
        "idle": idle_breakdown(data),
        "mapping": {"kernel_ns": m.kernel_ns, "mapped_ns": m.mapped_ns, "mapped_fraction": m.mapped_fraction,
                    "unmapped_top": [{"kernel": n, "kernel_ns": ns} for n, ns in list(m.unmapped.items())[:top]],
                    "sources": m.sources, "device": m.device, "region_ns": m.region_ns,
                    "directions": m.directions,
                    "optimizer": [{"step": st, "kernel_ns": ns} for st, ns in m.optimizer_ns.items()],
                    "coverage": m.coverage.as_dict(),  # NOTE: [Trace coverage]
                    "warning": coverage_warning(m)},
    }
