"""Node times per training step from a run's stored profiler traces, and their comparison between
two runs with a noise floor (``graphdeck diff-runs``, NOTE: [Run diff] in
graphdeck/analysis/run_diff.py).

# NOTE: [Node time per step]
A node's time is read from the newest ``ok``/``truncated`` trace of each rank, split into steps by
the profiler's ``ProfilerStep#N`` ranges (a step runs from its range's start to the next one's;
a trace without them is one step, and then no spread can be measured):

* GPU kernels mapped to FX nodes by :func:`graphdeck.analysis.trace_map.map_trace` (Inductor's
  provenance, NOTE: [Kernel to node mapping]), each counted in the step its kernel starts in;
* else the CPU operators AOTAutograd's compiled function runs (``aot_eager`` and other
  backends that run the AOT graph op by op): the direct children of each ``CompiledFunction``
  range (forward; its graph is the ``aot_forward`` of the enclosing ``Torch-Compiled Region:
  <compile id>``, the k-th call in a region the k-th such graph, e.g. DDP's buckets) and of each
  ``CompiledFunctionBackward`` range (its graph is the backward sibling of the forward whose
  ``Sequence number`` it repeats). The children (``aten::addmm`` ...) are aligned with the
  graph's ``aten`` nodes in graph order by :class:`difflib.SequenceMatcher` on op names; a
  child's inclusive time is its node's. Regions without a ``CompiledFunction`` (inference) map
  their ``aten::`` children onto the compile's ``aot_inference`` graph.

A node is named across runs by ``(phase, module path, op target, occurrence)``: the k-th node
with that op in that module among the rank's AOT graphs of that phase, in capture order. So a
node still pairs with itself when a graph break moves it into another graph.

# NOTE: [Noise floor]
Per node (and per module: the sum over its nodes and its sub-modules' nodes) each run gives one
time per step. Run A, the baseline, sets the noise: its ``spread`` is the robust standard
deviation of its steps (1.4826 × the median absolute deviation) and the floor is
``max(k × spread_A, min_ns)`` (defaults 3 and 50 µs). A node regressed when the lower quartile of
run B's steps exceeds run A's median by more than the floor: three quarters of B's steps are
slower beyond A's step-to-step noise and timer granularity, so one slow step, or a run B that is
merely noisier, is no regression (its median moving by less than the floor never is). ``faster``
mirrors it (B's upper quartile below A's median by more than the floor). With fewer than 2 steps
in a run the spread is unknown and nothing is called a regression (the timing verdict is
INCOMPLETE).

# NOTE: [Drift]
Step-to-step spread does not see a whole run going slower (another job on the machine, a
different clock or device): every node then moves together. The drift is the median, over the
nodes of at least 5 µs in run A, of (median B / median A); run B's steps are divided by it before
they are judged, so a node regresses *relative to the rest of its run*. The drift itself is
reported per rank (the timing section says it when it passes ×1.5 either way); a change that
slows every node alike shows there, not as a node regression.
"""

from __future__ import annotations

import difflib
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.analysis.trace_data import CPU_RANGE_CATS, Ev, load_events
from graphdeck.store.schema import Graph, InternedString, Node, Trace

AOT_PHASE = {"aot_forward": "forward", "aot_backward": "backward", "aot_inference": "inference"}
DEFAULT_K = 3.0
DEFAULT_MIN_NS = 50_000
DRIFT_MIN_NS = 5_000
DRIFT_MIN_NODES = 5
_REGION = re.compile(r"^Torch-Compiled Region: (\S+)")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass
class NodeInfo:
    graph_id: int
    node: str
    module: str  # "blocks.1.big" ("" at the top level)
    target: str
    phase: str
    source: str | None = None


@dataclass
class RankTimes:
    """One rank's node times: ``per_key[key]`` = ns per step (``steps`` long, 0 where the node did
    not run), ``info[key]`` where the node is. ``missing`` says why there are none."""

    rank: int
    trace_id: int | None = None
    steps: int = 0
    source: str | None = None  # "gpu kernels" | "cpu ops of compiled functions"
    per_key: dict[tuple, list[int]] = field(default_factory=dict)
    info: dict[tuple, NodeInfo] = field(default_factory=dict)
    mapped_calls: int = 0
    unmapped_calls: int = 0
    missing: str | None = None


def _op_name(target: str) -> str:
    """``aten.addmm.default`` → ``aten::addmm`` (the profiler's name for the op)."""
    parts = target.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 and parts[0] in ("aten", "prims") else target


def _source(stack: str | None) -> str | None:
    from graphdeck.analysis.ranks import source_line

    return source_line(stack)


def rank_nodes(session: Session, run_id: int, rank: int) -> tuple[dict[int, list[tuple]], dict[tuple[int, str], tuple], dict]:
    """AOT graphs of one rank: ``{graph_id: [(node name, op name), ...] aten nodes in order}``,
    ``{(graph_id, node): key}`` (NOTE: [Node time per step]) and ``{key: NodeInfo}``."""
    target, module, stack = aliased(InternedString), aliased(InternedString), aliased(InternedString)
    rows = session.execute(
        select(Graph.id, Graph.kind, Node.name, Node.op, target.value, module.value, stack.value)
        .join(Node, Node.graph_id == Graph.id).join(target, target.id == Node.target_id)
        .outerjoin(module, module.id == Node.module_path_id).outerjoin(stack, stack.id == Node.stack_trace_id)
        .where(Graph.run_id == run_id, Graph.rank == rank, Graph.kind.in_(tuple(AOT_PHASE)))
        .order_by(Graph.ordinal, Graph.id, Node.idx)).all()
    seq: dict[int, list[tuple]] = defaultdict(list)
    key_of: dict[tuple[int, str], tuple] = {}
    info: dict[tuple, NodeInfo] = {}
    occ: Counter = Counter()
    for gid, kind, name, op, tgt, mod, st in rows:
        if op != "call_function":
            continue
        phase = AOT_PHASE[kind]
        path = (mod or "").replace("/", ".")
        base = (phase, path, tgt)
        key = (*base, occ[base])
        occ[base] += 1
        key_of[(gid, name)] = key
        info[key] = NodeInfo(gid, name, path, tgt, phase, _source(st))
        if tgt.startswith(("aten.", "prims.")):
            seq[gid].append((name, _op_name(tgt)))
    return dict(seq), key_of, info


def rank_times(session: Session, run_id: int, rank: int) -> RankTimes:
    """Node times per step of one rank (NOTE: [Node time per step]); never raises for missing data:
    ``missing`` says what is missing instead."""
    out = RankTimes(rank)
    trace = session.execute(select(Trace.id, Trace.status).where(
        Trace.run_id == run_id, Trace.rank == rank, Trace.status.in_(("ok", "truncated")))
        .order_by(Trace.id.desc()).limit(1)).first()
    if trace is None:
        out.missing = f"rank {rank}: no profiler trace stored"
        return out
    out.trace_id = trace[0]
    seqs, key_of, info = rank_nodes(session, run_id, rank)
    if not key_of:
        out.missing = f"rank {rank}: no AOTAutograd graph stored to map trace {trace[0]} onto"
        return out
    events = load_events(session, trace[0], with_args=True)
    starts = sorted((e.ts, int(m.group(1))) for e in events if (m := _STEP.match(e.name)))
    out.steps = max(1, len(starts))
    bounds = [s for s, _ in starts]
    acc: dict[tuple, list[int]] = {}

    def add(key: tuple, ts: int, ns: int) -> None:
        import bisect

        i = max(0, bisect.bisect_right(bounds, ts) - 1) if bounds else 0
        if bounds and ts < bounds[0]:
            return  # before the first profiled step
        acc.setdefault(key, [0] * out.steps)[i] += ns

    if not _gpu_times(session, trace[0], events, key_of, add, out):
        _cpu_times(session, run_id, rank, events, seqs, key_of, add, out)
    out.per_key = acc
    out.info = {k: info[k] for k in acc}
    if not acc:
        out.missing = (f"rank {rank}: trace {trace[0]} holds no kernel or compiled-function op that maps onto "
                       "the rank's graphs")
    return out


def _gpu_times(session, trace_id, events, key_of, add, out: RankTimes) -> bool:
    if not any(e.cat in ("kernel", "Kernel") for e in events):
        return False
    from graphdeck.analysis.trace_map import map_trace

    mapping = map_trace(session, trace_id, events)
    if not mapping.by_kernel:
        return False
    by_id = {e.id: e for e in events}
    for kid, (gid, nodes) in mapping.by_kernel.items():
        k = by_id.get(kid)
        if k is None or not nodes:
            continue
        share, rest = divmod(k.dur, len(nodes))
        for j, node in enumerate(nodes):
            key = key_of.get((gid, node))
            if key is not None:
                add(key, k.ts, share + (rest if j == 0 else 0))
                out.mapped_calls += 1
    out.source = "gpu kernels"
    return True


def _children(events: list[Ev]) -> dict[int, list[Ev]]:
    """Direct children (CPU ranges on the same thread) of every range, by event id."""
    kids: dict[int, list[Ev]] = defaultdict(list)
    by_thread: dict[tuple, list[Ev]] = defaultdict(list)
    for e in events:
        if e.cat in CPU_RANGE_CATS:
            by_thread[(e.pid, e.tid)].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[Ev] = []
        for e in evs:
            while stack and stack[-1].end <= e.ts:
                stack.pop()
            if stack:
                kids[stack[-1].id].append(e)
            stack.append(e)
    return kids


def _cpu_times(session, run_id, rank, events, seqs, key_of, add, out: RankTimes) -> None:
    out.source = "cpu ops of compiled functions"
    graphs = session.execute(select(Graph.id, Graph.kind, Graph.compile_id, Graph.parent_id).where(
        Graph.run_id == run_id, Graph.rank == rank, Graph.kind.in_(tuple(AOT_PHASE)))
        .order_by(Graph.ordinal, Graph.id)).all()
    by_cid: dict[tuple[str, str], list[int]] = defaultdict(list)
    backward_of: dict[int, int] = {}
    fwd_by_parent = {(g.parent_id, g.compile_id): g.id for g in graphs if g.kind == "aot_forward"}
    for g in graphs:
        by_cid[(g.kind, g.compile_id)].append(g.id)
        if g.kind == "aot_backward" and (g.parent_id, g.compile_id) in fwd_by_parent:
            backward_of[fwd_by_parent[(g.parent_id, g.compile_id)]] = g.id
    kids = _children(events)
    aligned: dict[tuple, list[int | None]] = {}
    fwd_seq: dict[object, int] = {}  # forward's autograd sequence number -> forward graph id
    work: list[tuple[int, list[Ev]]] = []
    backward_calls: list[Ev] = []
    for e in events:
        m = _REGION.match(e.name)
        if m:
            cid = m.group(1)
            calls = [c for c in _descendants_named(kids, e, "CompiledFunction")]
            if calls:
                fwds = by_cid.get(("aot_forward", cid), [])
                for k, call in enumerate(calls):
                    if k < len(fwds):
                        work.append((fwds[k], kids.get(call.id, [])))
                        fwd_seq[call.arg("Sequence number")] = fwds[k]
                    else:
                        out.unmapped_calls += 1
            elif (inf := by_cid.get(("aot_inference", cid))):
                work.append((inf[0], [c for c in kids.get(e.id, []) if c.name.startswith("aten::")]))
        elif e.name == "CompiledFunctionBackward":
            backward_calls.append(e)
    for e in backward_calls:
        fwd = fwd_seq.get(e.arg("Sequence number"))
        bwd = backward_of.get(fwd) if fwd is not None else None
        if bwd is None:
            out.unmapped_calls += 1
            continue
        work.append((bwd, kids.get(e.id, [])))
    for gid, children in work:
        nodes = seqs.get(gid, [])
        names = tuple(c.name for c in children)
        pairs = aligned.get((gid, names))
        if pairs is None:
            pairs = [None] * len(names)
            sm = difflib.SequenceMatcher(None, [op for _, op in nodes], list(names), autojunk=False)
            for a, b, size in sm.get_matching_blocks():
                for i in range(size):
                    pairs[b + i] = a + i
            aligned[(gid, names)] = pairs
        out.mapped_calls += 1
        for c, at in zip(children, pairs):
            if at is not None:
                add(key_of[(gid, nodes[at][0])], c.ts, c.dur)


def _descendants_named(kids: dict[int, list[Ev]], root: Ev, name: str) -> list[Ev]:
    out, todo = [], list(kids.get(root.id, []))
    while todo:
        e = todo.pop(0)
        if e.name == name:
            out.append(e)
        elif not e.name.startswith("aten::"):
            todo.extend(kids.get(e.id, []))
    return sorted(out, key=lambda e: e.ts)


# ---------------------------------------------------------------------------- comparison


def _stats(xs: list[int]) -> tuple[float, float | None]:
    """(median, robust spread) in ns; spread None with fewer than 2 values."""
    med = float(statistics.median(xs)) if xs else 0.0
    if len(xs) < 2:
        return med, None
    return med, 1.4826 * float(statistics.median([abs(x - med) for x in xs]))


def _quartiles(xs: list[int]) -> tuple[float, float]:
    if len(xs) < 2:
        return float(xs[0]), float(xs[0])
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def judge(a: list[int], b: list[int], k: float, min_ns: int, scale: float = 1.0) -> dict:
    """One comparison (NOTE: [Noise floor]): medians, spreads, delta, pct, floor and ``regression``
    / ``faster`` (True / False; None when a run has fewer than 2 steps), judged on run B's steps
    divided by ``scale`` (the run-wide drift, NOTE: [Drift]); ``pct_adjusted`` is after it."""
    ma, sa = _stats(a)
    mb, sb = _stats(b)
    delta = mb - ma
    floor = None if sa is None or sb is None else max(k * sa, float(min_ns))
    q1, q3 = _quartiles(b) if b else (0.0, 0.0)
    q1, q3, adj = q1 / scale, q3 / scale, mb / scale
    return {"a_ns": round(ma), "b_ns": round(mb), "delta_ns": round(delta),
            "pct": round(100.0 * delta / ma, 1) if ma else None,
            "pct_adjusted": round(100.0 * (adj - ma) / ma, 1) if ma else None,
            "spread_a_ns": None if sa is None else round(sa), "spread_b_ns": None if sb is None else round(sb),
            "floor_ns": None if floor is None else round(floor),
            "regression": None if floor is None else q1 - ma > floor,
            "faster": None if floor is None else ma - q3 > floor,
            "a_steps": list(a), "b_steps": list(b)}


def drift(a: RankTimes, b: RankTimes, min_ns: int = DRIFT_MIN_NS) -> tuple[float, int]:
    """NOTE: [Drift]: the median over nodes of (median B / median A), for nodes of at least
    ``min_ns`` in run A; 1.0 with fewer than ``DRIFT_MIN_NODES`` such nodes. Returns (ratio, nodes)."""
    ratios = []
    for key in a.per_key.keys() & b.per_key.keys():
        ma, mb = statistics.median(a.per_key[key]), statistics.median(b.per_key[key])
        if ma >= min_ns and mb > 0:
            ratios.append(mb / ma)
    if len(ratios) < DRIFT_MIN_NODES:
        return 1.0, len(ratios)
    return float(statistics.median(ratios)), len(ratios)


def compare_rank(a: RankTimes, b: RankTimes, *, k: float = DEFAULT_K, min_ns: int = DEFAULT_MIN_NS) -> dict:
    """Nodes and modules of one rank compared: ``{"nodes": [...], "modules": [...], "drift": ratio,
    "drift_nodes": n}`` (NOTE: [Drift]), each row
    :func:`judge`'s dict plus where it is (``module``, ``target``, ``phase``, graph ids and node
    names of both runs); nodes of one run only are left out (the structure diff reports them)."""
    nodes, mods_a, mods_b = [], defaultdict(lambda: [0] * a.steps), defaultdict(lambda: [0] * b.steps)
    for times, mods in ((a, mods_a), (b, mods_b)):
        for key, per in times.per_key.items():
            path = key[1]
            prefixes = [""] + [".".join(path.split(".")[:i]) for i in range(1, len(path.split(".")) + 1)] if path else [""]
            for p in prefixes:
                acc = mods[p]
                for i, ns in enumerate(per):
                    acc[i] += ns
    scale, used = drift(a, b)
    for key in a.per_key.keys() & b.per_key.keys():
        row = judge(a.per_key[key], b.per_key[key], k, min_ns, scale)
        ia, ib = a.info[key], b.info[key]
        row.update(phase=key[0], module=key[1], target=key[2], occurrence=key[3], a_graph=ia.graph_id, a_node=ia.node,
                   b_graph=ib.graph_id, b_node=ib.node, source=ib.source or ia.source)
        nodes.append(row)
    modules = []
    for path in mods_a.keys() & mods_b.keys():
        row = judge(mods_a[path], mods_b[path], k, min_ns, scale)
        row["module"] = path
        modules.append(row)
    nodes.sort(key=lambda r: -r["delta_ns"])
    modules.sort(key=lambda r: (r["module"].count(".") if r["module"] else -1, r["module"]))
    return {"nodes": nodes, "modules": modules, "drift": round(scale, 3), "drift_nodes": used}
