"""Node times per training step from a run's stored profiler traces, and their comparison between
two runs with a noise floor (``graphdeck diff-runs``, NOTE: [Run diff] in
graphdeck/analysis/diff/runs.py).

# NOTE: [Node time per step]
A node's time is read from the newest ``ok``/``truncated`` trace of each rank, split into steps by
the profiler's host-side ``ProfilerStep#N`` ranges (a step runs from its range's start to the next
one's; a trace without them is one step, and then no spread can be measured):

* every unit the one trace → node mapping places, the mapping every other consumer uses too
  (:func:`graphdeck.analysis.traces.mapping.map_trace`: the summary's trace coverage, the
  node-times API and time overlay, ``export-trace``, the replay page): GPU kernels by Inductor's
  provenance (NOTE: [Kernel to node mapping]); on a CPU trace the ops and C++ kernels of compiled
  ranges — Inductor's C++ kernels through the same provenance tables, ``aot_eager``'s ATen ops
  aligned with the AOT graph's nodes (NOTE: [CPU trace mapping] in
  :mod:`graphdeck.analysis.traces.cpu_mapping`). Each unit's own time (a fused kernel's split
  evenly over its nodes; not the labelled overhead around it) counts in the step it starts in.
* a GPU trace none of whose kernels maps (a backend that runs the AOT graph op by op,
  ``aot_eager`` on CUDA) is mapped by its CPU ops with the same CPU mapper.

Before (issue 36 item 2) this module had a CPU mapper of its own that knew only ``aot_eager``'s
``CompiledFunction`` ranges, so a CPU job compiled with Inductor (the demo) had no node times in
``diff-runs`` while every other view mapped the same trace.

The ingest does this mapping once per trace and keeps it (NOTE: [Node-time table] in
:mod:`graphdeck.store.node_times`: :func:`trace_node_times` is what it stores); :func:`rank_times`
reads that table and maps the events itself only when a trace has no valid set there.

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

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import CPU_RANGE_CATS, GPU_KERNEL_CATS, Ev
from graphdeck.store.schema import Graph, InternedString, Node, Trace

AOT_PHASE = {"aot_forward": "forward", "aot_backward": "backward", "aot_inference": "inference"}
DEFAULT_K = 3.0
DEFAULT_MIN_NS = 50_000
DRIFT_MIN_NS = 5_000
DRIFT_MIN_NODES = 5
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass(slots=True)
class NodeInfo:
    graph_id: int
    node: str
    module: str  # "blocks.1.big" ("" at the top level)
    target: str
    phase: str
    source: str | int | None = None  # user source line (a stack-trace string id until resolved)


@dataclass
class RankTimes:
    """One rank's node times: row ``i`` of ``matrix`` (int64 ns, ``len(keys)`` × ``steps``, 0
    where the node did not run in a step) is node ``keys[i]``; ``info[key]`` says where the node
    is. ``missing`` says why there are none."""

    rank: int
    trace_id: int | None = None
    steps: int = 0
    source: str | None = None  # "gpu kernels" | "cpu ops of compiled functions"
    keys: list[tuple] = field(default_factory=list)
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    info: dict[tuple, NodeInfo] = field(default_factory=dict)
    mapped_calls: int = 0
    unmapped_calls: int = 0
    missing: str | None = None
    times_from: str | None = None  # "node-time table" | "trace events (why the table was not used)"

    @property
    def per_key(self) -> dict[tuple, list[int]]:
        """``{key: ns per step}``."""
        return dict(zip(self.keys, self.matrix.tolist()))

    def rows(self, keys: list[tuple]) -> np.ndarray:
        """The float64 (len(keys) × steps) matrix of ``keys`` (each one of :attr:`keys`)."""
        at = {k: i for i, k in enumerate(self.keys)}
        return self.matrix[np.fromiter((at[k] for k in keys), dtype=np.int64, count=len(keys))].astype(np.float64)


def _op_name(target: str) -> str:
    """``aten.addmm.default`` → ``aten::addmm`` (the profiler's name for the op)."""
    parts = target.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 and parts[0] in ("aten", "prims") else target


def rank_nodes(session: Session, run_id: int, rank: int) -> tuple[dict[int, list[tuple]], dict[tuple[int, str], tuple], dict]:
    """AOT graphs of one rank: ``{graph_id: [(node name, op name), ...] aten nodes in order}``,
    ``{(graph_id, node): key}`` (NOTE: [Node time per step]) and ``{key: NodeInfo}`` (``source``
    filled in by :func:`_sources` for the nodes that have times)."""
    rows = session.connection().execute(  # Core rows: the ORM's row processing cost more than the query
        select(Graph.id, Graph.kind, Node.name, Node.target_id, Node.module_path_id, Node.stack_trace_id)
        .join(Node, Node.graph_id == Graph.id)
        .where(Graph.run_id == run_id, Graph.rank == rank, Graph.kind.in_(tuple(AOT_PHASE)),
               Node.op == "call_function")
        .order_by(Graph.ordinal, Graph.id, Node.idx)).all()
    strings = _strings(session, {r[3] for r in rows} | {r[4] for r in rows if r[4] is not None})
    paths = {i: v.replace("/", ".") for i, v in strings.items()}
    seq: dict[int, list[tuple]] = defaultdict(list)
    key_of: dict[tuple[int, str], tuple] = {}
    info: dict[tuple, NodeInfo] = {}
    occ: Counter = Counter()
    op_names: dict[str, str | None] = {}
    for gid, kind, name, tgt_id, mod_id, st in rows:
        tgt = strings[tgt_id]
        phase = AOT_PHASE[kind]
        path = paths[mod_id] if mod_id is not None and strings[mod_id] else ""
        base = (phase, path, tgt)
        n = occ[base]
        occ[base] = n + 1
        key = (phase, path, tgt, n)
        key_of[(gid, name)] = key
        info[key] = NodeInfo(gid, name, path, tgt, phase, st)
        op = op_names.get(tgt, 0)
        if op == 0:
            op = op_names[tgt] = _op_name(tgt) if tgt.startswith(("aten.", "prims.")) else None
        if op is not None:
            seq[gid].append((name, op))
    return dict(seq), key_of, info


def _strings(session: Session, ids: set[int]) -> dict[int, str]:
    """Interned strings by id (one query per 20,000 ids)."""
    ids_l, out = sorted(ids), {}
    for i in range(0, len(ids_l), 20_000):
        out.update(session.connection().execute(select(InternedString.id, InternedString.value)
                                                .where(InternedString.id.in_(ids_l[i:i + 20_000]))).all())
    return out


def _sources(session: Session, infos: list[NodeInfo]) -> None:
    """Replace each info's stack-trace string id (``source``) by its user source line; stack traces
    are interned, so each distinct one is read and parsed once."""
    from graphdeck.analysis.ranks.core import source_line

    ids = {i.source for i in infos if isinstance(i.source, int)}
    text = dict(session.execute(select(InternedString.id, InternedString.value).where(InternedString.id.in_(ids)))
                .all()) if ids else {}
    line = {k: source_line(v) for k, v in text.items()}
    for i in infos:
        i.source = line.get(i.source) if isinstance(i.source, int) else i.source


_EVENTS_SQL = text(
    "SELECT e.id, e.name_id, e.cat_id, e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation FROM trace_events e "
    "WHERE e.trace_id = :tid AND e.ph = 'X' ORDER BY e.ts_ns, e.dur_ns DESC, e.id")
_ARGS_SQL = text("SELECT e.id, e.args_json FROM trace_events e JOIN strings n ON n.id = e.name_id "
                 "WHERE e.trace_id = :tid AND n.value IN ('CompiledFunction', 'CompiledFunctionBackward')")


def _load(session: Session, trace_id: int) -> list[tuple]:
    """The trace's ``X`` events as rows of :class:`Ev`'s fields (id, name, cat, ts, dur, pid, tid,
    correlation, args), by start and, at one start, longest first; arguments kept only for the
    compiled-function ranges (their ``Sequence number``). One batch; names are read once per
    distinct string, not joined per event."""
    rows = session.execute(_EVENTS_SQL, {"tid": trace_id}).fetchall()
    names = _strings(session, {r[1] for r in rows} | {r[2] for r in rows if r[2] is not None})
    args = dict(session.execute(_ARGS_SQL, {"tid": trace_id}).fetchall())
    return [(r[0], names[r[1]], names.get(r[2], ""), r[3], r[4], r[5], r[6], r[7], args.get(r[0])) for r in rows]


def rank_times(session: Session, run_id: int, rank: int) -> RankTimes:
    """Node times per step of one rank (NOTE: [Node time per step]); never raises for missing data:
    ``missing`` says what is missing instead. Read from the node-time table written at ingest
    (NOTE: [Node-time table] in :mod:`graphdeck.store.node_times`), else mapped from the trace's
    events here; ``times_from`` says which, and why."""
    from graphdeck.store import node_times

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
    times, why = node_times.load(session, trace[0], run_id, rank)
    if times is None:
        times = trace_node_times(session, run_id, rank, trace[0], (seqs, key_of))
        out.times_from = f"trace events ({why})"
    else:
        out.times_from = "node-time table"
    out.steps, out.source = times.steps, times.source
    out.mapped_calls, out.unmapped_calls = times.mapped_calls, times.unmapped_calls
    keep = [i for i, node in enumerate(times.nodes) if node in key_of]
    out.keys = [key_of[times.nodes[i]] for i in keep]
    out.matrix = times.step_ns[keep] if keep else np.zeros((0, times.steps), dtype=np.int64)
    out.info = {k: info[k] for k in out.keys}
    _sources(session, list(out.info.values()))
    if not out.keys:
        out.missing = (f"rank {rank}: trace {trace[0]} holds no kernel or compiled-function op that maps onto "
                       "the rank's graphs")
    return out


def trace_node_times(session: Session, run_id: int, rank: int, trace_id: int, nodes: tuple | None = None,
                     by_kernel: dict | None = None):
    """Map trace ``trace_id``'s events onto the AOT graphs of run ``run_id``'s rank ``rank``
    (NOTE: [Node time per step]): a :class:`graphdeck.store.node_times.TraceNodeTimes` with one
    row per (graph id, node) that any timed call reached, its ns per profiled step, total ns
    (before the first step too) and call count. ``nodes``: :func:`rank_nodes`' first two results,
    when the caller has them; ``by_kernel``: the trace's ``map_trace`` ``by_kernel``, when the
    caller has it (else mapped here). What :func:`graphdeck.store.node_times.record` stores at ingest."""
    from graphdeck.store.node_times import TraceNodeTimes

    out = TraceNodeTimes(trace_id)
    seqs, key_of = nodes if nodes is not None else rank_nodes(session, run_id, rank)[:2]
    if not key_of:
        out.missing = f"rank {rank}: no AOTAutograd graph stored to map trace {trace_id} onto"
        return out
    if by_kernel is not None and _streamed_times(session, trace_id, key_of, by_kernel, out):
        if not out.nodes:
            out.missing = (f"rank {rank}: trace {trace_id} holds no kernel or compiled-function op that maps onto "
                           "the rank's graphs")
        return out
    events = _load(session, trace_id)
    # Host-side step ranges only: Kineto repeats ProfilerStep#N on the GPU timeline
    # (gpu_user_annotation), which would split every step in two.
    bounds = np.array(sorted({e[3] for e in events if e[2] in CPU_RANGE_CATS and _STEP.match(e[1])}), dtype=np.int64)
    out.steps = max(1, len(bounds))
    index: dict[tuple[int, str], int] = {}
    hits: tuple[list[int], list[int], list[int]] = ([], [], [])  # node index, ts, ns

    def add(where: list[tuple[int, str]], ts: list[int], ns: list[int]) -> None:
        """Time ``ns[j]`` of node ``where[j]`` (graph id, name) that started at ``ts[j]``."""
        get = index.get
        for node in where:
            i = get(node)
            if i is None:
                i = index[node] = len(index)
            hits[0].append(i)
        hits[1].extend(ts)
        hits[2].extend(ns)

    _mapped_times(session, trace_id, events, key_of, add, out, by_kernel)
    n = len(index)
    acc = np.zeros((n, out.steps + 1), dtype=np.int64)  # column 0: before the first profiled step
    count = np.zeros(n, dtype=np.int64)
    if hits[0]:
        idx, ts, ns = (np.asarray(x, dtype=np.int64) for x in hits)
        step = np.searchsorted(bounds, ts, side="right") - 1 if len(bounds) else np.zeros(len(ts), dtype=np.int64)
        np.add.at(acc, (idx, np.maximum(step, -1) + 1), ns)
        np.add.at(count, idx, 1)
    out.nodes = list(index)
    out.step_ns, out.total_ns, out.count = acc[:, 1:], acc.sum(axis=1), count
    if not n:
        out.missing = (f"rank {rank}: trace {trace_id} holds no kernel or compiled-function op that maps onto "
                       "the rank's graphs")
    return out


_BOUNDS_SQL = ("SELECT DISTINCT e.ts_ns, n.value FROM trace_events e JOIN strings n ON n.id = e.name_id "
               "WHERE e.trace_id = :tid AND e.ph = 'X' AND e.name_id IN (SELECT id FROM strings WHERE value LIKE "
               "'ProfilerStep#%') AND e.cat_id IN (SELECT id FROM strings WHERE value IN ({cats}))")
_KERNEL_TIMES_SQL = ("SELECT e.id, e.ts_ns, e.dur_ns FROM trace_events e WHERE e.trace_id = :tid AND e.ph = 'X' "
                     "AND e.cat_id IN (SELECT id FROM strings WHERE value IN ({cats}))")
#: Kernel placements added to the (node x step) sums at once by :func:`_streamed_times`.
_CHUNK = 8_192


def _in(params: dict, prefix: str, values) -> str:
    names = sorted(values)
    params.update({f"{prefix}{i}": v for i, v in enumerate(names)})
    return ",".join(f":{prefix}{i}" for i in range(len(names)))


def _streamed_times(session: Session, trace_id: int, key_of: dict, by_kernel: dict, out) -> bool:
    """:func:`trace_node_times` of a GPU trace whose ``by_kernel`` the caller has, without loading
    its events (issue 36 item 9): the host step starts (one query), then the GPU kernels' ``(id,
    ts, dur)`` streamed and added to the (node x step) sums a chunk at a time, so memory is the
    nodes' sums, not the trace. The same rows as the loaded path (nodes in ``by_kernel`` order).
    False (``out`` untouched) when the loaded path must run: no GPU kernel, no kernel mapped onto
    ``key_of`` (the CPU mapper's fallback), or a kernel of ``by_kernel`` not among the events."""
    params: dict = {"tid": trace_id}
    sql = _KERNEL_TIMES_SQL.format(cats=_in(params, "k", GPU_KERNEL_CATS))
    if session.execute(text(sql + " LIMIT 1"), params).first() is None:
        return False
    if not any((gid, n) in key_of for gid, nodes in by_kernel.values() for n in nodes):
        return False
    index: dict[tuple[int, str], int] = {}
    mapped = unmapped = 0
    for gid, nodes in by_kernel.values():  # nodes numbered, and calls counted, in by_kernel order
        if not nodes:
            continue
        placed = False
        for node in nodes:
            if (gid, node) in key_of:
                index.setdefault((gid, node), len(index))
                placed = True
        mapped, unmapped = (mapped + 1, unmapped) if placed else (mapped, unmapped + 1)
    bp: dict = {"tid": trace_id}
    rows = session.execute(text(_BOUNDS_SQL.format(cats=_in(bp, "c", CPU_RANGE_CATS))), bp).fetchall()
    bounds = np.array(sorted({ts for ts, name in rows if _STEP.match(name)}), dtype=np.int64)
    steps = max(1, len(bounds))
    acc = np.zeros((len(index), steps + 1), dtype=np.int64)  # column 0: before the first profiled step
    count = np.zeros(len(index), dtype=np.int64)
    hits: tuple[list[int], list[int], list[int]] = ([], [], [])  # node index, ts, ns

    def flush() -> None:
        if hits[0]:
            idx, ts, ns = (np.asarray(x, dtype=np.int64) for x in hits)
            step = np.searchsorted(bounds, ts, side="right") - 1 if len(bounds) else np.zeros(len(ts), dtype=np.int64)
            np.add.at(acc, (idx, np.maximum(step, -1) + 1), ns)
            np.add.at(count, idx, 1)
            for x in hits:
                x.clear()

    found = 0
    result = session.connection().execution_options(stream_results=True, yield_per=5000).execute(text(sql), params)
    try:
        get, at = by_kernel.get, index.get
        for kid, ts, dur in result:
            hit = get(kid)
            if hit is None:
                continue
            found += 1
            gid, nodes = hit
            if not nodes:
                continue
            share, rest = divmod(dur, len(nodes))
            for j, node in enumerate(nodes):
                i = at((gid, node))
                if i is not None:
                    hits[0].append(i)
                    hits[1].append(ts)
                    hits[2].append(share + (rest if j == 0 else 0))
            if len(hits[0]) >= _CHUNK:
                flush()
    finally:
        result.close()
    if found != len(by_kernel):  # a kernel the loaded path would skip: its node order may differ
        return False
    flush()
    out.steps, out.source = steps, "gpu kernels"
    out.mapped_calls, out.unmapped_calls = mapped, unmapped
    out.nodes = list(index)
    out.step_ns, out.total_ns, out.count = acc[:, 1:], acc.sum(axis=1), count
    return True


def _mapped_times(session, trace_id, rows, key_of, add, out, by_kernel=None) -> None:
    """Each unit the one trace → node mapping places (:func:`graphdeck.analysis.traces.mapping.
    map_trace`: GPU kernels by provenance; on a CPU trace the ops and C++ kernels of compiled
    ranges, NOTE: [CPU trace mapping]) adds its own time to its nodes (a fused kernel's split
    evenly), in the step it starts in. A GPU trace none of whose kernels maps (a backend that
    runs the AOT graph op by op, e.g. ``aot_eager`` on CUDA) is mapped by its CPU ops instead,
    with the same CPU mapper. ``by_kernel``: ``map_trace``'s, when the caller has it."""
    from graphdeck.analysis.traces.mapping import KernelMapping, _tables, map_trace

    events = [Ev(*e) for e in rows]
    gpu = any(e.cat in GPU_KERNEL_CATS for e in events)
    if by_kernel is None:
        by_kernel = map_trace(session, trace_id, events).by_kernel
    if gpu and not any((gid, n) in key_of for gid, nodes in by_kernel.values() for n in nodes):
        from graphdeck.analysis.traces.cpu_mapping import map_cpu_trace

        trace = session.get(Trace, trace_id)
        cpu = KernelMapping(trace_id)
        map_cpu_trace(session, trace, events, _tables(session, trace.run_id, trace.rank), cpu, Counter(), Counter())
        by_kernel, gpu = cpu.by_kernel, False
    out.source = "gpu kernels" if gpu else "cpu ops of compiled functions"
    by_id = {e.id: e for e in events}
    for kid, (gid, nodes) in by_kernel.items():
        k = by_id.get(kid)
        if k is None or not nodes:
            continue
        share, rest = divmod(k.dur, len(nodes))
        placed = False
        for j, node in enumerate(nodes):
            if (gid, node) in key_of:
                add([(gid, node)], [k.ts], [share + (rest if j == 0 else 0)])
                placed = True
        if placed:
            out.mapped_calls += 1
        else:
            out.unmapped_calls += 1


# ---------------------------------------------------------------------------- comparison


def judge(a: list[int], b: list[int], k: float = DEFAULT_K, min_ns: int = DEFAULT_MIN_NS, scale: float = 1.0) -> dict:
    """One comparison (NOTE: [Noise floor]) of a node's ns per step in run A (``a``) and run B
    (``b``): medians ``a_ns``/``b_ns``, ``delta_ns``, ``pct`` (and ``pct_adjusted``, after dividing B
    by ``scale``, the drift of NOTE: [Drift]), spreads, ``floor_ns`` and ``regression`` / ``faster``
    (True / False; None when a run has fewer than 2 steps).

    >>> judge([100_000] * 4, [400_000] * 4)["regression"], judge([100_000, 101_000], [100_500] * 2)["regression"]
    (True, False)
    """
    j = _judge_many(np.asarray([a], dtype=np.float64), np.asarray([b], dtype=np.float64), k, min_ns, scale)
    return _row(j, 0, a, b)


def _judge_many(a: np.ndarray, b: np.ndarray, k: float, min_ns: int, scale: float) -> dict[str, np.ndarray]:
    """:func:`judge` over rows of (keys × steps) matrices at once."""
    ma, mb = np.median(a, axis=1), np.median(b, axis=1)
    if a.shape[1] < 2 or b.shape[1] < 2:
        nan = np.full(len(ma), np.nan)
        sa = sb = nan
    else:
        sa = 1.4826 * np.median(np.abs(a - ma[:, None]), axis=1)
        sb = 1.4826 * np.median(np.abs(b - mb[:, None]), axis=1)
    q1, q3 = np.percentile(b, [25, 75], axis=1) if b.shape[1] else (mb, mb)
    floor = np.maximum(k * sa, float(min_ns))
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"ma": ma, "mb": mb, "sa": sa, "sb": sb, "floor": floor, "reg": (q1 / scale - ma) > floor,
                "fast": (ma - q3 / scale) > floor, "pct": np.where(ma > 0, 100.0 * (mb - ma) / ma, np.nan),
                "pct_adj": np.where(ma > 0, 100.0 * (mb / scale - ma) / ma, np.nan)}


def _row(j: dict, i: int, a_steps: list[int], b_steps: list[int]) -> dict:
    def num(x):
        return None if np.isnan(x) else round(float(x), 1)

    known = not np.isnan(j["sa"][i]) and not np.isnan(j["sb"][i])
    return {"a_ns": round(float(j["ma"][i])), "b_ns": round(float(j["mb"][i])),
            "delta_ns": round(float(j["mb"][i] - j["ma"][i])), "pct": num(j["pct"][i]),
            "pct_adjusted": num(j["pct_adj"][i]), "spread_a_ns": None if not known else round(float(j["sa"][i])),
            "spread_b_ns": None if not known else round(float(j["sb"][i])),
            "floor_ns": None if not known else round(float(j["floor"][i])),
            "regression": bool(j["reg"][i]) if known else None, "faster": bool(j["fast"][i]) if known else None,
            "a_steps": list(a_steps), "b_steps": list(b_steps)}


def drift(a: RankTimes, b: RankTimes, keys: list[tuple] | None = None, min_ns: int = DRIFT_MIN_NS,
          xa: np.ndarray | None = None, xb: np.ndarray | None = None) -> tuple[float, int]:
    """NOTE: [Drift]: the median over nodes of (median B / median A), for nodes of at least
    ``min_ns`` in run A; 1.0 with fewer than ``DRIFT_MIN_NODES`` such nodes. Returns (ratio, nodes).
    ``xa`` / ``xb``: the runs' (keys × steps) matrices, when the caller has them."""
    keys = keys if keys is not None else sorted(set(a.keys) & set(b.keys))
    if not keys:
        return 1.0, 0
    ma = np.median(xa if xa is not None else a.rows(keys), axis=1)
    mb = np.median(xb if xb is not None else b.rows(keys), axis=1)
    ok = (ma >= min_ns) & (mb > 0)
    if int(ok.sum()) < DRIFT_MIN_NODES:
        return 1.0, int(ok.sum())
    return float(np.median(mb[ok] / ma[ok])), int(ok.sum())


def _module_sums(t: RankTimes) -> dict[str, np.ndarray]:
    """Per module path (and ``""``: everything) the summed ns per step of its nodes and its
    sub-modules' nodes (float64 rows)."""
    if not t.keys:
        return {}
    own: dict[str, int] = {}  # each node to its own module first, then each module to its prefixes
    at = np.fromiter((own.setdefault(key[1], len(own)) for key in t.keys), dtype=np.int64, count=len(t.keys))
    by_path = np.zeros((len(own), t.steps))
    np.add.at(by_path, at, t.matrix.astype(np.float64))
    prefix: dict[str, int] = {}
    rows, cols = [], []
    for path, i in own.items():
        parts = path.split(".") if path else []
        for p in [""] + [".".join(parts[:n]) for n in range(1, len(parts) + 1)]:
            rows.append(i)
            cols.append(prefix.setdefault(p, len(prefix)))
    sums = np.zeros((len(prefix), t.steps))
    np.add.at(sums, np.asarray(cols), by_path[np.asarray(rows)])
    return {p: sums[j] for p, j in prefix.items()}


def compare_rank(a: RankTimes, b: RankTimes, *, k: float = DEFAULT_K, min_ns: int = DEFAULT_MIN_NS,
                 top: int = 30) -> dict:
    """Nodes and modules of one rank compared: ``{"nodes": [...], "modules": [...], "drift": ratio,
    "drift_nodes": n}`` (NOTE: [Drift]). ``nodes``: the ``top`` nodes by added ns plus every
    regressed node, largest first; ``modules``: every module (and ``""``, the whole rank). Each row
    is :func:`judge`'s dict plus where it is (``module``, ``target``, ``phase``, graph ids and node
    names of both runs); nodes of one run only are left out (the structure diff reports them)."""
    keys = sorted(set(a.keys) & set(b.keys))
    xa, xb = a.rows(keys), b.rows(keys)
    scale, used = drift(a, b, keys, xa=xa, xb=xb)
    nodes = []
    if keys:
        j = _judge_many(xa, xb, k, min_ns, scale)
        delta = j["mb"] - j["ma"]
        order = np.argsort(-delta, kind="stable")
        pick = list(order[:top]) + [i for i in order[top:] if j["reg"][i]]
        for i in pick:
            key = keys[i]
            row = _row(j, i, xa[i].astype(np.int64).tolist(), xb[i].astype(np.int64).tolist())
            ia, ib = a.info[key], b.info[key]
            row.update(phase=key[0], module=key[1], target=key[2], occurrence=key[3], a_graph=ia.graph_id,
                       a_node=ia.node, b_graph=ib.graph_id, b_node=ib.node, source=ib.source or ia.source)
            nodes.append(row)
    mods_a, mods_b = _module_sums(a), _module_sums(b)
    paths = sorted(mods_a.keys() & mods_b.keys(), key=lambda p: (p.count(".") if p else -1, p))
    modules = []
    if paths:
        ma = np.array([mods_a[p] for p in paths]).reshape(len(paths), a.steps)
        mb = np.array([mods_b[p] for p in paths]).reshape(len(paths), b.steps)
        j = _judge_many(ma, mb, k, min_ns, scale)
        for i, path in enumerate(paths):
            row = _row(j, i, ma[i].astype(np.int64).tolist(), mb[i].astype(np.int64).tolist())
            row["module"] = path
            modules.append(row)
    return {"nodes": nodes, "modules": modules, "drift": round(scale, 3), "drift_nodes": used}
