"""Kernel → FX node mapping: ``kernel_nodes`` rows from compile records, and GPU time per node.

# NOTE: [Kernel to node mapping]
Writing (:func:`link_kernels`): Inductor's provenance tracking (see
:mod:`graphdeck.capture.provenance`) gives, per compiled graph, an ordered table of kernel
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

import functools
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sqlalchemy import inspect, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule
from graphdeck.analysis.traces.comm_map import map_collectives
from graphdeck.analysis.traces.data import GPU_KERNEL_CATS, Ev, load_events
from graphdeck.analysis.traces.kernel_source_nodes import (
    OUTPUT_CODE_EVENT,
    STACK_MARK,
    STACKS_EVENT,
    TABLE_EVENTS,
    UNNAMED,
    compile_tables,
    resolve_marked,
)
from graphdeck.analysis.traces.links import link_gpu_events
from graphdeck.errors import NotFoundError, UsageError
from graphdeck.store.schema import CompileEvent, Graph, GraphIO, InternedString, KernelNode, Node, Trace

AOT_KINDS = ("aot_forward", "aot_backward", "aot_inference")
WRAPPER_PREFIX = "## Call CompiledFxGraph"
OPTIMIZER_PREFIX = "Optimizer.step#"  # torch.optim's profiler range: "Optimizer.step#AdamW.step"
OPTIMIZER_SOURCE = "optimizer step"
_REGION = re.compile(r"^Torch-Compiled Region: (\S+)")


def trace_call_name(provenance_name: str) -> str:
    """The profiler's name for a provenance kernel key (handle already removed).

    >>> [trace_call_name(k) for k in ("triton_poi_fused_add_0", "extern_kernels.mm",
    ...  "torch.ops.aten._scaled_dot_product_efficient_attention.default")]
    ['triton_poi_fused_add_0', 'aten::mm', 'aten::_scaled_dot_product_efficient_attention']
    """
    if provenance_name.startswith("extern_kernels."):
        return "aten::" + provenance_name[len("extern_kernels."):]
    if provenance_name.startswith("torch.ops.aten."):
        op = provenance_name[len("torch.ops.aten."):]
        return "aten::" + op.split(".", 1)[0]
    return provenance_name


def link_kernels(engine: Engine, run_id: int) -> dict[str, int]:
    """Write ``kernel_nodes`` rows (source ``inductor_provenance_v2``) for run ``run_id`` from its
    stored provenance records, replacing earlier rows of that source. Returns counts:
    ``tables``, ``tables_repeated`` (skipped), ``calls``, ``rows``, ``nodes_not_in_graph``."""
    stats: Counter = Counter()
    with Session(engine) as s:
        events = s.execute(
            select(CompileEvent.rank, CompileEvent.compile_id, CompileEvent.name, CompileEvent.payload)
            .where(CompileEvent.run_id == run_id, CompileEvent.name.in_((*TABLE_EVENTS, STACKS_EVENT, OUTPUT_CODE_EVENT)))
            .order_by(CompileEvent.id)
        ).all()
        graphs = s.execute(
            select(Graph.id, Graph.rank, Graph.compile_id, Graph.kind, Graph.parent_id).where(Graph.run_id == run_id)
        ).all()
        dataflow = s.execute(  # C++ calls the import linked on post-grad graphs, with their AOT parent
            select(KernelNode.rank, KernelNode.compile_id, KernelNode.kernel_name, KernelNode.call_index,
                   KernelNode.node_name, Graph.parent_id)
            .join(Graph, Graph.id == KernelNode.graph_id)
            .where(KernelNode.run_id == run_id, KernelNode.source == "inductor_outcode_dataflow",
                   Graph.parent_id.is_not(None)).order_by(KernelNode.id)).all()
        names_by_graph: dict[int, set[str]] = defaultdict(set)
        matmuls: dict[int, list[str]] = defaultdict(list)  # call_function mm/addmm/bmm nodes, graph order
        for gid, name, op, target in s.execute(
            select(Node.graph_id, Node.name, Node.op, InternedString.value)
            .join(Graph, Graph.id == Node.graph_id).join(InternedString, InternedString.id == Node.target_id)
            .where(Graph.run_id == run_id).order_by(Node.graph_id, Node.idx)
        ):
            names_by_graph[gid].add(name)
            if op == "call_function" and target.split(".")[:2] in (["aten", "mm"], ["aten", "addmm"], ["aten", "bmm"]):
                matmuls[gid].append(name)
    parsed = []
    for rank, cid, name, payload in events:
        if name == OUTPUT_CODE_EVENT:
            parsed.append(((rank, cid), name, {"code": payload or ""}))
            continue
        try:
            data = json.loads(payload or "{}")
        except ValueError:
            stats["tables_unreadable"] += 1
            continue
        if isinstance(data, dict):
            parsed.append(((rank, cid), name, data))
    by_key, post_to_pre = compile_tables(parsed, stats)
    stacks_of = _node_stacks(engine, run_id) if any(k == "stacks" or any(
        v and v[0].startswith(STACK_MARK) for v in t.values()) for ts in by_key.values() for t, k in ts) else {}
    # Inductor's live table grows over a process's compiles, so a later snapshot repeats earlier
    # kernels: those are skipped, per rank (ranks compile the same kernels, each its own).
    # Only the entries of an earlier snapshot this one contains whole are repeats: two graphs'
    # own tables can share an entry (DDP buckets: "aten._scaled_dot_product...:5" on the node of
    # the same name in each bucket), which each graph keeps.
    earlier: dict[int, list[set[tuple[str, tuple[str, ...]]]]] = defaultdict(list)
    assigned: set[int] = set()
    rows: list[dict] = []
    # NOTE: [Nodes a post-grad pass made]: an AOT graph's compile → the names of its post-grad graph
    post_grad: dict[int, set[str]] = defaultdict(set)
    for g in graphs:
        if g.kind == "inductor_post_grad" and g.parent_id is not None:
            post_grad[g.parent_id] |= names_by_graph[g.id]
    covered = _dataflow_rows(dataflow, graphs, names_by_graph, matmuls, run_id, rows, stats)
    for (rank, cid), tables in by_key.items():
        candidates = [g for g in graphs if g.rank == rank and g.compile_id == cid and g.kind in AOT_KINDS
                      and g.id not in covered]
        for table, kind in tables:
            stats["tables"] += 1
            items = {(kind, k, tuple(v)) for k, v in table.items()}
            repeated = set().union(*(e for e in earlier[rank] if e <= items))
            earlier[rank].append(items)
            fresh = [(k, tuple(v)) for k, v in table.items() if (kind, k, tuple(v)) not in repeated]
            if not fresh:
                stats["tables_repeated"] += 1
                continue
            if kind == "stacks":
                best, fresh = _by_stacks(fresh, candidates, stacks_of, assigned)
                stats["tables_by_stack_trace"] += 1
            else:  # C++ kernel calls by their stack traces (NOTE: [C++ kernels by output code])
                best = max(candidates, default=None, key=lambda g: (
                    sum(n in names_by_graph[g.id] for _, nodes in fresh for n in nodes)
                    + (resolve_marked(fresh, stacks_of.get(g.id, []))[1] if stacks_of else 0),
                    g.id not in assigned, g.kind == "aot_backward"))
                fresh = resolve_marked(fresh, stacks_of.get(best.id, []))[0] if best is not None else fresh
            if best is None:
                stats["tables_without_graph"] += 1
                continue
            assigned.add(best.id)
            known = names_by_graph[best.id]
            claimed = {n for _, nodes in fresh for n in nodes if n in known}
            spare = [n for n in matmuls[best.id] if n not in claimed]
            for key, nodes in fresh:
                base, _, handle = key.rpartition(":")
                if not base or not handle.isdigit():
                    base, handle = key, ""
                stats["calls"] += 1
                name = trace_call_name(base)
                for node in nodes:
                    source = {"stacks": "inductor_provenance_v2_stacks",
                              "output_code": "inductor_provenance_v2_outcode"}.get(kind, "inductor_provenance_v2")
                    pre = post_to_pre[(rank, cid)].get(node) or []
                    if node not in known:
                        stats["nodes_not_in_graph"] += 1
                        # NOTE: [Matmuls made by post-grad passes] Inductor's post-grad patterns
                        # replace a graph's mm/addmm with new nodes (mm_default_3, addmm_default)
                        # the AOT graph does not have; such an extern matmul call takes the next
                        # matmul node no other call claims, in graph order.
                        if name in ("aten::mm", "aten::addmm", "aten::bmm") and spare:
                            node, source = spare.pop(0), "inductor_provenance_v2_matmul"
                            stats["matmul_resolved"] += 1
                        elif _made_by_post_grad(node, best, candidates, post_grad):
                            stats["post_grad_made"] += 1  # kept, as the live capture names it
                        else:  # a name of another graph (a Dynamo or post-grad name): no link
                            continue
                    rows.append({"run_id": run_id, "rank": rank, "compile_id": cid, "graph_id": best.id,
                                 "kernel_name": name[:500], "node_name": node[:300],
                                 "pre_grad_node": (pre[0][:300] if pre else None), "source": source,
                                 "call_index": int(handle) if handle else None})
    with Session(engine) as s, s.begin():
        s.execute(KernelNode.__table__.delete().where(KernelNode.run_id == run_id,
                                                      KernelNode.source.like("inductor_provenance_v2%")))
        if rows:
            s.execute(KernelNode.__table__.insert(), rows)
    stats["rows"] = len(rows)
    return dict(stats)


def _made_by_post_grad(node: str, best, candidates, post_grad: dict[int, set[str]]) -> bool:
    """Whether ``node`` is a node a post-grad pass made in this compile (NOTE: [Nodes a post-grad
    pass made]): a node of the post-grad graph of ``best`` or of another AOT graph of the same
    kind in this compile (an imported log may hold the AOT graph twice); never ``(unnamed)``."""
    if node == UNNAMED:
        return False
    return any(node in post_grad[g.id] for g in candidates if g.kind == best.kind)


def _dataflow_rows(dataflow, graphs, names_by_graph, matmuls, run_id: int, rows: list, stats: Counter) -> set[int]:
    """Append to ``rows`` the C++ kernel links the import made on post-grad graphs by the wrapper's
    dataflow (source ``inductor_outcode_dataflow``; NOTE: [C++ kernels by wrapper dataflow]),
    carried to each post-grad graph's AOT parent: a node keeps its link where the AOT graph has a
    node of that name (post-grad passes keep names); an extern matmul call whose node a post-grad
    pattern made (``addmm_default``) takes the next matmul of the AOT graph no call claims. Rows
    are tagged ``inductor_provenance_v2_dataflow``. Returns the AOT graph ids covered (their
    compile's provenance tables are then not used)."""
    aot = {g.id for g in graphs if g.kind in AOT_KINDS}
    by_graph: dict[int, list] = defaultdict(list)
    for r in dataflow:
        if r.parent_id in aot:
            by_graph[r.parent_id].append(r)
    for gid, links in by_graph.items():
        known = names_by_graph[gid]
        claimed = {r.node_name for r in links if r.node_name in known}
        spare = [n for n in matmuls[gid] if n not in claimed]
        calls: dict[tuple, list] = defaultdict(list)
        for r in links:
            calls[(r.kernel_name, r.call_index)].append(r)
        for (kernel, call), rs in calls.items():
            names = [r.node_name for r in rs if r.node_name in known]
            if kernel in ("aten::mm", "aten::addmm", "aten::bmm") and not set(names) & set(matmuls[gid]) and spare:
                names.append(spare.pop(0))
            stats["calls"] += 1
            for n in names:
                rows.append({"run_id": run_id, "rank": rs[0].rank, "compile_id": rs[0].compile_id, "graph_id": gid,
                             "kernel_name": kernel, "node_name": n, "pre_grad_node": None,
                             "source": "inductor_provenance_v2_dataflow", "call_index": call})
    stats["graphs_by_dataflow"] += len(by_graph)
    return set(by_graph)


def _node_stacks(engine: Engine, run_id: int) -> dict[int, list[tuple[str, str, str]]]:
    """AOT graph id → ``(node name, stack_trace, target)`` of its call_function nodes, in graph order."""
    out: dict[int, list[tuple[str, str, str]]] = defaultdict(list)
    target = InternedString.__table__.alias("target")
    with Session(engine) as s:
        for gid, name, st, tgt in s.execute(
                select(Node.graph_id, Node.name, InternedString.value, target.c.value)
                .join(Graph, Graph.id == Node.graph_id).join(InternedString, InternedString.id == Node.stack_trace_id)
                .join(target, target.c.id == Node.target_id)
                .where(Graph.run_id == run_id, Graph.kind.in_(AOT_KINDS), Node.op == "call_function")
                .order_by(Node.graph_id, Node.idx)):
            out[gid].append((name, st, tgt))
    return out


def _same_op(key: str, nodes: tuple[str, ...]) -> tuple[str, ...]:
    """Of the nodes sharing an extern kernel's source lines, those of its own op: the call
    ``extern_kernels.mm:18`` / ``aten.randint.low_out:3`` computes the ``mm`` / ``randint`` nodes
    (FX names a call_function node after its op: ``mm``, ``mm_3``), not the ``permute`` / ``view``
    nodes written on the same line (a backward node carries its forward op's stack trace). Empty
    for a generated (fused) kernel, or when no node's name is the op's."""
    base = key.split(":", 1)[0]
    if not base.startswith(("extern_kernels.", "aten.")):
        return ()
    op = base.split(".")[1]
    pattern = re.compile(rf"{re.escape(op)}(_\d+)?")
    return tuple(n for n in nodes if pattern.fullmatch(n))


_INSTALL_PREFIX = re.compile(r'File "[^"]*?/(?:site|dist)-packages/')


@functools.lru_cache(maxsize=65536)
def _portable_stack(stack_trace: str) -> str:
    """A stack trace with each installed package's path cut to the package (``File
    ".../site-packages/transformers/x.py"`` → ``File "transformers/x.py"``): a warm FX graph cache
    filled by another installation of the same packages (another venv, another prefix) hands back
    stack traces with that installation's paths (NOTE: [Kernels by stack trace])."""
    return _INSTALL_PREFIX.sub('File "', stack_trace)


def _by_stacks(fresh: list[tuple[str, tuple[str, ...]]], candidates: list, stacks_of: dict[int, list[tuple]],
               assigned: set[int]):
    """A kernel-stack-traces table (``"name:handle" → [stack trace, ...]``) as node names of the
    candidate graph it fits best.

    # NOTE: [Kernels by stack trace]
    On an FX graph cache hit Inductor re-emits its cached artifacts but generates no kernel, so
    the live-table snapshot is empty, and a backward compiled lazily has an empty
    ``cppCodeToPost``; its ``..._kernel_stack_traces`` artifact still lists, per kernel call, the
    stack traces of the post-grad nodes it computes. A kernel then computes the call_function
    nodes of the graph whose ``stack_trace`` is among them (every node of those source lines:
    coarser than the node table, rows tagged ``inductor_provenance_v2_stacks``). A backward
    node carries its forward op's stack trace, so a backward graph is preferred to a forward one
    (its table came without a node table: the lazily compiled backward), then the graph
    (DDPOptimizer's bucket) without a table yet that resolves at least half the calls (buckets of
    identical blocks have the same source lines), then the one that resolves the most. Paths of
    installed packages are compared from the package on (:func:`_portable_stack`): the cache may
    have been filled by another installation of them."""
    def resolve(gid):
        nodes = [(n, _portable_stack(st)) for n, st, *_target in stacks_of.get(gid, [])]
        out = []
        for key, traces in fresh:
            want = {_portable_stack(t) for t in traces}
            found = tuple(n for n, st in nodes if st in want)
            out.append((key, _same_op(key, found) or found))
        return out

    def n_resolved(gid):
        return sum(1 for _, ns in resolve(gid) if ns)

    best = max(candidates, default=None,
               key=lambda g: (g.kind == "aot_backward", g.id not in assigned and n_resolved(g.id) * 2 >= len(fresh),
                              n_resolved(g.id)))
    return best, ([(k, ns) for k, ns in resolve(best.id) if ns] if best is not None else [])


# ---------------------------------------------------------------------------- reading


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
