"""Splitting a stored graph into K pipeline stages, and the stage table.

Stages are contiguous runs of the graph's node order (so every stage only reads values of earlier
stages and a pipeline can stream microbatches through them). The unit of cutting is a compute
node together with the ``getitem`` nodes that unpack it (a tuple never crosses a stage);
placeholders and ``get_attr`` tensors belong to the stage of their first reader (every worker can
make any graph input, so inputs never cross), the ``output`` node to the last stage. A graph
output stays on the stage that makes it (a forward graph's saved activations are needed by the
same stage's backward, not by the last stage), so only values read by a later stage's nodes are
boundaries.

Strategies (the design notes' ``graph_partition_strategy``):

- ``layerwise``: cuts only at module boundaries: units are grouped by layer (module path up to
  its first numeric part, ``transformer/h/3/attn`` → ``transformer/h/3``; else the path), and
  groups are balanced by compute-node count.
- ``memory_aware``: balances input bytes (parameters, and a backward graph's saved activations;
  each counted at its first reader) plus
  activation bytes, counting each storage once at the node that allocates it — the tensors of
  :func:`graphdeck.analysis.memory.core.graph_memory`'s liveness, so views cost nothing.
- ``auto``: balances measured node time (ns) from a trace (an executor trace of the graph, else a
  compiled run's kernel mapping; :func:`graphdeck.replay.executor.recorded_node_ns`).

The cut search is the classic linear-partition one: binary search on the largest stage cost, a
greedy pass deciding feasibility (Skiena, *The Algorithm Design Manual*, §8.5 states the problem;
this is the standard bisection solution for integer weights).

Torch is not imported here: the server builds stage tables from the store alone.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from graphdeck.errors import UsageError

STRATEGIES = ("layerwise", "memory_aware", "auto")
_LAYER = re.compile(r"^(.*?/\d+)(?:/|$)")


@dataclass
class Boundary:
    """A value made in stage ``src`` and read in stage ``dst`` (sent point to point)."""

    name: str
    src: int
    dst: int
    size_bytes: int
    shape: list | None
    dtype: str | None


@dataclass
class Stage:
    index: int
    nodes: list[str]  # every node of the stage (placeholders included), graph order
    compute_nodes: int
    param_bytes: int
    activation_bytes: int  # storages allocated in the stage (liveness tensors)
    peak_live_bytes: int | None  # graph-wide live bytes, max over the stage's positions
    est_time_ns: int | None
    recv: list[Boundary] = field(default_factory=list)
    send: list[Boundary] = field(default_factory=list)
    cost: float = 0.0


@dataclass
class Plan:
    """A partition of graph ``graph_id``: ``assignment`` maps every node name to its stage."""

    graph_id: int
    strategy: str
    k: int
    assignment: dict[str, int]
    stages: list[Stage]
    balance: float  # max / mean of the strategy's own stage cost
    time_balance: float | None  # max / mean of estimated stage time, when node times are known
    time_source: int | None = None  # trace id the node times came from

    def to_dict(self) -> dict:
        out = asdict(self)
        out["boundaries"] = [b for s in out["stages"] for b in s["send"]]
        return out


def _layer_key(path: str | None) -> str:
    if not path:
        return ""
    m = _LAYER.match(path)
    return m.group(1) if m else path


def _units(stored) -> tuple[list[list], dict[str, int]]:
    """Compute nodes grouped with their getitems, in order; and placeholder → first reader."""
    units: list[list] = []
    owner: dict[str, int] = {}
    for n in stored.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        ins = n.inputs()
        if n.target == "_operator.getitem" and ins and ins[0] in owner:
            units[owner[ins[0]]].append(n)
            owner[n.name] = owner[ins[0]]
            continue
        owner[n.name] = len(units)
        units.append([n])
    return units, owner


def _bisect(weights: list[int], k: int) -> list[int]:
    """Start index of each group when splitting ``weights`` into at most ``k`` contiguous groups
    with the smallest largest sum; then split the fattest groups until there are ``min(k, n)``."""
    def groups_for(limit: int) -> list[int] | None:
        starts, acc = [0], 0
        for i, w in enumerate(weights):
            if w > limit:
                return None
            if acc + w > limit:
                starts.append(i)
                acc = 0
            acc += w
        return starts if len(starts) <= k else None

    lo, hi = max(weights, default=0), max(1, sum(weights))
    while lo < hi:
        mid = (lo + hi) // 2
        if groups_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    starts = groups_for(lo) or [0]
    while len(starts) < min(k, len(weights)):
        bounds = starts + [len(weights)]
        sizes = [(sum(weights[bounds[i]:bounds[i + 1]]), bounds[i + 1] - bounds[i], i) for i in range(len(starts))]
        _, width, i = max(s for s in sizes if s[1] > 1)
        a, b = bounds[i], bounds[i + 1]
        half, acc, cut = sum(weights[a:b]) / 2, 0, a + 1
        for j in range(a, b - 1):
            acc += weights[j]
            cut = j + 1
            if acc >= half:
                break
        starts.insert(i + 1, cut)
    return starts


def partition(stored, k: int, strategy: str, *, node_ns: dict[str, int] | None = None, memory=None) -> Plan:
    """Split ``stored`` (:class:`graphdeck.replay.executor.StoredGraph`) into ``k`` stages.

    ``node_ns``: measured time per node name (required for ``auto``; used for every strategy's
    ``est_time_ns``). ``memory``: the graph's :class:`graphdeck.analysis.memory.core.MemoryCurve`
    (``memory_aware`` needs it; stage bytes use it when given).
    Raises UsageError for an unknown strategy, ``k < 1``, or ``auto`` without node times.
    """
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if k < 1:
        raise UsageError(f"need at least one worker, got {k}")
    if strategy == "auto" and not node_ns:
        raise UsageError("strategy 'auto' needs measured node times: no trace of this graph maps onto its nodes "
                         "(run the executor once, e.g. `graphdeck replay RUN GRAPH --workers 1`)")
    if strategy == "memory_aware" and memory is None:
        raise UsageError("strategy 'memory_aware' needs the graph's liveness (analysis.memory.core.graph_memory)")
    units, owner = _units(stored)
    nodes = stored.by_name()
    alloc = {t.name: t.size_bytes for t in memory.tensors if t.kind not in ("parameter", "input")} if memory else {}
    param_first: dict[str, int] = {}
    for i, unit in enumerate(units):
        for n in unit:
            for ref in n.inputs():
                src = nodes.get(ref)
                if src is not None and src.op in ("placeholder", "get_attr") and ref not in param_first:
                    param_first[ref] = i

    def unit_cost(i: int, unit: list) -> int:
        if strategy == "auto":
            return sum(node_ns.get(n.name, 0) for n in unit)
        if strategy == "memory_aware":
            held = sum(nodes[p].size_bytes or 0 for p, u in param_first.items() if u == i)
            return held + sum(alloc.get(n.name, 0) for n in unit)
        return 1

    costs = [unit_cost(i, u) for i, u in enumerate(units)]
    if strategy == "layerwise":
        groups: list[list[int]] = []
        last = None
        for i, unit in enumerate(units):
            key = _layer_key(unit[0].module_path)
            if not groups or key != last:
                groups.append([])
            groups[-1].append(i)
            last = key
        g_starts = _bisect([len(g) for g in groups], k)
        starts = [groups[s][0] for s in g_starts]
    else:
        starts = _bisect(costs, k)
    stage_of_unit = [0] * len(units)
    for s, a in enumerate(starts):
        b = starts[s + 1] if s + 1 < len(starts) else len(units)
        for i in range(a, b):
            stage_of_unit[i] = s
    n_stages = len(starts)
    assignment: dict[str, int] = {}
    for n in stored.nodes:
        if n.op in ("placeholder", "get_attr"):
            assignment[n.name] = stage_of_unit[param_first[n.name]] if n.name in param_first else 0
        elif n.op == "output":
            assignment[n.name] = n_stages - 1
        else:
            assignment[n.name] = stage_of_unit[owner[n.name]]
    stage_costs = [0.0] * n_stages
    for i, c in enumerate(costs):
        stage_costs[stage_of_unit[i]] += c
    return _plan(stored, strategy, k, assignment, n_stages, stage_costs, node_ns, memory, alloc)


def _plan(stored, strategy, k, assignment, n_stages, stage_costs, node_ns, memory, alloc) -> Plan:
    nodes = stored.by_name()
    stages = [Stage(s, [], 0, 0, 0, None, 0 if node_ns else None, cost=stage_costs[s]) for s in range(n_stages)]
    pos = {n.name: i for i, n in enumerate(stored.nodes)}
    seen: set[tuple[str, int]] = set()
    for n in stored.nodes:
        s = assignment[n.name]
        st = stages[s]
        st.nodes.append(n.name)
        if n.op in ("call_function", "call_method", "call_module"):
            st.compute_nodes += 1
            st.activation_bytes += alloc.get(n.name, 0) if memory else (n.size_bytes or 0)
            if node_ns:
                st.est_time_ns += node_ns.get(n.name, 0)
        if n.op in ("placeholder", "get_attr") and (n.param_fqn or n.op == "get_attr"):
            st.param_bytes += n.size_bytes or 0
        for ref in n.inputs() if n.op != "output" else ():  # graph outputs stay where they are made
            src = nodes.get(ref)
            if src is None or src.op in ("placeholder", "get_attr"):
                continue
            a = assignment[ref]
            if a != s and (ref, s) not in seen:
                seen.add((ref, s))
                b = Boundary(ref, a, s, src.size_bytes or 0, src.shape, src.dtype)
                stages[a].send.append(b)
                st.recv.append(b)
    if memory is not None:
        live = memory.live_bytes
        for st in stages:
            idxs = [pos[name] for name in st.nodes if pos[name] < len(live)]
            st.peak_live_bytes = max((live[i] for i in idxs), default=0)
    balance = _ratio(stage_costs)
    time_balance = _ratio([st.est_time_ns for st in stages]) if node_ns else None
    return Plan(stored.id, strategy, k, assignment, stages, balance, time_balance)


def _ratio(values) -> float:
    values = list(values)
    mean = sum(values) / len(values) if values else 0
    return round(max(values) / mean, 4) if mean else 1.0


def plan_for_graph(session, graph_id: int, k: int, strategy: str, *, trace_id: int | None = None) -> Plan:
    """Load graph ``graph_id``, its liveness and (when a trace maps onto it) its node times, and
    partition it. ``trace_id`` picks the trace of node times (default: the newest that maps).
    Raises NotFoundError, UsageError (see :func:`partition`)."""
    from graphdeck.analysis.memory.core import graph_memory
    from graphdeck.replay.executor import load_stored_graph, node_times_from_trace, recorded_node_ns

    stored = load_stored_graph(session, graph_id)
    if trace_id is None:
        trace_id, node_ns = recorded_node_ns(session, graph_id, exclude=set())
    else:
        cpu, gpu = node_times_from_trace(session, trace_id, graph_id)
        node_ns = gpu or cpu
    memory = graph_memory(session, graph_id)
    plan = partition(stored, k, strategy, node_ns=node_ns or None, memory=memory)
    plan.time_source = trace_id if node_ns else None
    return plan
