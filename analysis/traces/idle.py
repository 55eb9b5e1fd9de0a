"""Idle time by cause: GPU stream idle split by what it waited on, and a CPU step's time by where it went.

# NOTE: [Idle time by cause]
**GPU** (per stream, the rule of HolisticTraceAnalysis 0.5.0's idle time breakdown,
``TraceAnalysis.get_idle_time_breakdown``; the names and the 30 µs threshold are HTA's). The GPU
events of one stream (kernels, memcpy, memset: ``GPU_CATS``) are taken in start order; the *gap*
before an event is its start minus the latest end of the events before it on that stream, and only
a positive gap is idle time. Each gap has exactly one cause, decided by the event after it:

* ``host_wait``: the event's launching runtime call (``cudaLaunchKernel``..., joined by
  ``correlation``: NOTE: [GPU to CPU links]) started after the stream went idle: the stream had run
  out of work and waited for the CPU to enqueue more (host-bound).
* ``kernel_wait``: not a host wait, and the gap is shorter than ``kernel_wait_ns`` (HTA's
  ``consecutive_kernel_delay``, 30 µs): the launch overhead between back-to-back kernels that were
  already queued.
* ``other``: the rest: the event was queued before the stream went idle and still did not start
  for ``kernel_wait_ns`` or more: it waited on something the trace does not name on that stream:
  an event recorded on another stream (``cudaStreamWaitEvent``), a collective's peer, a sync.

An event whose launch call is not in the trace is never a host wait (HTA does the same: no launch
time, nothing to compare). Where we differ from HTA: HTA measures a gap from the *previous* event's
end, so events that overlap on one stream (nanosecond-resolution traces, pytorch#122425) give it
negative gaps that it adds in; we measure from the latest end and count positive gaps only.
HTA also rounds nanosecond timestamps to whole µs; we keep the stored ns. And HTA keeps only GPU
events whose launch call is in the trace and started by the last ``ProfilerStep#N``'s end (with
``include_last_profiler_step=True``; by default it drops the last step too); we keep every GPU
event (``gpu_idle(hta_scope=True)`` keeps HTA's). In HTA's scope, on a trace in whole µs without
overlaps the three sums are HTA's to the ns (``tests/test_idle.py``).

Two refinements of our own, each a *part* of one cause (they never move time between causes):

* ``host_wait_sync_ns``: the part of host-wait gaps during which the host was inside a CUDA
  synchronize (runtime calls named ``*Synchronize*``, or the ``cuda_sync`` category): the CPU was
  late because it was itself waiting on the GPU (``.item()``, ``cudaDeviceSynchronize``...).
* ``other_cross_stream_ns``: the part of ``other`` gaps during which another stream of the same
  device ran work: the stream most likely waited on that work (an event wait, a collective).

Per step: a gap belongs to the ``ProfilerStep#N`` whose range holds the launch call of the event
after the gap (that event's start when it has no launch call), as in :func:`step_times`; gaps of
events launched outside every step are summed under ``outside_steps``. Per rank (one trace) the
figures are sums over streams: stream time, so two idle streams count twice (the device's idle
time is ``gpu_busy``'s union).

**CPU** (per ``ProfilerStep#N``, on the thread that holds the step's range, from the ops' own
time). Every instant of the step is given to the innermost host range open on that thread
(``cpu_op``, ``user_annotation``, runtime calls), and that range's *cause* is its own when its name
says one, else its parent's (innermost first, so a collective inside a compiled region is a
collective):

* ``compiled``: ``Torch-Compiled Region…``, ``CompiledFunction``, ``CompiledFunctionBackward``,
  ``## Call CompiledFxGraph…`` (inside a compiled region; everything else is *outside* it);
* ``data_loader``: a name with ``DataLoader`` (``enumerate(DataLoader)#…__next__``);
* ``collectives``: gloo / NCCL / c10d ranges, ``record_param_comms``, functional collectives
  (:func:`graphdeck.analysis.traces.coverage.comm_kind`), not ``DistributedDataParallel.forward``;
* ``optimizer``: ``Optimizer.step#…``, ``Optimizer.zero_grad#…``;
* ``eager_ops``: a range with no cause above it (ATen ops of eager code, the loss, DDP's hooks);
* ``python_other``: no range open: the interpreter between ops (and, on a loaded host, time the
  thread was not running, which a trace cannot tell apart).

They add up to the step's wall time exactly. Collectives that run on other threads (gloo's
workers) overlap the step rather than take its thread's time: ``background_collectives_ns`` is the
union of their ranges within the step, beside the breakdown, not in it. The step's thread often
waits for them with no range open (DDP's reducer waiting for its last bucket's all-reduce at the end
of backward): ``python_other_in_collective_ns`` is the part of ``python_other`` during which a
collective ran on another thread, a refinement like the GPU ones (a part of ``python_other``,
likely a wait, possibly Python that overlapped the collective).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter, defaultdict

from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import GPU_CATS, RUNTIME_CATS, Ev, intersect_ns, load_events, total_ns, union_ns

#: HTA's ``consecutive_kernel_delay`` (30 µs), in ns.
KERNEL_WAIT_NS = 30_000
GPU_CAUSES = ("host_wait", "kernel_wait", "other")
CPU_CAUSES = ("compiled", "data_loader", "collectives", "optimizer", "eager_ops", "python_other")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_HOST_CATS = frozenset({"cpu_op", "Operator", "user_annotation"}) | RUNTIME_CATS
_SYNC = re.compile(r"synchroniz", re.IGNORECASE)
#: The categories the analyses read (python_function, flows and the like are not).
_READ_CATS = GPU_CATS | _HOST_CATS | {"cuda_sync"}


def _gpu_fields() -> dict:
    return {"gaps": 0, "idle_ns": 0, **{f"{c}_ns": 0 for c in GPU_CAUSES}, "host_wait_sync_ns": 0,
            "other_cross_stream_ns": 0}


def _covered_ns(iv: list[tuple[int, int]], starts: list[int], a: int, b: int) -> int:
    """Length (ns) of ``[a, b)`` covered by the sorted disjoint intervals ``iv`` (``starts`` their starts)."""
    i = max(bisect_right(starts, a) - 1, 0)
    got = 0
    while i < len(iv) and iv[i][0] < b:
        s, e = max(iv[i][0], a), min(iv[i][1], b)
        if e > s:
            got += e - s
        i += 1
    return got


class TraceEvents:
    """What the idle analyses read of one trace: its ``X`` events (``events``, by ``(ts, id)``), the
    GPU ones (``gpu``) and :meth:`steps`. A :class:`graphdeck.analysis.traces.analyze.TraceData`
    serves as well; this one is lighter (no args, no launch chains): :func:`idle_by_cause` reads it."""

    def __init__(self, events: list[Ev]):
        self.events = events
        self.gpu = [e for e in events if e.cat in GPU_CATS]

    @classmethod
    def load(cls, session: Session, trace_id: int) -> TraceEvents:
        return cls(load_events(session, trace_id, with_args=False, cats=_READ_CATS))

    def steps(self) -> list[Ev]:
        from graphdeck.analysis.traces.analyze import TraceData

        return TraceData.steps(self)  # the outermost ProfilerStep#N per number, by start


def _launch_ts(events: list[Ev], wanted: set[int]) -> dict[int, int]:
    """Correlation id → start (ns) of the first runtime call carrying it, in ``(ts, id)`` order (the
    launch NOTE: [GPU to CPU links] pairs with a GPU event), for the ids in ``wanted``."""
    out: dict[int, int] = {}
    for e in events:
        if e.corr in wanted and e.cat in RUNTIME_CATS and e.corr not in out:
            out[e.corr] = e.ts
    return out


class _Steps:
    """Which ``ProfilerStep#N`` range holds a time (ns); ``None`` outside every step."""

    def __init__(self, steps: list[Ev]):
        self.steps = sorted(steps, key=lambda e: e.ts)
        self.starts = [s.ts for s in self.steps]

    def of(self, t: int) -> int | None:
        i = bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.steps[i].end:
            return int(_STEP.match(self.steps[i].name).group(1))
        return None


def gpu_idle(data, kernel_wait_ns: int = KERNEL_WAIT_NS, *, hta_scope: bool = False) -> dict:
    """GPU idle time by cause (NOTE: [Idle time by cause]) of one trace.

    ``data``: a :class:`TraceEvents` (or a :class:`graphdeck.analysis.traces.analyze.TraceData`).
    Returns ``{"kernel_wait_threshold_ns", "streams": [...], "steps": [...], "outside_steps": {...},
    "total": {...}}``; each row holds ``gaps`` (count), ``idle_ns`` (their sum), ``host_wait_ns``,
    ``kernel_wait_ns``, ``other_ns`` (the three add up to ``idle_ns``), ``host_wait_sync_ns`` (part
    of host wait), ``other_cross_stream_ns`` (part of other); all int ns. A stream row adds
    ``device`` (the trace's ``pid``), ``stream`` (``tid``), ``events``, ``span_ns`` (first start →
    last end); a step row ``step`` (N of ``ProfilerStep#N``). A trace without GPU events gives
    ``streams == []``, ``total`` None and ``reason``. ``hta_scope``: only the GPU events HTA 0.5.0
    keeps with ``include_last_profiler_step=True`` (launch call in the trace, started by the last
    ``ProfilerStep#N``'s end; the others are left out before gaps are measured), to compare."""
    steps = _Steps(data.steps())
    launch = _launch_ts(data.events, {e.corr for e in data.gpu if e.corr is not None})
    gpu = data.gpu
    if hta_scope and steps.steps:
        last = max(st.end for st in steps.steps)
        gpu = [e for e in gpu if e.corr in launch and launch[e.corr] <= last]
    by_stream: dict[tuple[str, str], list[Ev]] = defaultdict(list)
    for e in gpu:
        by_stream[(e.pid, e.tid)].append(e)
    out = {"kernel_wait_threshold_ns": kernel_wait_ns, "streams": [], "steps": [], "outside_steps": _gpu_fields(),
           "total": None}
    if not by_stream:
        out["reason"] = "no GPU kernel, memcpy or memset in this trace: GPU idle time is measured on GPU streams"
        return out
    sync = union_ns((e.ts, e.end) for e in data.events if (e.cat in RUNTIME_CATS and _SYNC.search(e.name))
                    or e.cat == "cuda_sync")
    sync_starts = [s for s, _ in sync]
    total, per_step = _gpu_fields(), defaultdict(_gpu_fields)
    busy = {key: union_ns((e.ts, e.ts + e.dur) for e in evs) for key, evs in by_stream.items()}
    for (pid, tid), evs in sorted(by_stream.items(), key=lambda kv: (kv[0][0], _num(kv[0][1]))):
        evs.sort(key=lambda e: (e.ts, e.id))
        others: list[tuple[int, int]] | None = None  # the device's other streams' busy time, when first needed
        row = _gpu_fields()
        end = None
        for e in evs:
            if end is not None and e.ts > end:
                gap = e.ts - end
                rt = launch.get(e.corr) if e.corr is not None else None
                extra = {}
                if rt is not None and rt > end:
                    cause = "host_wait"
                    extra["host_wait_sync_ns"] = _covered_ns(sync, sync_starts, end, e.ts) if sync else 0
                elif gap < kernel_wait_ns:
                    cause = "kernel_wait"
                else:
                    cause = "other"
                    if others is None:
                        others = union_ns(iv for (p, t), ivs in busy.items() if p == pid and t != tid for iv in ivs)
                        other_starts = [a for a, _ in others]
                    extra["other_cross_stream_ns"] = _covered_ns(others, other_starts, end, e.ts) if others else 0
                step = steps.of(rt if rt is not None else e.ts)
                for acc in (row, total, per_step[step] if step is not None else out["outside_steps"]):
                    acc["gaps"] += 1
                    acc["idle_ns"] += gap
                    acc[f"{cause}_ns"] += gap
                    for k, v in extra.items():
                        acc[k] += v
            end = e.end if end is None else max(end, e.end)
        out["streams"].append({"device": pid, "stream": tid, "events": len(evs),
                               "span_ns": end - evs[0].ts, **row})
    out["steps"] = [{"step": n, **per_step[n]} for n in sorted(per_step)]
    out["total"] = total
    return out


def _num(s: str):
    return (0, int(s), "") if s.lstrip("-").isdigit() else (1, 0, s)


def cpu_cause(name: str) -> str | None:
    """The CPU cause a range's own name says (NOTE: [Idle time by cause]), else None.

    >>> [cpu_cause(n) for n in ("CompiledFunction", "gloo:all_reduce", "Optimizer.step#AdamW.step",
    ...                         "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "aten::mm",
    ...                         "DistributedDataParallel.forward")]
    ['compiled', 'collectives', 'optimizer', 'data_loader', None, None]
    """
    from graphdeck.analysis.traces.coverage import comm_kind
    from graphdeck.analysis.traces.cpu_mapping import BWD, FWD, WRAPPER_PREFIX

    if name.startswith(("Torch-Compiled Region", WRAPPER_PREFIX)) or name in (FWD, BWD):
        return "compiled"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if "DataLoader" in name:
        return "data_loader"
    if name != "DistributedDataParallel.forward" and (comm_kind(name) or "c10d_functional" in name):
        return "collectives"
    return None


def _cpu_fields() -> dict:
    return {"wall_ns": 0, **{f"{c}_ns": 0 for c in CPU_CAUSES}, "outside_compiled_ns": 0,
            "background_collectives_ns": 0, "python_other_in_collective_ns": 0}


def _own_time(items: list[Ev], t0: int, t1: int, causes: dict[str, str | None]) -> tuple[Counter, list]:
    """Cause → ns of ``[t0, t1)`` on one thread: each instant to the innermost open range of ``items``
    (sorted by ``(ts, -dur, id)``, starting in the window), ``python_other`` where none is open; and
    the ``python_other`` stretches as sorted ``(start, end)`` ns."""
    acc: Counter = Counter()
    bare: list[tuple[int, int]] = []
    stack: list[tuple[int, str]] = []  # (end ns, cause), innermost last
    cur = t0

    def advance(to: int) -> None:
        nonlocal cur
        while stack and stack[-1][0] <= to:
            end, cause = stack.pop()
            if end > cur:
                acc[cause] += end - cur
                cur = end
        if to > cur:
            if stack:
                acc[stack[-1][1]] += to - cur
            else:
                acc["python_other"] += to - cur
                bare.append((cur, to))
            cur = to

    for e in items:
        advance(e.ts)
        end = min(e.end, t1, stack[-1][0] if stack else t1)  # a child never outlives its parent
        if end <= e.ts:
            continue
        own = _cause_of(e.name, causes)
        stack.append((end, own or (stack[-1][1] if stack else "eager_ops")))
    advance(t1)
    return acc, bare


def cpu_time(data) -> dict:
    """Each ``ProfilerStep#N``'s host time by cause (NOTE: [Idle time by cause]), on the step's thread.

    ``data``: a :class:`TraceEvents` (or a :class:`graphdeck.analysis.traces.analyze.TraceData`).
    Returns ``{"steps": [...],
    "total": {...}}``; a row holds ``wall_ns`` (the step range's duration), one ``<cause>_ns`` per
    :data:`CPU_CAUSES` (they add up to ``wall_ns``), ``outside_compiled_ns`` (``wall_ns`` −
    ``compiled_ns``), ``background_collectives_ns`` (collective ranges on other threads within the
    step, their union; not part of ``wall_ns``'s split) and ``python_other_in_collective_ns`` (the
    part of ``python_other_ns`` while such a collective ran); a step row adds ``step``, ``thread``
    (``pid/tid``). All int ns. No step ranges: ``steps == []``, ``total`` None and ``reason``."""
    steps = sorted(data.steps(), key=lambda e: e.ts)
    if not steps:
        return {"steps": [], "total": None,
                "reason": "no ProfilerStep#N range in this trace (profile with a schedule and call prof.step())"}
    per_thread: dict[tuple[str, str], list[Ev]] = defaultdict(list)
    for e in data.events:
        if e.cat in _HOST_CATS and not _STEP.match(e.name):
            per_thread[(e.pid, e.tid)].append(e)
    starts = {}
    for key, items in per_thread.items():
        items.sort(key=lambda e: (e.ts, -e.dur, e.id))
        starts[key] = [e.ts for e in items]
    causes: dict[str, str | None] = {}
    background: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for key, items in per_thread.items():
        background[key] = union_ns((e.ts, e.end) for e in items if _cause_of(e.name, causes) == "collectives")
    rows, total = [], _cpu_fields()
    for st in steps:
        key = (st.pid, st.tid)
        items, ts = per_thread.get(key, []), starts.get(key, [])
        lo, hi = bisect_right(ts, st.ts - 1), bisect_right(ts, st.end - 1)
        acc, bare = _own_time(items[lo:hi], st.ts, st.end, causes)
        row = {"step": int(_STEP.match(st.name).group(1)), "thread": f"{st.pid}/{st.tid}", **_cpu_fields()}
        row["wall_ns"] = st.dur
        for c in CPU_CAUSES:
            row[f"{c}_ns"] = acc.get(c, 0)
        row["outside_compiled_ns"] = st.dur - row["compiled_ns"]
        elsewhere = union_ns((max(a, st.ts), min(b, st.end)) for k, ivs in background.items() if k != key
                             for a, b in ivs if a < st.end and b > st.ts)
        row["background_collectives_ns"] = total_ns(elsewhere)
        row["python_other_in_collective_ns"] = intersect_ns(bare, elsewhere)
        for k in _cpu_fields():
            total[k] += row[k]
        rows.append(row)
    return {"steps": rows, "total": total}


def _cause_of(name: str, causes: dict[str, str | None]) -> str | None:
    if name not in causes:
        causes[name] = cpu_cause(name)
    return causes[name]


def idle_breakdown(data, kernel_wait_ns: int = KERNEL_WAIT_NS) -> dict:
    """Both halves for one trace: ``{"gpu": gpu_idle(...), "cpu": cpu_time(...)}`` (NOTE: [Idle time by cause])."""
    return {"gpu": gpu_idle(data, kernel_wait_ns), "cpu": cpu_time(data)}


def idle_by_cause(session: Session, run_id: int, kernel_wait_ns: int = KERNEL_WAIT_NS) -> dict:
    """Idle time by cause per rank of run ``run_id`` (its newest usable trace per rank):
    ``{"run_id", "kernel_wait_threshold_ns", "ranks": [{"rank", "trace_id", "gpu", "cpu"}]}``, ranks in
    order; ``ranks == []`` and ``reason`` when the run has no trace. ``gpu``/``cpu`` as
    :func:`gpu_idle` / :func:`cpu_time`. Raises nothing of its own (a missing run is the caller's)."""
    from graphdeck.analysis.traces.collectives import run_traces

    traces = run_traces(session, run_id)
    out = {"run_id": run_id, "kernel_wait_threshold_ns": kernel_wait_ns, "ranks": []}
    for rank in sorted(traces):
        data = TraceEvents.load(session, traces[rank])
        out["ranks"].append({"rank": rank, "trace_id": traces[rank], **idle_breakdown(data, kernel_wait_ns)})
    if not traces:
        out["reason"] = "the run has no profiler trace (graphdeck ingest-trace, or the agent's profile window)"
    return out


def headline(doc: dict) -> list[str]:
    """Text lines for one trace's :func:`idle_breakdown` (the CLI prints them); times in ms."""
    lines = []
    g = doc["gpu"]["total"]
    if g is not None and g["idle_ns"]:
        n = len(doc["gpu"]["streams"])
        lines.append(f"GPU stream idle {g['idle_ns'] / 1e6:.3f} ms (summed over {n} stream{'s' * (n != 1)})"
                     " by cause (HTA's rule): "
                     + ", ".join(f"{c.replace('_', ' ')} {g[f'{c}_ns'] / 1e6:.3f} ms ({g[f'{c}_ns'] / g['idle_ns']:.0%})"
                                 for c in GPU_CAUSES)
                     + f"; host wait in a CUDA sync {g['host_wait_sync_ns'] / 1e6:.3f} ms, other while another stream"
                       f" ran {g['other_cross_stream_ns'] / 1e6:.3f} ms")
    c = doc["cpu"]["total"]
    if c is not None and c["wall_ns"]:
        n = len(doc["cpu"]["steps"])
        lines.append(f"CPU step time {c['wall_ns'] / 1e6:.3f} ms ({n} step{'s' * (n != 1)}, on each step's thread): "
                     + ", ".join(f"{k.replace('_', ' ')} {c[f'{k}_ns'] / 1e6:.3f} ms ({c[f'{k}_ns'] / c['wall_ns']:.0%})"
                                 for k in CPU_CAUSES)
                     + f"; collectives on other threads {c['background_collectives_ns'] / 1e6:.3f} ms, python other"
                       f" while one ran {c['python_other_in_collective_ns'] / 1e6:.3f} ms")
    return lines
