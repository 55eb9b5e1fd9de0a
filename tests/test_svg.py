"""``render_graph_svg`` is pure, safe and draws what the view state asks: views built here in code,
SVG parsed as XML (what a browser's DOMParser sees). No timing assertions (speed is in bench/).
"""

from __future__ import annotations

import os
import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from graphdeck.analysis.graphs.view import (
    GraphView,
    ViewEdge,
    ViewNode,
    finish_view,
    node_label,
    op_category,
    short_target,
)
from graphdeck.analysis.parallel.overlays import Overlay
from graphdeck.errors import UsageError
from graphdeck.server.render import svg as svg_mod
from graphdeck.server.render.palette import EDGE_HEAVY
from graphdeck.server.render.svg import CATEGORY_COLORS, SvgCache, render_graph_svg, tensor_label

SVG = "{http://www.w3.org/2000/svg}"
EVIL = "<script>alert(1)</script>"
QUOTES = "a&b\"c'd"
GOLDEN = Path(__file__).with_name("golden") / "graph_view_tiny.svg"


def node(idx: int, name: str, op: str = "call_function", target: str = "aten.relu.default", **kw) -> ViewNode:
    return ViewNode(id=name, idx=idx, label=node_label(op, target), op=op, target=target,
                    category=op_category(op, target), **kw)


def tiny_view() -> GraphView:
    """x, w → linear.mm → relu → output, inside module paths ``block/linear`` and ``block``."""
    nodes = [
        node(0, "x", "placeholder", "x", shape=[8, 32], dtype="torch.float32"),
        node(1, "w", "placeholder", "w", shape=[32, 64], dtype="torch.float32", param_fqn="block.linear.weight",
             namespace="block/linear", size_bytes=8192),
        node(2, "mm", target="aten.mm.default", namespace="block/linear", shape=[8, 64], dtype="torch.float32"),
        node(3, "relu", namespace="block", shape=[8, 64], dtype="torch.float32"),
        node(4, "output", "output", "output"),
    ]
    edges = [ViewEdge(src="x", dst="mm", size_bytes=1024), ViewEdge(src="w", dst="mm", arg_pos=1, size_bytes=8192),
             ViewEdge(src="mm", dst="relu", size_bytes=2048), ViewEdge(src="relu", dst="output", size_bytes=2048)]
    return GraphView(graph_id=1, name="tiny", kind="dynamo", nodes=nodes, edges=edges)


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode("utf-8"))


def groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if cls in (g.get("class") or "").split()]


def texts(g: ET.Element) -> list[str]:
    return [t.text or "" for t in g.findall(f"{SVG}text")]


def title(g: ET.Element) -> str:
    return g.find(f"{SVG}title").text or ""


def rect_attr(g: ET.Element, attr: str) -> str | None:
    return g.find(f"{SVG}rect").get(attr)


def by_id(root: ET.Element) -> dict[str, ET.Element]:
    return {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("id")}


def test_nodes_carry_idx_ids_names_titles_labels_and_categories():
    root = parse(render_graph_svg(tiny_view(), max_depth=99))
    nodes = {g.get("id"): g for g in groups(root, "node")}
    assert set(nodes) == {f"node-{i}" for i in range(5)}, "one <g id='node-<idx>'> per node, nothing else"
    assert nodes["node-2"].get("data-name") == "mm" and title(nodes["node-2"]).split("\n")[0] == "mm"
    assert texts(nodes["node-2"]) == ["mm", "f32[8, 64]"], "label: short target name, then dtype and shape"
    assert texts(nodes["node-1"]) == ["block.linear.weight", "f32[32, 64]"], "a parameter placeholder shows its parameter"
    assert "cat-matmul" in nodes["node-2"].get("class") and "cat-placeholder" in nodes["node-0"].get("class")
    assert rect_attr(nodes["node-2"], "fill") == CATEGORY_COLORS["matmul"]
    assert rect_attr(nodes["node-3"], "fill") == CATEGORY_COLORS["elementwise"]
    edges = groups(root, "edge")
    assert len(edges) == 4 and {g.get("id") for g in edges} == {f"edge-{k}" for k in range(4)}
    assert all(not g.findall(f"{SVG}text") for g in edges), "no edge labels (they cost dot 3-5x and clutter)"


def test_root_fills_its_box_and_keeps_the_viewbox():
    root = parse(render_graph_svg(tiny_view()))
    assert (root.get("width"), root.get("height")) == ("100%", "100%"), "the frontend pans/zooms with the viewBox"
    assert len(root.get("viewBox").split()) == 4


def test_max_depth_collapses_clusters_into_boxes_with_counts_and_param_bytes():
    view = tiny_view()
    root = parse(render_graph_svg(view, max_depth=99))
    assert sorted(g.get("data-path") for g in groups(root, "open")) == ["block", "block/linear"]
    root = parse(render_graph_svg(view, max_depth=1))
    (box,) = groups(root, "collapsed")
    assert box.get("data-path") == "block/linear" and box.get("data-nodes") == "2"
    assert texts(box)[1] == "2 nodes · 8.0 KiB params", "a collapsed cluster says node count and parameter bytes"
    assert {g.get("id") for g in groups(root, "node")} == {"node-0", "node-3", "node-4"}
    root = parse(render_graph_svg(view, max_depth=0))
    assert [g.get("data-path") for g in groups(root, "collapsed")] == ["block"] and not groups(root, "open")
    with pytest.raises(ValueError):
        render_graph_svg(view, max_depth=-1)


def test_expand_collapse_and_focus_open_or_close_one_cluster():
    view = tiny_view()
    opened = parse(render_graph_svg(view, max_depth=0, expand=["block/linear"]))
    assert sorted(g.get("data-path") for g in groups(opened, "open")) == ["block", "block/linear"], \
        "expanding a path opens its ancestors"
    closed = parse(render_graph_svg(view, max_depth=99, collapse=["block/linear"]))
    assert [g.get("data-path") for g in groups(closed, "collapsed")] == ["block/linear"]
    assert parse(render_graph_svg(view, max_depth=0, expand=["block"], collapse=["block"])).get(
        "data-open-clusters") == "", "collapse wins over expand"
    focused = parse(render_graph_svg(view, max_depth=0, focus="mm"))
    assert "node-2" in by_id(focused) and focused.get("data-open-clusters") == "block|block/linear"


def test_edges_between_clusters_are_drawn_once_between_the_boxes_with_bytes_summed():
    root = parse(render_graph_svg(tiny_view(), max_depth=1))
    ends = {(g.get("data-src"), g.get("data-dst")): int(g.get("data-bytes")) for g in groups(root, "edge")}
    assert ends == {("x", "cluster:block"): 1024, ("cluster:block/linear", "relu"): 2048,
                    ("cluster:block", "output"): 2048}, \
        "w → mm is inside the collapsed box; x → mm and relu → output end at the open box around it"


def test_edge_width_and_colour_follow_bytes_and_the_heaviest_are_red():
    root = parse(render_graph_svg(tiny_view(), max_depth=99))
    widths = {int(g.get("data-bytes")): float(g.find(f"{SVG}path").get("stroke-width")) for g in groups(root, "edge")}
    assert widths[1024] < widths[2048] < widths[8192], f"wider for more bytes: {widths}"
    heavy = groups(root, "heavy")
    assert heavy and all(g.find(f"{SVG}path").get("stroke") == EDGE_HEAVY for g in heavy)
    legend = by_id(root)["legend"]
    assert "edge bytes:" in texts(legend) and any("heaviest" in t for t in texts(legend)), "the legend says the scale"


def test_same_view_same_bytes_whatever_the_input_order_and_golden_file():
    view = tiny_view()
    shuffled = view.model_copy(deep=True)
    rng = random.Random(0)
    rng.shuffle(shuffled.nodes)
    rng.shuffle(shuffled.edges)
    first = render_graph_svg(view, max_depth=99)
    assert render_graph_svg(view, max_depth=99) == first
    assert render_graph_svg(shuffled, max_depth=99) == first, "members, clusters and edges are emitted in sorted order"
    if os.environ.get("GRAPHDECK_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(first, encoding="utf-8")
    assert first == GOLDEN.read_text(encoding="utf-8"), \
        "SVG bytes changed; if intended, rerun with GRAPHDECK_UPDATE_GOLDEN=1 and review the diff"


def test_user_text_is_escaped_and_reads_back_exactly():
    nasty = [EVIL, QUOTES, "{a|b}<c>", "back\\slash\\N\\l", "ctl\x00\x07char", "new\nline",
             "torch.einsum('bhqd,bhkd->bhqk', q, k)", '"><img src=x onerror=alert(1)>']
    nodes = [node(0, EVIL, "placeholder", EVIL, param_fqn=QUOTES)]
    for i, text in enumerate(nasty, start=1):
        nodes.append(node(i, text, "call_function", text, namespace=f"{QUOTES}/{{x|y}}"))
    nodes.append(node(len(nodes), "output", "output", "output", namespace=EVIL))
    edges = [ViewEdge(src=nodes[i].id, dst=nodes[i + 1].id) for i in range(len(nodes) - 1)]
    view = GraphView(graph_id=9, name=EVIL, kind="dynamo", nodes=nodes, edges=edges)

    svg = render_graph_svg(view, max_depth=99)
    assert "<script" not in svg and "<img" not in svg, "markup from user code is escaped"
    root = parse(svg)  # well-formed XML: no raw '&', quotes or control characters leaked
    drawn = {g.get("id"): g for g in groups(root, "node")}
    assert len(drawn) == len(nodes), "every node survives: '{|}<>' and einsum arrows broke nothing"
    assert drawn["node-0"].get("data-name") == EVIL and texts(drawn["node-0"])[0] == QUOTES
    assert texts(drawn["node-1"])[0] == EVIL and drawn["node-2"].get("data-name") == QUOTES
    assert texts(drawn["node-3"])[0] == "{a|b}<c>" and texts(drawn["node-4"])[0] == "back\\slash\\N\\l"
    assert texts(drawn["node-5"])[0] == "ctlchar", "control characters are dropped (XML 1.0 forbids them)"
    assert drawn["node-7"].get("data-name") == "torch.einsum('bhqd,bhkd->bhqk', q, k)", "V1: the equation is intact"
    assert drawn["node-8"].get("data-name") == '"><img src=x onerror=alert(1)>'
    labels = {texts(g)[0] for g in groups(root, "open")}
    assert f"\u25be {QUOTES}" in labels and "\u25be {x|y}" in labels


def test_long_user_text_is_ellipsized_with_the_full_text_in_its_title():
    long_name = "m" * 500
    view = GraphView(graph_id=1, name="g", kind="dynamo", edges=[],
                     nodes=[node(0, long_name, "call_function", f"aten.{long_name}.default")])
    (g,) = groups(parse(render_graph_svg(view)), "node")
    assert texts(g)[0] == "m" * 39 + "…", "issue 24.9: a long label ends in … inside its box"
    assert g.find(f"{SVG}title").text.startswith(long_name + "\n"), "the full label shows on hover"


def test_filter_keeps_matches_and_paths_between_them_and_fades_the_rest():
    view = synthetic_layers(3)
    root = parse(render_graph_svg(view, max_depth=99, filter_by_op=["mm"]))
    cls = {g.get("data-name"): set(g.get("class").split()) for g in groups(root, "node")}
    assert {n for n, c in cls.items() if "match" in c} == {"mm0", "mm1", "mm2"}
    assert {"relu0", "add0", "relu1", "add1"} <= {n for n, c in cls.items() if "on-path" in c}, "paths mm0 → mm2 kept"
    assert "faded" in cls["sum0"] and "faded" in cls["output"], "nodes off every path between matches fade"
    assert "on-path" not in cls["relu2"], "after the last match is not between matches"
    boxes = {g.get("data-path"): g for g in groups(parse(render_graph_svg(view, max_depth=1, filter_by_op=["mm"])), "collapsed")}
    assert "has-match" in boxes["layers/0"].get("class") and texts(boxes["layers/0"])[1].endswith("1 match"), \
        "a collapsed cluster holding a match says so"
    for bad in ["(", "[a-", "*"]:
        with pytest.raises(UsageError, match="not a valid regular expression"):
            render_graph_svg(view, filter_by_op=[bad])


def test_overlay_colours_nodes_and_sums_into_collapsed_clusters():
    view = tiny_view()
    ov = Overlay(kind="time", unit="ns", values={"mm": 2_000_000, "relu": 1_000_000})
    root = parse(render_graph_svg(view, max_depth=99, overlay=ov))
    fills = {g.get("data-name"): rect_attr(g, "fill") for g in groups(root, "node")}
    assert fills["mm"] != fills["relu"] and fills["x"] == "#f4f4f4", "no value: a neutral fill"
    (box,) = groups(parse(render_graph_svg(view, max_depth=0, overlay=ov)), "collapsed")
    assert "3.00 ms" in texts(box)[1], "a collapsed cluster shows its summed time"
    live = Overlay(kind="memory", unit="bytes", aggregate="max", values={"x": 1024, "mm": 3 * 1024, "relu": 2 * 1024})
    (box,) = groups(parse(render_graph_svg(view, max_depth=0, overlay=live)), "collapsed")
    assert "3.0 KiB" in texts(box)[1] and "5.0 KiB" not in texts(box)[1], \
        "live bytes are a level: a cluster shows its nodes' peak, not their sum"
    cats = Overlay(kind="rank", categorical=True, values={"mm": "rank 0", "relu": "rank 1"})
    fills = {g.get("data-name"): rect_attr(g, "fill") for g in groups(parse(render_graph_svg(view, max_depth=99, overlay=cats)), "node")}
    assert fills["mm"] != fills["relu"]


def test_marks_and_node_kinds_are_classes():
    view = tiny_view()
    view.nodes[3].recomputed = True
    view.nodes[2].dtype_change = "float32\u2192bfloat16"
    view.nodes.insert(4, node(4, "ar", target="_c10d_functional.all_reduce.default", namespace="block"))
    view.nodes[5].idx = 5
    root = parse(render_graph_svg(view, max_depth=99, marks={"mm": "changed", "x": "removed"}))
    cls = {g.get("data-name"): set(g.get("class").split()) for g in groups(root, "node")}
    assert {"diff-changed", "dtype-change"} <= cls["mm"] and "diff-removed" in cls["x"]
    assert "recomputed" in cls["relu"] and "collective" in cls["ar"]
    assert texts(by_id(root)["node-2"])[1] == "f32\u2192f32[8, 64]" or texts(by_id(root)["node-2"])[1].startswith("f32\u2192")


def test_too_many_visible_items_draws_the_neighbourhood_with_a_note():
    root = parse(render_graph_svg(synthetic_layers(40), max_depth=99, focus="mm20", max_items=50))
    note = "".join(root.itertext())
    assert "too many to lay out" in note and "neighbourhood of mm20" in note
    names = {g.get("data-name") for g in groups(root, "node")}
    assert "mm20" in names and "mm0" not in names and len(names) < 50


def test_cache_serves_repeats_and_answers_past_the_deadline_with_a_fallback():
    cache = SvgCache()
    view = tiny_view()
    state = {"max_depth": 99}
    first = cache.render(view, state, graph_key="g1")
    assert cache.lookup("g1", state) == first, "the cache holds the render"
    big = synthetic_layers(300)
    svg = cache.render(big, {"max_depth": 99}, graph_key="big", timeout_s=0.001)
    assert "fallback-note" in svg and "took longer than" in svg, "past the deadline: the k-hop view at once"
    cache._pool.shutdown(wait=True)  # the render went on in the background ...
    assert cache.lookup("big", {"max_depth": 99}) is not None, "... and filled the cache for the next request"


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
            node(base, names[0], "placeholder", names[0], param_fqn=f"layers.{layer}.mlp.weight", namespace=ns),
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


def test_a_large_graph_default_view_is_depth_limited():
    view = synthetic_layers(620)  # 3,102 nodes; 620 saved values into one output node
    root = parse(render_graph_svg(view))
    assert 0 < len(groups(root, "node")) + len(groups(root, "collapsed")) <= 400, "auto depth: at most 400 items"
    full = parse(render_graph_svg(view, max_depth=99))
    assert len(groups(full, "node")) == len(view.nodes), "fully expanded draws every node"


def test_nodes_without_a_module_join_their_producer_or_consumer():
    """V4: a tangent placeholder joins its first consumer's module; a gradient-accumulation add
    with no module joins its first producer's; the output stays at the top."""
    nodes = [node(0, "tangent", "placeholder", "tangent"),
             node(1, "mm_bw", target="aten.mm.default", namespace="h/0/mlp"),
             node(2, "acc", target="aten.add.Tensor"),
             node(3, "acc2", target="aten.add.Tensor"),
             node(4, "output", "output", "output")]
    edges = [ViewEdge(src="tangent", dst="mm_bw"), ViewEdge(src="mm_bw", dst="acc"), ViewEdge(src="acc", dst="acc2"),
             ViewEdge(src="acc2", dst="output")]
    finish_view(nodes, edges)
    got = {n.id: (n.namespace, n.namespace_from) for n in nodes}
    assert got == {"tangent": ("h/0/mlp", "consumer"), "mm_bw": ("h/0/mlp", None), "acc": ("h/0/mlp", "producer"),
                   "acc2": ("h/0/mlp", "producer"), "output": (None, None)}
    root = parse(render_graph_svg(GraphView(graph_id=1, name="bw", kind="aot_backward", nodes=nodes, edges=edges), max_depth=0))
    (box,) = groups(root, "collapsed")
    assert box.get("data-nodes") == "4", "inferred nodes count in the cluster they join"


def test_fan_in_of_40_lays_out():
    """V6: a cat of 40 inputs (dot's time explodes with fan-in) is one ordinary layer here."""
    nodes = [node(i, f"x{i}", "placeholder", f"x{i}") for i in range(40)]
    nodes.append(node(40, "cat", target="aten.cat.default"))
    edges = [ViewEdge(src=f"x{i}", dst="cat", arg_pos=i) for i in range(40)]
    root = parse(render_graph_svg(GraphView(graph_id=1, name="fan", kind="dynamo", nodes=nodes, edges=edges)))
    assert len(groups(root, "node")) == 41 and len(groups(root, "edge")) == 40


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
    ("aten._to_copy.default", "cast"), ("prims.convert_element_type.default", "cast"),
    ("aten.bernoulli.p", "random"), ("aten.native_dropout.default", "random"),
    ("aten.native_dropout_backward.default", "elementwise"), ("aten.embedding.default", "other"),
])
def test_op_category(target, category):
    assert op_category("call_function", target) == category


def test_category_colours_are_distinct_and_fixed():
    assert len(set(CATEGORY_COLORS.values())) == len(CATEGORY_COLORS) == 8, "one colour per op category"
    assert CATEGORY_COLORS == svg_mod._category_colors(tuple(CATEGORY_COLORS)), "a function of the names only"


def test_tensor_label():
    assert tensor_label([8, 64], "torch.float32") == "f32[8, 64]"
    assert tensor_label(["s0", 64], "torch.bfloat16") == "bf16[s0, 64]"
    assert tensor_label([[8, 64], [8]], "torch.float32") == "f32[8, 64], [8]"
    assert tensor_label([[8, 512, 768]] * 3, "torch.float32") == "f32[8, 512, 768] \u00d73", "equal shapes: one and how many"
    assert "total_len" not in tensor_label([[8, 12, 512, 64]] * 2 + [[8, 12], [], None], "torch.float32")
    assert tensor_label([], "torch.int64") == "i64[]"
    assert tensor_label(None, None) == ""


def test_no_graphviz_record_or_html_syntax_reaches_the_output():
    svg = render_graph_svg(tiny_view(), max_depth=99)
    assert not re.search(r"<(?!/?(svg|g|title|rect|text|path|line|defs|marker|\?xml))\w", svg), "only our own elements"


def boxes(root: ET.Element) -> tuple[list[tuple], list[tuple]]:
    """(leaf rects: nodes and collapsed clusters, open-cluster rects) as (x0, y0, x1, y1, id)."""
    leaves, opens = [], []
    for g in root.iter(f"{SVG}g"):
        cls = (g.get("class") or "").split()
        r = g.find(f"{SVG}rect")
        if r is None or not ({"node", "cluster"} & set(cls)):
            continue
        x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
        (opens if "open" in cls else leaves).append((x, y, x + w, y + h, g.get("id")))
    return leaves, opens


def overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] - 0.05 and b[0] < a[2] - 0.05 and a[1] < b[3] - 0.05 and b[1] < a[3] - 0.05


def inside(a: tuple, b: tuple) -> bool:
    return b[0] - 0.05 <= a[0] and b[1] - 0.05 <= a[1] and a[2] <= b[2] + 0.05 and a[3] <= b[3] + 0.05


def assert_layout_sane(svg: str) -> None:
    """No two drawn nodes/boxes overlap; open clusters are nested or apart, never crossing."""
    leaves, opens = boxes(parse(svg))
    for i, a in enumerate(leaves):
        for b in leaves[i + 1:]:
            assert not overlap(a, b), f"{a[4]} overlaps {b[4]}"
    for i, a in enumerate(opens):
        for b in opens[i + 1:]:
            assert not overlap(a, b) or inside(a, b) or inside(b, a), f"clusters {a[4]} and {b[4]} cross"
        for leaf in leaves:
            assert not overlap(leaf, a) or inside(leaf, a), f"{leaf[4]} crosses the border of {a[4]}"


@pytest.mark.parametrize("max_depth", [0, 1, 2, 99])
def test_layout_never_overlaps_boxes_at_any_depth(max_depth):
    assert_layout_sane(render_graph_svg(synthetic_layers(12), max_depth=max_depth))
    assert_layout_sane(render_graph_svg(synthetic_layers(12), max_depth=max_depth, expand=["layers/3/mlp"]))
