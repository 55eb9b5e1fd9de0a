"""``render_graph_svg`` is pure and safe: views built here in code, SVG parsed as XML.

The SVG is checked through an XML parser (what a browser's DOMParser sees), not by substring:
Graphviz writes ``id="node&#45;3"``, which the DOM reads as ``node-3``.
"""

from __future__ import annotations

import random
import time
import xml.etree.ElementTree as ET

import pytest

from graphdeck.server.render import svg as svg_mod
from graphdeck.server.render.svg import CATEGORY_COLORS, render_graph_svg, tensor_label
from graphdeck.server.views import GraphView, ViewEdge, ViewNode, node_label, op_category, short_target

SVG = "{http://www.w3.org/2000/svg}"
XLINK_TITLE = "{http://www.w3.org/1999/xlink}title"
EVIL = "<script>alert(1)</script>"
QUOTES = "a&b\"c'd"


def node(idx: int, name: str, op: str = "call_function", target: str = "aten.relu.default", **kw) -> ViewNode:
    return ViewNode(id=name, idx=idx, label=node_label(op, target), op=op, target=target,
                    category=op_category(op, target), **kw)


def tiny_view() -> GraphView:
    """x, w → linear.mm → relu → output, inside module paths ``block/linear`` and ``block``."""
    nodes = [
        node(0, "x", "placeholder", "x", shape=[8, 32], dtype="torch.float32"),
        node(1, "w", "placeholder", "w", shape=[32, 64], dtype="torch.float32", param_fqn="block.linear.weight"),
        node(2, "mm", target="aten.mm.default", namespace="block/linear", shape=[8, 64], dtype="torch.float32"),
        node(3, "relu", namespace="block", shape=[8, 64], dtype="torch.float32"),
        node(4, "output", "output", "output"),
    ]
    edges = [ViewEdge(src="x", dst="mm"), ViewEdge(src="w", dst="mm", arg_pos=1),
             ViewEdge(src="mm", dst="relu"), ViewEdge(src="relu", dst="output")]
    return GraphView(graph_id=1, name="tiny", kind="dynamo", nodes=nodes, edges=edges)


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode("utf-8"))


def groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if cls in (g.get("class") or "").split()]


def texts(g: ET.Element) -> list[str]:
    return [t.text or "" for t in g.iter(f"{SVG}text")]


def fill(g: ET.Element) -> str | None:
    """The fill of a node's first filled shape."""
    return next((el.get("fill") for el in g.iter() if el.get("fill") not in (None, "none")), None)


def tooltip(g: ET.Element) -> str | None:
    a = next(g.iter(f"{SVG}a"), None)
    return None if a is None else a.get(XLINK_TITLE)


def test_nodes_carry_idx_ids_tooltips_labels_and_categories():
    root = parse(render_graph_svg(tiny_view()))
    nodes = {g.get("id"): g for g in groups(root, "node")}
    assert set(nodes) == {f"node-{i}" for i in range(5)}, "one <g id='node-<idx>'> per node, nothing else"
    assert tooltip(nodes["node-2"]) == "mm", "the FX node name is the tooltip"
    assert texts(nodes["node-2"]) == ["mm", "f32[8, 64]"], "label: short target name, then dtype and shape"
    assert texts(nodes["node-1"]) == ["block.linear.weight", "f32[32, 64]"], "a parameter placeholder shows its parameter"
    assert tooltip(nodes["node-1"]) == "w"
    assert "cat-matmul" in nodes["node-2"].get("class") and "cat-placeholder" in nodes["node-0"].get("class")
    assert fill(nodes["node-2"]) == CATEGORY_COLORS["matmul"] and fill(nodes["node-3"]) == CATEGORY_COLORS["elementwise"]
    assert len(groups(root, "edge")) == 4 and {g.get("id") for g in groups(root, "edge")} == {f"edge-{k}" for k in range(4)}


def test_root_fills_its_box_and_keeps_the_viewbox():
    root = parse(render_graph_svg(tiny_view()))
    assert (root.get("width"), root.get("height")) == ("100%", "100%"), "the frontend pans/zooms with the viewBox"
    assert len(root.get("viewBox").split()) == 4


def test_clusters_nest_by_module_path_and_max_depth_limits_them():
    def cluster_labels(svg: str) -> list[tuple[str, str]]:
        return sorted((texts(g)[0], tooltip(g)) for g in groups(parse(svg), "cluster"))

    view = tiny_view()
    assert cluster_labels(render_graph_svg(view)) == [("block", "block"), ("linear", "block/linear")], \
        "one cluster per module-path prefix, labelled with its last part, full path as tooltip"
    assert cluster_labels(render_graph_svg(view, max_depth=1)) == [("block", "block")]
    assert cluster_labels(render_graph_svg(view, max_depth=0)) == []
    with pytest.raises(ValueError):
        render_graph_svg(view, max_depth=-1)


def test_same_view_same_bytes_whatever_the_input_order():
    view = tiny_view()
    shuffled = view.model_copy(deep=True)
    rng = random.Random(0)
    rng.shuffle(shuffled.nodes)
    rng.shuffle(shuffled.edges)
    first = render_graph_svg(view)
    assert render_graph_svg(view) == first
    assert render_graph_svg(shuffled) == first, "nodes, clusters and edges are emitted in sorted order"


def test_user_text_is_escaped_and_cannot_break_the_dot():
    nasty = [EVIL, QUOTES, "{a|b}<c>", "back\\slash\\N\\l", 'ends with \\', "ctl\x00\x07char", "new\nline"]
    nodes = [node(0, EVIL, "placeholder", EVIL, param_fqn=QUOTES)]
    for i, text in enumerate(nasty, start=1):
        nodes.append(node(i, text, "call_function", text, namespace=f"{EVIL}/{QUOTES}/{{x|y}}"))
    nodes.append(node(len(nodes), "output", "output", "output"))
    edges = [ViewEdge(src=nodes[i].id, dst=nodes[i + 1].id) for i in range(len(nodes) - 1)]
    view = GraphView(graph_id=9, name=EVIL, kind="dynamo", nodes=nodes, edges=edges)

    svg = render_graph_svg(view)
    assert "<script" not in svg and "alert(1)</script>" not in svg, "markup from user code is escaped"
    root = parse(svg)  # well-formed XML: no raw '&', quotes or control characters leaked
    assert not list(root.iter(f"{SVG}script")) and not list(root.iter("script"))
    drawn = {g.get("id"): g for g in groups(root, "node")}
    assert len(drawn) == len(nodes), "every node survives: '{|}<>' did not turn into record/HTML syntax"
    assert tooltip(drawn["node-0"]) == EVIL and texts(drawn["node-0"]) == [QUOTES], \
        "the text reads back exactly once the XML is decoded"
    assert texts(drawn["node-1"]) == [EVIL]
    assert tooltip(drawn["node-2"]) == QUOTES
    assert texts(drawn["node-3"])[0] == "{a|b}<c>"
    assert texts(drawn["node-4"])[0] == "back\\slash\\N\\l", "backslash escapes (\\N, \\l) are not interpreted"
    assert texts(drawn["node-6"])[0] == "ctlchar", "control characters are dropped (XML 1.0 forbids them)"
    clusters = sorted(texts(g)[0] for g in groups(root, "cluster"))
    assert EVIL.split("/")[0] in clusters and QUOTES in clusters and "{x|y}" in clusters


def test_long_user_text_is_truncated_with_its_length():
    long_name = "m" * 500
    view = GraphView(graph_id=1, name="g", kind="dynamo", edges=[],
                     nodes=[node(0, long_name, "call_function", f"aten.{long_name}.default")])
    (g,) = groups(parse(render_graph_svg(view)), "node")
    assert texts(g)[0].endswith("…[total_len=500]") and len(texts(g)[0]) < 80


def test_long_edges_become_stubs_in_the_drawing_but_stay_in_the_view():
    """x feeds a 40-op chain and the output: the x → output edge spans ~40 ranks."""
    chain = [node(0, "x", "placeholder", "x")] + [node(i, f"r{i}") for i in range(1, 41)]
    chain.append(node(41, "output", "output", "output"))
    edges = [ViewEdge(src=chain[i].id, dst=chain[i + 1].id) for i in range(41)]
    edges.append(ViewEdge(src="x", dst="output", arg_pos=1))
    root = parse(render_graph_svg(GraphView(graph_id=1, name="g", kind="aot_forward", nodes=chain, edges=edges)))
    ids = {g.get("id") for g in groups(root, "node")}
    assert {"stub-in-41", "stub-out-0"} <= ids, "the cut edge's ends are named by stubs"
    stub = next(g for g in groups(root, "stub") if g.get("id") == "stub-in-41")
    assert tooltip(stub) == "x" and texts(stub) == ["\u2191 x"]
    assert len([g for g in groups(root, "edge") if (g.get("id") or "").startswith("edge-")]) == 41


def test_large_graph_is_collapsed_and_bounded(monkeypatch):
    view = tiny_view()
    monkeypatch.setattr(svg_mod, "LARGE_GRAPH_NODES", 3)
    root = parse(render_graph_svg(view))
    drawn = {g.get("id"): g for g in groups(root, "node")}
    assert "node-1" not in drawn, "a parameter placeholder is folded into its consumer"
    assert texts(drawn["node-2"])[-1] == "+1 params" and "w" in tooltip(drawn["node-2"])

    monkeypatch.setattr(svg_mod, "MAX_RENDER_NODES", 2)
    note = parse(render_graph_svg(view))
    assert "graph" in note.get("class", "") or groups(note, "note"), "too large: a note, not a layout"
    assert "too many" in "".join(note.itertext()) and "/api/graphs/1/view" in "".join(note.itertext())


def test_layout_past_its_budget_returns_a_note_not_a_hang():
    view = synthetic_layers(40)
    start = time.monotonic()
    root = parse(render_graph_svg(view, timeout_s=0.01))
    assert time.monotonic() - start < 5, "dot is killed at the timeout"
    assert "took longer than" in "".join(root.itertext())


def synthetic_layers(n_layers: int) -> GraphView:
    """A transformer-like stack: per layer a weight placeholder, mm, add (residual), relu, sum."""
    nodes = [node(0, "x", "placeholder", "x", shape=[8, 64], dtype="torch.float32")]
    edges: list[ViewEdge] = []
    prev = "x"
    for layer in range(n_layers):
        ns = f"layers/{layer}/mlp"
        base = len(nodes)
        names = [f"w{layer}", f"mm{layer}", f"add{layer}", f"relu{layer}", f"sum{layer}"]
        nodes += [
            node(base, names[0], "placeholder", names[0], param_fqn=f"layers.{layer}.mlp.weight"),
            node(base + 1, names[1], target="aten.mm.default", namespace=ns, shape=[8, 64], dtype="torch.float32"),
            node(base + 2, names[2], target="aten.add.Tensor", namespace=f"layers/{layer}", shape=[8, 64]),
            node(base + 3, names[3], target="aten.relu.default", namespace=ns, shape=[8, 64]),
            node(base + 4, names[4], target="aten.sum.default", namespace=ns, shape=[]),
        ]
        edges += [ViewEdge(src=prev, dst=names[1]), ViewEdge(src=names[0], dst=names[1], arg_pos=1),
                  ViewEdge(src=names[1], dst=names[3]), ViewEdge(src=names[3], dst=names[2]),
                  ViewEdge(src=prev, dst=names[2], arg_pos=1), ViewEdge(src=names[2], dst=names[4])]
        prev = names[2]
    out = node(len(nodes), "output", "output", "output")
    edges += [ViewEdge(src=f"sum{layer}", dst="output", arg_pos=layer) for layer in range(n_layers)]
    return GraphView(graph_id=1, name="layers", kind="aot_forward", nodes=nodes + [out], edges=edges)


def test_a_graph_over_the_large_threshold_renders_in_seconds():
    view = synthetic_layers(620)  # 3,102 nodes; 620 saved values into one output node
    assert len(view.nodes) > svg_mod.LARGE_GRAPH_NODES
    start = time.monotonic()
    root = parse(render_graph_svg(view, timeout_s=60))
    took_s = time.monotonic() - start
    assert len(groups(root, "node")) > 2000 and took_s < 30, f"{took_s:.1f} s"


@pytest.mark.parametrize(("target", "short"), [
    ("aten.mm.default", "mm"), ("torch.ops.aten.add.Tensor", "add"), ("torch._C._nn.linear", "linear"),
    ("<built-in function getitem>", "getitem"), ("_operator.getitem", "getitem"),
    ("_c10d_functional.all_reduce.default", "all_reduce"), ("view", "view"),
])
def test_short_target(target, short):
    assert short_target(target) == short


@pytest.mark.parametrize(("target", "category"), [
    ("aten.addmm.default", "matmul"), ("aten.convolution_backward.default", "matmul"),
    ("aten.relu.default", "elementwise"), ("aten.threshold_backward.default", "elementwise"),
    ("aten.add_.Tensor", "elementwise"), ("aten.sum.dim_IntList", "reduction"),
    ("aten._softmax.default", "reduction"), ("aten.native_layer_norm_backward.default", "reduction"),
    ("aten.view.default", "view"), ("aten._unsafe_view.default", "view"), ("_operator.getitem", "view"),
    ("_c10d_functional.all_reduce.default", "collective"), ("_c10d_functional.wait_tensor.default", "collective"),
    ("aten.embedding.default", "other"),
])
def test_op_category(target, category):
    assert op_category("call_function", target) == category


def test_category_colours_are_distinct_and_fixed():
    assert len(set(CATEGORY_COLORS.values())) == len(CATEGORY_COLORS) == 6, "one colour per op category"
    assert CATEGORY_COLORS == svg_mod._category_colors(tuple(CATEGORY_COLORS)), "a function of the names only"


def test_tensor_label():
    assert tensor_label([8, 64], "torch.float32") == "f32[8, 64]"
    assert tensor_label(["s0", 64], "torch.bfloat16") == "bf16[s0, 64]"
    assert tensor_label([[8, 64], [8]], "torch.float32") == "f32[8, 64] (+1 more)"
    assert tensor_label([], "torch.int64") == "i64[]"
    assert tensor_label(None, None) == ""


def test_cache_keys_on_the_view_content_and_keeps_no_notes(monkeypatch):
    calls = []
    real = svg_mod.render_graph_svg
    monkeypatch.setattr(svg_mod, "render_graph_svg", lambda view, **kw: calls.append(kw) or real(view, **kw))
    cache = svg_mod.SvgCache()
    view = tiny_view()
    first = cache.render(view)
    assert cache.render(view.model_copy(deep=True)) == first and len(calls) == 1, "an equal view is drawn once"
    cache.render(view, max_depth=0)
    changed = view.model_copy(deep=True)
    changed.nodes[3].label = "gelu"
    assert "gelu" in cache.render(changed) and len(calls) == 3, "max_depth and content are part of the key"
    cache.render(view, timeout_s=0.0001)  # a cached view is served whatever the budget
    monkeypatch.setattr(svg_mod, "MAX_RENDER_NODES", 1)
    cache.render(changed, max_depth=1)
    cache.render(changed, max_depth=1)
    assert len(calls) == 5, "notes (too large, timed out) are not cached"
