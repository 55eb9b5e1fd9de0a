"""Writing the kernel → FX node links: ``kernel_nodes`` rows from a run's stored compile records
(the writing half of NOTE: [Kernel to node mapping] in :mod:`graphdeck.analysis.traces.mapping`,
which reads them back against a trace). Entry: :func:`link_kernels`, run at ingest."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter, defaultdict

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.kernel_source_nodes import (
    OUTPUT_CODE_EVENT,
    STACK_MARK,
    STACKS_EVENT,
    TABLE_EVENTS,
    UNNAMED,
    compile_tables,
    resolve_marked,
)
from graphdeck.store.schema import CompileEvent, Graph, InternedString, KernelNode, Node

AOT_KINDS = ("aot_forward", "aot_backward", "aot_inference")


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
