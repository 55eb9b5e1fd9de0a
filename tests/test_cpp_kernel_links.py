"""Issue 40 item 3: kernels of a CPU Inductor (C++) TORCH_TRACE log are linked to graph nodes in
both directions. torch 2.13 logs an empty provenance mapping for the lazily compiled backward and
writes no source-node comment before a ``cpp_fused_*`` call; the call's debug handle, its
stack traces and the ops its name fuses name its nodes (NOTE: [C++ kernels by output code]).

Input: ``../shared/data/torch_trace/generated_torch2.13_cpu_gloo/ddp`` (2 ranks, DDP with 3
buckets, torch.compile inductor on CPU; SOURCES.md there).
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.mapping import link_kernels
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, KernelNode
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import shared_path

DDP = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "ddp")


def _links(engine, kinds):
    """graph name → kernel → node names (rank 0), for graphs of ``kinds``."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    with Session(engine) as s:
        for name, kernel, node in s.execute(
                select(Graph.name, KernelNode.kernel_name, KernelNode.node_name)
                .join(Graph, Graph.id == KernelNode.graph_id)
                .where(KernelNode.rank == 0, Graph.kind.in_(kinds))):
            out[name][kernel].add(node)
    return out


def test_cpp_backward_kernels_are_linked_on_import_and_by_link_kernels(tmp_path):
    engine = open_engine(tmp_path / "s.db")
    import_torch_trace(engine, shared_path(*DDP), run_name="ddp")
    post = _links(engine, ("inductor_post_grad",))
    bwd = {g: k for g, k in post.items() if "backward" in g}
    assert len(bwd) == 3, f"each DDP bucket's backward graph has kernel links: {sorted(post)}"
    for g, kernels in bwd.items():
        assert any(k.startswith("cpp_fused_") for k in kernels), (g, dict(kernels))
    # bucket 2 (head, aux): the loss-side kernel fuses aux.mean's backward and both bias grads
    b2 = bwd["graph 4/0 · DDP bucket 2 · backward · post-grad"]
    assert b2["cpp_fused_div_expand_sum_0"] == {"sum_1", "expand", "div", "sum_2", "sum_3"}, dict(b2)
    assert b2["cpp_fused_sum_1"] == {"sum_4"}, "blk2.bias's gradient sum (line 18), not aux's"
    fwd = {g: k for g, k in post.items() if "forward" in g}
    assert len(fwd) == 3 and all(any(k.startswith("cpp_fused_") for k in ks) for ks in fwd.values())

    # the trace-time linker (graphdeck ingest-trace runs it) covers the AOT backward graphs too
    stats = link_kernels(engine, 1)
    aot = _links(engine, ("aot_backward",))
    assert len(aot) == 3, (sorted(aot), stats)
    for g, kernels in aot.items():
        assert any(k.startswith("cpp_fused_") and nodes for k, nodes in kernels.items()), (g, dict(kernels))
    assert aot["graph 4/0 · DDP bucket 2 · backward"]["cpp_fused_div_expand_sum_0"] == \
        {"sum_1", "expand", "div", "sum_2", "sum_3"}


def test_every_linked_name_is_a_node_of_its_graph_and_each_mm_is_linked(tmp_path):
    """Issue 40 item 3 (newcomer report): on import and after link_kernels, no link names a node its
    graph lacks (``permute_3``, ``(unnamed)``, ``linear`` were linked into AOT backward graphs), and
    bucket 0's backward ``mm`` is linked to its own ``aten::mm`` call (was unlinked)."""
    from graphdeck.store.schema import Node

    engine = open_engine(tmp_path / "s.db")
    import_torch_trace(engine, shared_path(*DDP), run_name="ddp")
    link_kernels(engine, 1)
    with Session(engine) as s:
        rows = s.execute(select(Graph.name, KernelNode.kernel_name, KernelNode.call_index, KernelNode.node_name,
                                KernelNode.graph_id)
                         .join(Graph, Graph.id == KernelNode.graph_id)).all()
        names = defaultdict(set)
        for gid, n in s.execute(select(Node.graph_id, Node.name)):
            names[gid].add(n)
    missing = [(g, k, n) for g, k, _, n, gid in rows if n not in names[gid]]
    assert rows and not missing, missing
    for kind in (" · backward · post-grad", " · backward"):
        g = f"graph 4/0 · DDP bucket 0{kind}"
        mm = {(k, ci) for name, k, ci, n, _ in rows if name == g and n == "mm"}
        assert len(mm) == 1 and next(iter(mm))[0] == "aten::mm", (g, mm)
