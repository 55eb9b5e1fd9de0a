"""Kernel → FX node mapping: ``kernel_nodes`` rows from compile records, and GPU time per node.

# NOTE: [Kernel to node mapping]
Writing (:func:`~graphdeck.analysis.traces.kernel_links.link_kernels`): Inductor's provenance
tracking (see :mod:`graphdeck.capture.provenance`) gives, per compiled graph, an ordered table of kernel
calls ``"name:handle" → [post-grad node, ...]``; handles increase in the order the generated
wrapper calls them. Each table is kept by the agent as a ``compile_events`` row
(``graphdeck_kernel_post_grad_nodes``, else the ``cppCodeToPost`` of
``inductor_provenance_tracking_node_mappings``). A table belongs to the AOT graph (forward,
backward or inference) of the same ``compile_id`` whose node names cover most of its nodes;
tables repeated by later compiles are skipped. One ``kernel_nodes`` row is written per (call,
node), with ``call_index`` = the handle. ``kernel_name`` is the name the profiler shows for the
call: the Triton/C++ kernel's own name, or ``aten::<op>`` for an extern call
(``extern_kernels.mm`` → ``aten::mm``, ``torch.ops.aten.X.default`` → ``aten::X``).

# NOTE: [Twin graphs]
Graphs of one structure (DDPOptimizer's buckets of identical blocks: same kind, structural hash
and node names) share Inductor's compiled code, so only the first gets a kernel table (the
others' records repeat it). The k-th wrapper call, in time order, that resolves to that table
runs the (k mod n)-th twin: in graph-id (compile) order for forward and inference graphs, in
reverse for backward graphs (the backward runs the buckets last to first).

Reading (:func:`map_trace`): every GPU kernel is linked to its launch and host ranges
(:mod:`graphdeck.analysis.traces.links`). Inductor's wrapper call shows as a host range
``## Call CompiledFxGraph <hash> ##``; its child range that encloses the launch is the *call*
(the Triton launch, named as the kernel, or ``aten::mm``...). Within one wrapper call the k-th
call named N is the k-th row group named N of the graph's table, in ``call_index`` order (for
rows without ``call_index``, in row order, one node per call). The table used for a wrapper call
is the one whose call names cover the most of that call's names, among the graphs of the
``Torch-Compiled Region: <compile_id>`` enclosing it when there is one (backward calls run on
the autograd thread, outside any region). A kernel's time is split evenly over the nodes of its
call (the remainder ns go to the first; an extern ``aten::`` call's time goes to its origin node,
listed first), so the per-node times add up to the mapped kernel time exactly. Communication
kernels outside any wrapper call (DDP's all-reduces, FSDP2's all-gathers and reduce-scatters)
go to the nodes of the parameters they carry (NOTE: [Collectives to graph nodes]). Other kernels
outside a wrapper call, or whose call is not in the table, are unmapped and counted as such.

# NOTE: [Optimizer step kernels]
An eager optimizer (fused or foreach AdamW: ``multi_tensor_apply_kernel<...FusedAdamMathFunctor>``,
~8% of a GPT-2 step on an H200) runs in no graph. ``torch.optim`` wraps each ``step()`` in a
profiler range ``Optimizer.step#<Class>.step``; a kernel launched inside it and outside any
wrapper call maps to that optimizer step as a whole (``KernelMapping.optimizer_ns``, source
``optimizer step``): it counts as mapped, on no node. A compiled optimizer step runs its graph's
wrapper call, so its kernels map to that graph's nodes as any other.
A trace without GPU kernels maps its CPU side instead: the ATen ops and C++ kernels run inside
compiled ranges (NOTE: [CPU trace mapping] in :mod:`graphdeck.analysis.traces.cpu_mapping`).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sqlalchemy import inspect, select, text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule
from graphdeck.analysis.traces.comm_map import map_collectives
from graphdeck.analysis.traces.data import GPU_KERNEL_CATS, Ev, load_events
# the writing half, re-exported: tests, the CLI and replay import these from here
from graphdeck.analysis.traces.kernel_links import (  # noqa: F401
    AOT_KINDS,
    _by_stacks,
    _portable_stack,
    link_kernels,
    trace_call_name,
)
from graphdeck.analysis.traces.links import link_gpu_events
from graphdeck.errors import NotFoundError, UsageError
from graphdeck.store.schema import Graph, GraphIO, KernelNode, Node, Trace

WRAPPER_PREFIX = "## Call CompiledFxGraph"
OPTIMIZER_PREFIX = "Optimizer.step#"  # torch.optim's profiler range: "Optimizer.step#AdamW.step"
OPTIMIZER_SOURCE = "optimizer step"
_REGION = re.compile(r"^Torch-Compiled Region: (\S+)")


@dataclass
class KernelMapping:
    """Which graph nodes each kernel of a trace computes.

    ``by_kernel``: GPU event id → ``(graph_id, [node names])``; ``node_ns``: ``(graph_id, node)``
    → ns of kernel time (split evenly over a call's nodes); ``kernel_ns`` / ``mapped_ns``: the
    trace's total and mapped kernel time (events of category ``kernel``); ``unmapped``: kernel
    name → ns for the kernels not mapped; ``sources``: row source → mapped kernels;
    ``comm_node_ns``: the part of ``node_ns`` that communication kernels gave (NOTE: [Collectives
    to graph nodes]), ``comm_param_ns`` the same time by parameter fqn, and ``comm_label`` GPU
    event id → what the collective carries (``all_reduce of DDP reducer bucket 3 (12 params)``).

    ``optimizer_ns``: optimizer step (``AdamW.step``) → ns of the kernels launched under it outside
    any compiled graph, ``optimizer_kernels`` GPU event id → that step (NOTE: [Optimizer step
    kernels]); counted in ``mapped_ns``, source ``optimizer step``, not in ``by_kernel``/``node_ns``.
    ``outside_unmapped``: kernel name → ns of the part of ``unmapped`` that ran outside every
    compiled graph by design (eager kernels outside a wrapper call, collectives no graph parameter
    explains; NOTE: [Trace coverage]).

    For a CPU trace (no GPU kernel; NOTE: [CPU trace mapping]) ``device`` is ``"cpu"``, the
    "kernels" are the ops and C++ kernels run inside compiled ranges (``cpu_units``, by start),
    ``kernel_ns`` their summed time (the compiled regions' CPU time), ``how`` says per mapped
    unit how it was matched, ``region_ns`` is the compiled ranges' wall time (``kernel_ns`` too) and
    ``directions`` gives ``{"forward"|"backward": {"region_ns", "units_ns", "mapped_units_ns",
    "mapped_ns", "prologue_ns", "dispatch_ns", "epilogue_ns", "wrapper_ops_ns", "units",
    "mapped"}}``; ``overhead_ns`` is the part of ``node_ns`` that is no op of the node's own (the
    dispatch / wrapper code before it, a range's epilogue on its output node; NOTE: [Overhead] in
    cpu_mapping.py).
    """

    trace_id: int
    by_kernel: dict[int, tuple[int, list[str]]] = field(default_factory=dict)
    node_ns: dict[tuple[int, str], int] = field(default_factory=dict)
    kernel_ns: int = 0
    mapped_ns: int = 0
    unmapped: dict[str, int] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    comm_node_ns: dict[tuple[int, str], int] = field(default_factory=dict)
    comm_param_ns: dict[str, int] = field(default_factory=dict)
    comm_label: dict[int, str] = field(default_factory=dict)
    device: str = "gpu"
    cpu_units: list = field(default_factory=list)
    how: dict[int, str] = field(default_factory=dict)
    region_ns: int = 0
    directions: dict[str, dict[str, int]] = field(default_factory=dict)
    optimizer_ns: dict[str, int] = field(default_factory=dict)
    optimizer_kernels: dict[int, str] = field(default_factory=dict)
    overhead_ns: dict[tuple[int, str], int] = field(default_factory=dict)
    outside_unmapped: dict[str, int] = field(default_factory=dict)

    @property
    def mapped_fraction(self) -> float | None:
        """``mapped_ns / kernel_ns``: nodes, optimizer steps and (CPU) the labelled overhead over
        the whole kernel time (GPU) or the compiled ranges' wall time (CPU). Not the coverage of
        compiled graphs: that is :attr:`coverage` (NOTE: [Trace coverage])."""
        return self.mapped_ns / self.kernel_ns if self.kernel_ns else None

    @property
    def coverage(self):
        """The :class:`graphdeck.analysis.traces.coverage.Coverage` of this mapping (no CPU
        time outside compiled regions: :func:`~graphdeck.analysis.traces.coverage.coverage` with
        the events gives that too)."""
        from graphdeck.analysis.traces.coverage import coverage

        return coverage(self)


def _tables(session: Session, run_id: int, rank: int) -> dict[int, dict]:
    """graph_id → {"compile_id", "calls": {call name: [(nodes, source), ...] in call order}}."""
    has_index = "call_index" in {c["name"] for c in inspect(session.connection()).get_columns("kernel_nodes")}
    cols = "k.graph_id, g.compile_id, k.kernel_name, k.node_name, k.source, " + ("k.call_index" if has_index else "NULL")
    sql = text(f"SELECT {cols} FROM kernel_nodes k JOIN graphs g ON g.id = k.graph_id "
               "WHERE k.run_id = :run AND k.rank = :rank ORDER BY k.graph_id, k.id")
    grouped: dict[int, dict] = {}
    for gid, cid, kname, node, source, idx in session.execute(sql, {"run": run_id, "rank": rank}):
        t = grouped.setdefault(gid, {"compile_id": cid, "raw": defaultdict(list)})
        t["raw"][kname].append((idx, node, source))
    for t in grouped.values():
        calls: dict[str, list[tuple[list[str], str]]] = {}
        for kname, items in t.pop("raw").items():
            if all(i is not None for i, _, _ in items):
                by_idx: dict[int, list] = {}
                for idx, node, source in items:
                    by_idx.setdefault(idx, [[], source])[0].append(node)
                calls[kname] = [tuple(by_idx[i]) for i in sorted(by_idx)]
            else:
                calls[kname] = [([node], source) for _, node, source in items]
        t["calls"] = calls
    return grouped


def _twins(session: Session, run_id: int, rank: int, with_table: set[int]) -> dict[int, list[int]]:
    """Graph with a kernel table → its twins in execution order, itself included (NOTE: [Twin
    graphs]); only graphs that have twins appear."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for gid, kind, h in session.execute(select(Graph.id, Graph.kind, Graph.structural_hash).where(
            Graph.run_id == run_id, Graph.rank == rank, Graph.kind.in_(AOT_KINDS), Graph.structural_hash.is_not(None))):
        groups[(kind, h)].append(gid)
    out: dict[int, list[int]] = {}
    for (kind, _h), ids in groups.items():
        reps = [g for g in ids if g in with_table]
        if len(ids) < 2 or len(reps) != 1:
            continue
        names = {g: set(session.scalars(select(Node.name).where(Node.graph_id == g))) for g in ids}
        ring = sorted(g for g in ids if names[g] == names[reps[0]])
        if len(ring) > 1:
            out[reps[0]] = ring[::-1] if kind == "aot_backward" else ring
    return out


def _pre_grad_names(session: Session, graph: Graph, children: set[int]) -> dict[tuple[int, str], str]:
    """(AOT child graph id, node) → the node of ``graph`` it came from (``kernel_nodes.pre_grad_node``).
    A twin child (NOTE: [Twin graphs]) has no rows of its own: its twin's rows are used, and each
    pre-grad node is carried over to the node at the same position of ``graph`` (twins' parent
    graphs have one structure but names of their own, e.g. the block index)."""
    def rows(ids):
        return session.execute(select(KernelNode.graph_id, KernelNode.node_name, KernelNode.pre_grad_node)
                               .where(KernelNode.graph_id.in_(ids), KernelNode.pre_grad_node.is_not(None))).all()

    pre = {(g, n): p for g, n, p in rows(children)}
    missing = children - {g for g, _ in pre}
    if not missing:
        return pre
    with_rows = set(session.scalars(select(KernelNode.graph_id).where(
        KernelNode.run_id == graph.run_id, KernelNode.rank == graph.rank).distinct()))
    rep_of = {t: rep for rep, ring in _twins(session, graph.run_id, graph.rank, with_rows).items()
              for t in ring if t != rep and t in missing}
    if not rep_of:
        return pre
    mine = dict(session.execute(select(Node.idx, Node.name).where(Node.graph_id == graph.id)).all())
    for child, rep in rep_of.items():
        rep_parent = session.scalar(select(Graph.parent_id).where(Graph.id == rep))
        idx_of = {name: idx for idx, name in session.execute(select(Node.idx, Node.name).where(Node.graph_id == rep_parent))}
        for _g, node, p in rows([rep]):
            if p in idx_of and idx_of[p] in mine:
                pre[(child, node)] = mine[idx_of[p]]
    return pre


def map_trace(session: Session, trace_id: int, events: list[Ev] | None = None) -> KernelMapping:
    """Map the kernels of trace ``trace_id`` to graph nodes (NOTE: [Kernel to node mapping]).

    Raises NotFoundError when the trace does not exist."""
    trace = session.get(Trace, trace_id)
    if trace is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    events = events if events is not None else load_events(session, trace_id, with_args=False)
    tables = _tables(session, trace.run_id, trace.rank)
    out = KernelMapping(trace_id)
    wrappers: dict[int, list[tuple[Ev, Ev | None]]] = defaultdict(list)  # wrapper id -> (kernel, call)
    wrapper_ev: dict[int, tuple[Ev, str | None]] = {}
    unmapped: Counter = Counter()
    sources: Counter = Counter()
    comm, comm_kernels = CommRule(), []
    for link in link_gpu_events(events).values():
        k = link.gpu
        if k.cat not in GPU_KERNEL_CATS:
            continue
        out.kernel_ns += k.dur
        chain = link.chain
        at = next((i for i in range(len(chain) - 1, -1, -1) if chain[i].name.startswith(WRAPPER_PREFIX)), None)
        if at is None or not tables:
            if comm.is_comm(k.name):
                comm_kernels.append(k)
            elif at is not None:  # a compiled graph's kernel, but no kernel table for the rank
                unmapped[k.name] += k.dur
            elif (step := next((e.name for e in chain if e.name.startswith(OPTIMIZER_PREFIX)), None)) is not None:
                label = step[len(OPTIMIZER_PREFIX):] or step  # NOTE: [Optimizer step kernels]
                out.optimizer_kernels[k.id] = label
                out.optimizer_ns[label] = out.optimizer_ns.get(label, 0) + k.dur
                out.mapped_ns += k.dur
                sources[OPTIMIZER_SOURCE] += 1
            else:  # eager, outside every compiled graph (NOTE: [Trace coverage])
                unmapped[k.name] += k.dur
                out.outside_unmapped[k.name] = out.outside_unmapped.get(k.name, 0) + k.dur
            continue
        region = next((m.group(1) for e in reversed(chain[:at]) if (m := _REGION.match(e.name))), None)
        wrapper_ev[chain[at].id] = (chain[at], region)
        wrappers[chain[at].id].append((k, chain[at + 1] if at + 1 < len(chain) else None))
    _map_wrappers(session, trace, tables, wrappers, wrapper_ev, out, unmapped, sources)
    if not out.kernel_ns and not comm_kernels:  # a CPU trace (NOTE: [CPU trace mapping])
        from graphdeck.analysis.traces.cpu_mapping import map_cpu_trace

        out.device = "cpu"  # no GPU kernel, even when no compiled region either (nothing compiled)

        map_cpu_trace(session, trace, events, tables, out, unmapped, sources)
    _map_comm(session, trace, comm_kernels, out, unmapped, sources)
    out.unmapped = dict(unmapped.most_common())
    out.sources = dict(sources)
    return out


def wrapper_kernel_nodes(session: Session, trace: Trace, tables: dict[int, dict],
                         wrappers: dict[int, list[tuple[Ev, Ev | None]]], wrapper_ev: dict[int, tuple[Ev, str | None]]):
    """Yield ``(kernel, graph_id, (nodes, row source) or None)`` for the kernels of each wrapper
    call (``wrapper id → [(kernel, call)]``) in wrapper order, through the kernel tables (NOTE:
    [Kernel to node mapping]): the graph whose table fits the wrapper's calls best (kept per
    (region, call names), which repeat every step), the turn among twin graphs, the k-th call of
    a name → the k-th node group; an extern ``aten::`` call computes its origin node (listed
    first). Shared by :func:`_map_wrappers` and export's kernel links."""
    twins = _twins(session, trace.run_id, trace.rank, set(tables)) if wrappers else {}
    turns: Counter = Counter()
    chosen: dict[tuple, int] = {}
    for wid, items in sorted(wrappers.items(), key=lambda kv: (wrapper_ev[kv[0]][0].ts, kv[0])):
        _, region = wrapper_ev[wid]
        calls: dict[int, Ev] = {}
        for _, call in items:
            if call is not None:
                calls.setdefault(call.id, call)
        ordered = sorted(calls.values(), key=lambda e: (e.ts, e.id))
        names = Counter(c.name for c in ordered)
        memo = (region, *sorted(names.items()))
        gid = chosen.get(memo)
        if gid is None:
            pool = {g: t for g, t in tables.items() if region is None or t["compile_id"] == region} or tables
            gid = chosen[memo] = max(sorted(pool), key=lambda g: sum(min(n, len(pool[g]["calls"].get(name, ())))
                                                                     for name, n in names.items()))
        table = tables[gid]["calls"]
        if gid in twins:  # NOTE: [Twin graphs]: the k-th call of the shared code runs the k-th twin
            ring, rep = twins[gid], gid
            gid = ring[turns[rep] % len(ring)]
            turns[rep] += 1
        seen: Counter = Counter()
        call_nodes: dict[int, tuple[list[str], str] | None] = {}
        for c in ordered:
            group = table.get(c.name)
            i = seen[c.name]
            seen[c.name] += 1
            call_nodes[c.id] = group[i] if group and i < len(group) else None
        for k, call in items:
            got = call_nodes.get(call.id) if call is not None else None
            if got and call.name.startswith("aten::"):
                got = (got[0][:1], got[1])
            yield k, gid, got


def _map_wrappers(session: Session, trace: Trace, tables: dict[int, dict], wrappers: dict[int, list[tuple[Ev, Ev | None]]],
                  wrapper_ev: dict[int, tuple[Ev, str | None]], out: KernelMapping, unmapped: Counter,
                  sources: Counter, how: dict[int, str] | None = None) -> None:
    """Map the kernels of each wrapper call (``wrapper id → [(kernel, call)]``) through the kernel
    tables (:func:`wrapper_kernel_nodes`); GPU kernels and CPU units alike. ``how``, when given,
    gets each mapped kernel's row source."""
    for k, gid, got in wrapper_kernel_nodes(session, trace, tables, wrappers, wrapper_ev):
        if not got:
            unmapped[k.name] += k.dur
            continue
        nodes, source = got
        out.by_kernel[k.id] = (gid, list(nodes))
        out.mapped_ns += k.dur
        sources[source] += 1
        if how is not None:
            how[k.id] = source
        share, rest = divmod(k.dur, len(nodes))
        for j, node in enumerate(nodes):
            key = (gid, node)
            out.node_ns[key] = out.node_ns.get(key, 0) + share + (rest if j == 0 else 0)


def _map_comm(session: Session, trace: Trace, kernels: list[Ev], out: KernelMapping, unmapped: Counter,
              sources: Counter) -> None:
    """Communication kernels onto the nodes of the parameters they carry (NOTE: [Collectives to
    graph nodes]); a kernel's share for parameters no graph node holds stays unmapped."""
    matched = map_collectives(session, trace.run_id, trace.rank, kernels) if kernels else {}
    for k in kernels:
        got = matched.get(k.id)
        if got is None:
            unmapped[k.name] += k.dur
            out.outside_unmapped[k.name] = out.outside_unmapped.get(k.name, 0) + k.dur
            continue
        source, weighted, spare, label = got
        out.comm_label[k.id] = label
        total = sum(w for _, _, w, _ in weighted) + spare
        shares = [k.dur * w // total for _, _, w, _ in weighted]
        mapped = k.dur * (total - spare) // total
        shares[0] += mapped - sum(shares)
        by_graph: Counter = Counter()
        for (gid, node, _, fqn), ns in zip(weighted, shares):
            out.node_ns[(gid, node)] = out.node_ns.get((gid, node), 0) + ns
            out.comm_node_ns[(gid, node)] = out.comm_node_ns.get((gid, node), 0) + ns
            out.comm_param_ns[fqn] = out.comm_param_ns.get(fqn, 0) + ns
            by_graph[gid] += ns
        gid = by_graph.most_common(1)[0][0]
        out.by_kernel[k.id] = (gid, [node for g, node, _, _ in weighted if g == gid])
        out.mapped_ns += mapped
        if mapped < k.dur:
            unmapped[k.name] += k.dur - mapped
            out.outside_unmapped[k.name] = out.outside_unmapped.get(k.name, 0) + k.dur - mapped
        sources[source] += 1


def node_time_ns(session: Session, graph_id: int, trace_id: int | None = None, *,
                 part: str = "compute") -> dict[str, int]:
    """GPU kernel time (ns) per FX node name of graph ``graph_id``, summed over the trace.

    ``part``: ``compute`` (default) counts the kernels the graph computes; ``comm`` the
    communication kernels that carry the node's parameter or gradient (NOTE: [Collectives to graph
    nodes]; on a ``dynamo`` graph, onto the placeholders of those parameters); ``all`` both.
    ``trace_id`` defaults to the newest trace of the graph's run and rank with status ``ok`` or
    ``truncated``. For a ``dynamo`` graph (or a DDP bucket's ``ddp_partition`` graph) the compute
    times of its AOT graphs' nodes are summed onto their pre-grad nodes
    (``kernel_nodes.pre_grad_node``; in a CPU trace without them, by source line: NOTE: [Pre-grad
    nodes by source line], also through the buckets of a graph DDPOptimizer split).
    Nodes without kernel time are
    absent; an empty dict when no trace or no mapping exists.

    Raises:
        NotFoundError: unknown graph.
        UsageError: ``part`` is not one of ``compute``, ``comm``, ``all``.
    """
    if part not in ("compute", "comm", "all"):
        raise UsageError(f"part must be compute, comm or all, not {part!r}")
    graph = session.get(Graph, graph_id)
    if graph is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    if trace_id is None:
        trace_id = session.scalar(
            select(Trace.id).where(Trace.run_id == graph.run_id, Trace.rank == graph.rank,
                                   Trace.status.in_(("ok", "truncated"))).order_by(Trace.id.desc()).limit(1))
        if trace_id is None:
            return {}
    mapping = map_trace(session, trace_id)
    comm = mapping.comm_node_ns
    compute = {key: ns - comm.get(key, 0) for key, ns in mapping.node_ns.items() if ns > comm.get(key, 0)}
    if graph.kind in AOT_KINDS:
        times = {"all": mapping.node_ns, "comm": comm, "compute": compute}[part]
        return {node: ns for (gid, node), ns in sorted(times.items()) if gid == graph_id}
    out: dict[str, int] = {}
    if part != "compute" and mapping.comm_param_ns:
        for node, fqn in session.execute(select(GraphIO.node_name, GraphIO.param_fqn).where(
                GraphIO.graph_id == graph_id, GraphIO.direction == "in", GraphIO.param_fqn.is_not(None))):
            if mapping.comm_param_ns.get(fqn):
                out[node] = out.get(node, 0) + mapping.comm_param_ns[fqn]
    if part == "comm":
        return dict(sorted(out.items()))
    children = set(session.scalars(select(Graph.id).where(Graph.parent_id == graph_id)))
    pre = _pre_grad_names(session, graph, children)
    by_line = {}
    if mapping.device == "cpu":  # the AOT graphs of the buckets of a graph DDPOptimizer split count too
        children |= set(session.scalars(select(Graph.id).where(Graph.parent_id.in_(
            select(Graph.id).where(Graph.parent_id == graph_id, Graph.kind == "ddp_partition")))))
        by_line = _pre_grad_by_line(session, graph_id, children - {g for g, _ in pre})
    for (gid, node), ns in compute.items():  # communication is on the placeholders (above)
        if gid not in children:
            continue
        p = pre.get((gid, node))
        if p:
            out[p] = out.get(p, 0) + ns
        elif (gid, node) in by_line:  # NOTE: [Pre-grad nodes by source line]
            targets = by_line[(gid, node)]
            share, rest = divmod(ns, len(targets))
            for j, t in enumerate(targets):
                out[t] = out.get(t, 0) + share + (rest if j == 0 else 0)
    return dict(sorted(out.items()))


def _pre_grad_by_line(session: Session, graph_id: int, children: set[int]) -> dict[tuple[int, str], list[str]]:
    """(AOT child graph id, node) → the nodes of graph ``graph_id`` with the same ``stack_trace``
    (and module path, when that narrows it), for children without provenance rows.

    # NOTE: [Pre-grad nodes by source line]
    ``aot_eager`` leaves no Inductor provenance (``kernel_nodes.pre_grad_node``); AOT tracing
    copies each Dynamo node's ``stack_trace`` (and ``nn_module_stack``) to the ATen nodes it
    decomposes into, and a backward node carries its forward op's. So an AOT node's time goes
    to the Dynamo nodes of its source line, split evenly when a line made several nodes."""
    if not children:
        return {}
    mine: dict[int, list[tuple[str, int | None]]] = defaultdict(list)
    for name, st, mp in session.execute(select(Node.name, Node.stack_trace_id, Node.module_path_id).where(
            Node.graph_id == graph_id, Node.op == "call_function", Node.stack_trace_id.is_not(None))):
        mine[st].append((name, mp))
    out: dict[tuple[int, str], list[str]] = {}
    for gid, name, st, mp in session.execute(select(Node.graph_id, Node.name, Node.stack_trace_id, Node.module_path_id)
                                             .where(Node.graph_id.in_(children), Node.op == "call_function")):
        cands = mine.get(st)
        if cands:
            narrowed = [n for n, m in cands if m == mp] or [n for n, _ in cands]
            out[(gid, name)] = narrowed
    return out
