"""Backward time per forward module, from Kineto's forward→backward flows (eager and compiled alike).

# NOTE: [Backward by forward module]
The autograd engine runs every backward node as one ``autograd::engine::evaluate_function:
<Node>`` range on the backward thread (``AddmmBackward0``, ``CompiledFunctionBackward`` for a
compiled graph), one block in a timeline. Kineto links each to the forward op that created the
node with a ``fwdbwd`` flow (kept at ingest: NOTE: [Forward-backward flows] in
:mod:`graphdeck.store.trace_rows`): the flow starts at the forward op (``aten::addmm``,
``CompiledFunction``) and ends inside the backward range. The forward op's module is the innermost
``nn.Module: Linear_0`` range around it on its thread (the profiler writes those with
``with_stack=True`` or ``with_modules=True``); its path is the chain of enclosing module ranges
(``ResNet_0/Sequential_1/Bottleneck_0``). A backward range's time is its own: the time of
backward ranges nested in it (a checkpointed region's recomputation runs its own backward inside
``CheckpointFunctionBackward``) goes to theirs. Ranges no flow reaches (``AccumulateGrad``, a
trace without flows) stay ``unattributed``, named. Without module ranges the forward op's name
stands for the module (``by`` is ``"forward op"``). Times are the CPU ranges' wall time (ns) and,
on a GPU trace, the kernels launched from inside each range (``gpu_ns``, by ``correlation``).

Memory: the backward ranges, the flow ends and the module ranges of one trace (one row each,
read by indexed queries), never the whole trace.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.orm import Session

EVALUATE = "autograd::engine::evaluate_function: "
MODULE = "nn.Module: "
_RANGES = text("SELECT n.value, e.ts_ns, e.dur_ns, e.tid FROM trace_events e JOIN strings n ON n.id = e.name_id "
               "WHERE e.trace_id = :tid AND e.ph = 'X' AND n.value LIKE :prefix ORDER BY e.ts_ns, e.id")
_FLOWS = text("SELECT ph, ts_ns, tid, correlation FROM trace_events WHERE trace_id = :tid AND ph IN ('s', 'f') "
              "AND correlation IS NOT NULL")
_KERNELS = ("SELECT k.correlation, k.dur_ns FROM trace_events k JOIN strings c ON c.id = k.cat_id "
            "WHERE k.trace_id = :tid AND k.ph = 'X' AND k.correlation IS NOT NULL AND c.value IN ({cats})")
_LAUNCHES = ("SELECT r.ts_ns, r.tid, r.correlation FROM trace_events r JOIN strings c ON c.id = r.cat_id "
             "WHERE r.trace_id = :tid AND r.ph = 'X' AND r.correlation IS NOT NULL AND c.value IN ({cats})")
_STARTING = ("SELECT n.value, e.ts_ns, e.tid, e.dur_ns FROM trace_events e JOIN strings n ON n.id = e.name_id "
             "JOIN strings c ON c.id = e.cat_id WHERE e.trace_id = :tid AND e.ph = 'X' AND c.value = 'cpu_op' "
             "AND e.ts_ns IN ({ts})")


@dataclass
class BackwardRow:
    """One forward module (or forward op, when the trace has no module ranges): ``backward_ns``
    (its backward ranges' own time), ``gpu_ns`` (GPU kernels launched from inside them),
    ``backward_ops`` (how many ranges), ``ops`` (backward node →
    ns), ``forward_ops`` (forward op → how many of its ranges)."""

    module: str
    backward_ns: int = 0
    gpu_ns: int = 0
    backward_ops: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    forward_ops: dict[str, int] = field(default_factory=dict)


@dataclass
class BackwardAttribution:
    """Backward time of one trace by forward module (NOTE: [Backward by forward module]).

    ``backward_ns``: the own time of every backward range; ``attributed_ns`` the part a flow
    links to a forward op; ``gpu_ns`` / ``attributed_gpu_ns``: the same for the GPU kernels
    launched from inside backward ranges (0 in a CPU-only trace); ``rows`` by ``backward_ns``, largest first; ``unattributed``: backward
    node → ns no flow reaches (``unattributed_gpu`` its kernels' ns: DDP's all-reduces launched
    from ``AccumulateGrad`` hooks land there); ``by``: ``"module"`` or ``"forward op"``; ``flows``: forward→backward
    flows read; ``note``: what is missing, else ``None``."""

    trace_id: int
    backward_ns: int = 0
    attributed_ns: int = 0
    gpu_ns: int = 0
    attributed_gpu_ns: int = 0
    backward_ranges: int = 0
    flows: int = 0
    by: str = "module"
    rows: list[BackwardRow] = field(default_factory=list)
    unattributed: dict[str, int] = field(default_factory=dict)
    unattributed_gpu: dict[str, int] = field(default_factory=dict)
    note: str | None = None

    def to_dict(self) -> dict:
        return {"trace_id": self.trace_id, "backward_ns": self.backward_ns, "attributed_ns": self.attributed_ns,
                "gpu_ns": self.gpu_ns, "attributed_gpu_ns": self.attributed_gpu_ns,
                "backward_ranges": self.backward_ranges, "flows": self.flows, "by": self.by,
                "rows": [vars(r) for r in self.rows], "unattributed": self.unattributed,
                "unattributed_gpu": self.unattributed_gpu, "note": self.note}


def _enclosing(ranges: dict[str, list[tuple[int, int, str]]], starts: dict[str, list[int]], tid: str, ts: int):
    """The ranges of ``tid`` that contain ``ts``, outermost first (ranges sorted by start)."""
    lane = ranges.get(tid) or []
    i = bisect.bisect_right(starts.get(tid) or [], ts)
    return [r for r in lane[:i] if r[0] <= ts < r[1] or r[0] == ts]


def _by_lane(rows) -> tuple[dict, dict]:
    lanes: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for name, ts, dur, tid in rows:
        lanes[tid].append((ts, ts + (dur or 0), name))
    return lanes, {t: [r[0] for r in v] for t, v in lanes.items()}


def backward_by_module(session: Session, trace_id: int) -> BackwardAttribution:
    """Backward time of trace ``trace_id`` by forward module (NOTE: [Backward by forward module]).
    Never raises on odd data: a trace without backward ranges gives an empty result with a note."""
    out = BackwardAttribution(trace_id=trace_id)
    bwd = session.execute(_RANGES, {"tid": trace_id, "prefix": EVALUATE + "%"}).all()
    if not bwd:
        out.note = "no autograd backward range in this trace (no backward ran while it recorded)"
        return out
    # own time of each backward range: minus the backward ranges nested in it, per thread
    own: list[list] = []  # [name, ts, end, tid, own_ns]
    stack: dict[str, list[list]] = defaultdict(list)
    for name, ts, dur, tid in bwd:
        end = ts + (dur or 0)
        st = stack[tid]
        while st and st[-1][2] <= ts:
            st.pop()
        item = [name[len(EVALUATE):], ts, end, tid, dur or 0]
        if st:
            st[-1][4] -= min(end, st[-1][2]) - ts
        st.append(item)
        own.append(item)
    out.backward_ranges = len(own)
    out.backward_ns = sum(max(x[4], 0) for x in own)
    starts_bwd: dict[str, list[int]] = defaultdict(list)
    lanes_bwd: dict[str, list[list]] = defaultdict(list)
    for item in own:
        starts_bwd[item[3]].append(item[1])
        lanes_bwd[item[3]].append(item)
    ends: dict[int, dict[str, tuple[int, str]]] = defaultdict(dict)
    for ph, ts, tid, fid in session.execute(_FLOWS, {"tid": trace_id}):
        ends[fid][ph] = (ts, tid)
    modules, mstarts = _by_lane(session.execute(_RANGES, {"tid": trace_id, "prefix": MODULE + "%"}).all())
    out.by = "module" if modules else "forward op"
    pairs = [(e["s"], e["f"]) for e in ends.values() if "s" in e and "f" in e]
    out.flows = len(pairs)
    fwd_names = _forward_ops(session, trace_id, {s for s, _ in pairs})
    linked: dict[int, tuple[str, str]] = {}  # id(backward range) -> (module, forward op)
    for (s_ts, s_tid), (f_ts, f_tid) in pairs:
        i = bisect.bisect_right(starts_bwd.get(f_tid) or [], f_ts)
        inside = [x for x in (lanes_bwd.get(f_tid) or [])[:i] if x[1] <= f_ts <= x[2]]
        if not inside:
            continue
        unit = inside[-1]  # the innermost backward range the flow ends in
        fwd_op = fwd_names.get((s_ts, s_tid), "?")
        if modules:
            chain = [r[2][len(MODULE):] for r in _enclosing(modules, mstarts, s_tid, s_ts)]
            key = "/".join(chain) if chain else f"(no module) {fwd_op}"
        else:
            key = fwd_op
        linked.setdefault(id(unit), (key, fwd_op))
    gpu = _gpu_by_range(session, trace_id, starts_bwd, lanes_bwd)
    rows: dict[str, BackwardRow] = {}
    unattributed: Counter = Counter()
    unattributed_gpu: Counter = Counter()
    for item in own:
        out.gpu_ns += gpu.get(id(item), 0)
        ns = max(item[4], 0)
        got = linked.get(id(item))
        if got is None:
            unattributed[item[0]] += ns
            if gpu.get(id(item)):
                unattributed_gpu[item[0]] += gpu[id(item)]
            continue
        row = rows.setdefault(got[0], BackwardRow(got[0]))
        row.backward_ns += ns
        row.gpu_ns += gpu.get(id(item), 0)
        out.attributed_gpu_ns += gpu.get(id(item), 0)
        row.backward_ops += 1
        row.ops[item[0]] = row.ops.get(item[0], 0) + ns
        row.forward_ops[got[1]] = row.forward_ops.get(got[1], 0) + 1
        out.attributed_ns += ns
    out.rows = sorted(rows.values(), key=lambda r: (-r.backward_ns, r.module))
    out.unattributed = dict(unattributed.most_common())
    out.unattributed_gpu = dict(unattributed_gpu.most_common())
    if not pairs:
        out.note = ("the trace has no forward→backward flows (Kineto's fwdbwd): backward time cannot be put on "
                    "forward modules")
    elif not modules:
        out.note = ("no nn.Module ranges in the trace: backward time is shown by forward op (profile with "
                    "with_stack=True or with_modules=True to see modules)")
    return out


def _gpu_by_range(session: Session, trace_id: int, starts: dict, lanes: dict) -> dict[int, int]:
    """id(backward range) → ns of the GPU kernels whose launch call runs inside it (innermost),
    joined by ``correlation`` (one dict entry per kernel correlation; nothing in a CPU trace)."""
    from graphdeck.analysis.traces.data import GPU_KERNEL_CATS, RUNTIME_CATS

    def cats(xs):
        return ",".join("'" + x + "'" for x in sorted(xs))  # constant category names

    kernel_ns: dict[int, int] = defaultdict(int)
    for corr, dur in session.execute(text(_KERNELS.format(cats=cats(GPU_KERNEL_CATS))), {"tid": trace_id}):
        kernel_ns[corr] += dur or 0
    out: dict[int, int] = defaultdict(int)
    if not kernel_ns:
        return out
    for ts, tid, corr in session.execute(text(_LAUNCHES.format(cats=cats(RUNTIME_CATS))), {"tid": trace_id}):
        ns = kernel_ns.pop(corr, 0)  # a correlation's kernels count once, at its first launch call
        if not ns or tid not in lanes:
            continue
        i = bisect.bisect_right(starts[tid], ts)
        inside = [x for x in lanes[tid][:i] if x[1] <= ts <= x[2]]
        if inside:
            out[id(inside[-1])] += ns
    return out


def _forward_ops(session: Session, trace_id: int, starts: set[tuple[int, str]]) -> dict[tuple[int, str], str]:
    """(ts, tid) of each flow start → the name of the outermost CPU op that starts there."""
    out: dict[tuple[int, str], tuple[int, str]] = {}
    ts_list = sorted({ts for ts, _ in starts})
    for i in range(0, len(ts_list), 500):
        chunk = ts_list[i:i + 500]
        sql = text(_STARTING.format(ts=",".join(str(int(t)) for t in chunk)))
        for name, ts, tid, dur in session.execute(sql, {"tid": trace_id}):
            if (ts, tid) in starts and ((ts, tid) not in out or (dur or 0) > out[(ts, tid)][0]):
                out[(ts, tid)] = (dur or 0, name)
    return {k: v[1] for k, v in out.items()}
