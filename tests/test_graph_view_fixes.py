"""The graph view's readability fixes in a real browser (Chromium via Playwright) over the real
app and the shipped H200 GPT-2 store (tests/data/gpt2_inductor, 12 layers; its README says how
it was made): issue 24 items 9 and 13, issue 23 item 3.

* edges drawn under nodes; arrowheads sized in drawing units (never huge at "fit");
* a node selected at "fit" is zoomed to and marked;
* a backward graph opens at its top with the legend and overlay notes in the page, outside the SVG;
* long op names ellipsized inside their boxes, full text in the ``<title>``;
* a list-of-shapes label printed as shapes (``f32[8, 512, 768] ×3``);
* a filter says how many nodes match it;
* the 4,611-node AdamW step (no module paths) opens with ≤ 500 items, clustered by parameter.
"""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import IN_CI, LiveServer
from tests.test_browser import TIMEOUT_MS
from tests.trace_helpers import GPT2_DIR, _upgrade

GPT2_DB = GPT2_DIR / "gpt2.db.gz"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    if not GPT2_DB.exists():
        if IN_CI:
            pytest.fail(f"{GPT2_DB} is missing (CI=true)")
        pytest.skip(f"{GPT2_DB} is missing")
    path = tmp_path_factory.mktemp("gpt2-view") / "gpt2.db"
    with gzip.open(GPT2_DB, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    _upgrade(path)
    return path


@pytest.fixture(scope="module")
def server(store: Path):
    with LiveServer(store) as live:
        yield live.url


@pytest.fixture(scope="module")
def graphs(server) -> dict[str, dict]:
    """kind → the run's graph of that kind (aot_forward, aot_backward, aot_inference: AdamW's step)."""
    all_graphs = httpx.get(f"{server}/api/runs/gpt2", timeout=30).json()["graphs"]
    return {g["kind"]: g for g in sorted(all_graphs, key=lambda g: g["num_nodes"])}


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    yield pg
    context.close()
    assert not problems, "the page logged errors:\n" + "\n".join(problems)


def open_graph(pg, server: str, gid: int, query: str = "") -> None:
    pg.goto(f"{server}/#/graphs/{gid}{'?' + query if query else ''}")
    pg.wait_for_selector("#graph-svg svg g.node", timeout=60_000)


def host_rect(pg) -> dict:
    return pg.eval_on_selector("#graph-svg", "e => e.getBoundingClientRect().toJSON()")


@pytest.mark.browser
def test_edges_are_drawn_under_nodes_and_arrowheads_keep_a_drawing_size(page, server, graphs):
    open_graph(page, server, graphs["aot_backward"]["id"])
    order = page.evaluate("""() => {
      const all = [...document.querySelectorAll('#graph-svg svg g.edge, #graph-svg svg g.node')];
      const edges = all.map((g, i) => g.classList.contains('edge') ? i : -1).filter(i => i >= 0);
      const nodes = all.map((g, i) => g.classList.contains('node') ? i : -1).filter(i => i >= 0);
      return {lastEdge: Math.max(...edges), firstNode: Math.min(...nodes), edges: edges.length};
    }""")
    assert order["edges"] > 10 and order["lastEdge"] < order["firstNode"], \
        f"every edge comes before every node in the SVG, so no edge is painted over a node: {order}"
    page.click("#zoom-fit")
    sizes = page.evaluate("""() => {
      const svg = document.querySelector('#graph-svg svg'), m = svg.querySelector('marker#arrow');
      const scale = svg.getScreenCTM().a, node = svg.querySelector('g.node rect').getBoundingClientRect();
      return {units: m.getAttribute('markerUnits'), arrow_px: Number(m.getAttribute('markerWidth')) * scale,
              node_px: node.height, scale};
    }""")
    assert sizes["units"] == "userSpaceOnUse", "arrowheads are not scaled by the stroke width"
    assert sizes["scale"] < 0.5 and sizes["arrow_px"] <= sizes["node_px"], \
        f"at fit an arrowhead is smaller than a node box, never a huge triangle: {sizes}"


@pytest.mark.browser
def test_a_node_selected_at_fit_is_zoomed_to_and_marked(page, server, graphs):
    gid = graphs["aot_backward"]["id"]
    open_graph(page, server, gid)
    page.click("#zoom-fit")
    name = page.evaluate("() => [...document.querySelectorAll('#graph-svg g.node')].at(-1).dataset.name")
    page.fill("#node-search", name)
    page.press("#node-search", "Enter")
    page.wait_for_selector(f'#graph-svg g.node.selected[data-name="{name}"] rect.selection-halo')
    page.wait_for_function("n => document.querySelector('[data-testid=node-name]')?.textContent === n", arg=name)
    box = page.eval_on_selector(f'#graph-svg g.node.selected[data-name="{name}"]', "e => e.getBoundingClientRect().toJSON()")
    host = host_rect(page)
    assert box["height"] >= 18, f"the selection is drawn readable (zoomed to), not a speck of the fitted graph: {box}"
    assert host["left"] <= box["left"] and box["right"] <= host["right"] and host["top"] <= box["top"] \
        and box["bottom"] <= host["bottom"], "and it is in view"


@pytest.mark.browser
def test_backward_graph_opens_at_its_top_with_legend_and_overlay_note_in_the_page(page, server, graphs):
    gid = graphs["aot_backward"]["id"]
    open_graph(page, server, gid, "overlay=comm")
    assert page.locator("#graph-svg svg #legend").count() == 0, "the legend is not inside the panned SVG"
    assert page.locator("#graph-legend #legend").count() == 1
    note = page.locator("[data-testid=overlay-note]")
    assert note.count() == 1 and "no values" in note.inner_text()
    assert note.is_visible() and note.bounding_box()["y"] + note.bounding_box()["height"] <= 900, \
        "the overlay's message is in the first screen"
    # the top of the drawing is in view: the highest node is inside the host
    top = page.evaluate("""() => {
      const rects = [...document.querySelectorAll('#graph-svg g.node')].map(g => g.getBoundingClientRect());
      const hi = rects.reduce((a, b) => (b.top < a.top ? b : a));
      const host = document.querySelector('#graph-svg').getBoundingClientRect();
      return {node_top: hi.top, host_top: host.top, host_bottom: host.bottom};
    }""")
    assert top["host_top"] <= top["node_top"] <= top["host_top"] + 120, f"opens at the graph's top: {top}"


@pytest.mark.browser
def test_long_op_names_stay_in_their_boxes_with_the_full_name_on_hover(page, server, graphs):
    gid = graphs["aot_backward"]["id"]
    name = next(n["name"] for n in httpx.get(f"{server}/api/graphs/{gid}/nodes", timeout=30).json()
                if n["target"] and "_scaled_dot_product_efficient_attention_backward" in n["target"])
    open_graph(page, server, gid, f"node={name}")
    page.wait_for_selector(f'#graph-svg g.node[data-name="{name}"]')
    over = page.evaluate("""() => [...document.querySelectorAll('#graph-svg g.node')].flatMap(g => {
      const r = g.querySelector('rect:not(.selection-halo)').getBoundingClientRect();
      return [...g.querySelectorAll(':scope > text')].map(t => t.getBoundingClientRect())
        .filter(t => t.left < r.left - 0.5 || t.right > r.right + 0.5).map(() => g.dataset.name);
    })""")
    assert not over, f"labels wider than their box: {over[:5]}"
    label = page.eval_on_selector(f'#graph-svg g.node[data-name="{name}"] text', "e => e.textContent")
    title = page.eval_on_selector(f'#graph-svg g.node[data-name="{name}"] title', "e => e.textContent")
    assert label.endswith("\u2026") and "_scaled_dot_product_efficient_attention_backward" in title


@pytest.mark.browser
def test_a_list_of_shapes_is_printed_as_shapes(page, server, graphs):
    gid = graphs["aot_forward"]["id"]
    open_graph(page, server, gid, "node=split")
    page.wait_for_selector('#graph-svg g.node[data-name="split"]')
    texts = page.eval_on_selector_all('#graph-svg g.node[data-name="split"] text', "es => es.map(e => e.textContent)")
    assert texts[-1] == "f32[8, 512, 768] \u00d73", texts
    drawn = page.eval_on_selector_all("#graph-svg g.node text", "es => es.map(e => e.textContent)")
    assert not [t for t in drawn if "total_len" in t or "[[" in t], "never a raw, truncated repr of a list"


@pytest.mark.browser
def test_a_filter_says_how_many_nodes_match(page, server, graphs):
    gid = graphs["aot_forward"]["id"]
    nodes = httpx.get(f"{server}/api/graphs/{gid}/nodes", timeout=30).json()
    expected = sum(1 for n in nodes if re.fullmatch(r"mm|addmm", (n["target"] or "").split(".")[1] if
                                                      (n["target"] or "").startswith("aten.") else ""))
    assert expected > 10
    open_graph(page, server, gid, "filter=mm%7Caddmm")
    status = page.inner_text("[data-testid=view-status]")
    assert f"{expected} nodes match mm|addmm" in status, status
    assert page.locator("#graph-svg g.node.match").count() + sum(
        int(re.search(r"(\d+) match", t).group(1)) for t in
        page.eval_on_selector_all("#graph-svg g.cluster.collapsed.has-match", "es => es.map(e => e.textContent)")) == expected, \
        "each match is marked, drawn or counted on its collapsed box"


@pytest.mark.browser
def test_optimizer_step_opens_clustered_by_parameter_with_at_most_500_items(page, server, graphs):
    step = graphs["aot_inference"]
    assert step["num_nodes"] > 4000
    open_graph(page, server, step["id"])
    items = page.evaluate("""() => ({
      nodes: document.querySelectorAll('#graph-svg g.node').length,
      boxes: [...document.querySelectorAll('#graph-svg g.cluster')].map(g => g.dataset.path)})""")
    assert items["nodes"] + len(items["boxes"]) <= 500, f"{items['nodes']} nodes + {len(items['boxes'])} boxes drawn"
    params = [p for p in items["boxes"] if re.fullmatch(r"param_group 0/params\[\d+\]", p)]
    assert len(params) == 148, f"one box per parameter of the param group: {items['boxes'][:5]}"
    # a parameter's box opens on its state: the parameter, its grad, exp_avg, exp_avg_sq, step and their updates
    page.locator('#graph-svg g.cluster.collapsed[data-path="param_group 0/params[7]"]').dispatch_event("click")
    page.wait_for_selector('#graph-svg g.cluster.open[data-path="param_group 0/params[7]"]')
    inside = page.eval_on_selector_all('#graph-svg g.node', "es => es.map(e => e.dataset.name)")
    assert sum(1 for n in inside if n.startswith("copy_")) >= 4 and sum(1 for n in inside if n.startswith("arg")) >= 5


def test_edges_never_cut_through_a_box_and_cross_less(server, graphs):
    """Issue 23.3: on the backward graph every edge runs through its own column inside a layer and
    slants only in the gaps between layers (NOTE: [Edge routes]); before, 10 edges of the default
    view cut through a box and 29 pairs crossed (bench/RESULTS.md)."""
    import xml.etree.ElementTree as ET

    svg = httpx.get(f"{server}/api/graphs/{graphs['aot_backward']['id']}/svg", timeout=60).text
    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(svg.encode())
    boxes = {}
    for g in root.iter(f"{ns}g"):
        cls = (g.get("class") or "").split()
        if "node" in cls or "cluster" in cls:
            r = g.find(f"{ns}rect")
            x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
            boxes[g.get("data-name") or "cluster:" + g.get("data-path")] = (x + 2, y + 2, x + w - 2, y + h - 2)
    cut = []
    for g in root.iter(f"{ns}g"):
        if "edge" not in (g.get("class") or "").split():
            continue
        pts = [tuple(map(float, p.split(","))) for p in g.find(f"{ns}path").get("d")[1:].split(" L")]
        ends = (pts[0], pts[-1])
        for name, (x0, y0, x1, y1) in boxes.items():
            if name in (g.get("data-src"), g.get("data-dst")) or any(
                    x0 - 4 <= px <= x1 + 4 and y0 - 4 <= py <= y1 + 4 for px, py in ends):
                continue  # an end of the edge, or a cluster holding one
            for (ax, ay), (bx, by) in zip(pts, pts[1:]):
                if any(x0 < ax + (bx - ax) * t / 40 < x1 and y0 < ay + (by - ay) * t / 40 < y1 for t in range(41)):
                    cut.append((g.get("data-src"), g.get("data-dst"), name))
                    break
    assert not cut, f"edges drawn through boxes: {cut[:5]}"


# ---------------------------------------------------------------------------- flat graphs, no browser

def _flat_view(n_params: int, extra_ops: int = 0):
    """A synthetic optimizer step: params p<i> and grads g<i>, ``_foreach_add(ps, gs)``, one
    getitem per element and a copy_ back into each param (plus ``extra_ops`` loose ops)."""
    from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode

    nodes, edges, calls, k = [], [], {}, 0

    def add(name, op, target, args=(), label=None):
        nonlocal k
        nodes.append(ViewNode(id=name, idx=k, label=label or target.split(".")[-2 if "." in target else -1],
                              op=op, target=target, category="other"))
        calls[name] = list(args)
        for a in args:
            for ref in (a if isinstance(a, list) else [a]):
                if isinstance(ref, dict):
                    edges.append(ViewEdge(src=ref["node"], dst=name, size_bytes=4))
        k += 1

    add("x", "placeholder", "x", label="x")
    for i in range(n_params):
        add(f"p{i}", "placeholder", f"p{i}", label=f"p{i}")
        add(f"g{i}", "placeholder", f"g{i}", label=f"g{i}")
    add("_foreach_add", "call_function", "aten._foreach_add.List",
        [[{"node": f"p{i}"} for i in range(n_params)], [{"node": f"g{i}"} for i in range(n_params)]])
    for i in range(n_params):
        add(f"getitem_{i}", "call_function", "_operator.getitem", [{"node": "_foreach_add"}, i], label="getitem")
        add(f"copy__{i}", "call_function", "aten.copy_.default", [{"node": f"p{i}"}, {"node": f"getitem_{i}"}])
    for j in range(extra_ops):
        add(f"relu_{j}", "call_function", "aten.relu.default", [{"node": f"relu_{j - 1}" if j else "x"}])
    add("output", "output", "output", [[{"node": f"copy__{i}"} for i in range(n_params)]], label="output")
    return GraphView(graph_id=1, name="step", kind="aot_inference", nodes=nodes, edges=edges), calls


def test_flat_graph_is_clustered_by_the_parameter_each_op_reads_or_writes():
    from graphdeck.server.render.flat import cluster_flat, is_flat
    from graphdeck.server.render.svg import render_graph_svg

    view, calls = _flat_view(120)
    assert is_flat(view)
    out = cluster_flat(view, calls, {})
    ns = {n.id: n.namespace for n in out.nodes}
    assert ns["p7"] == ns["g7"] == ns["getitem_7"] == ns["copy__7"] == "param_group/p7", \
        "the i-th elements of a foreach's lists, getitem(F, i) and the copy_ into the param are one parameter"
    assert ns["_foreach_add"] is None and ns["output"] is None, "an op reading every parameter stays shared"
    svg = render_graph_svg(out)
    assert svg.count('<g id="node-') + svg.count('class="cluster collapsed') <= 130


def test_flat_graph_without_lists_is_clustered_by_stack_frame():
    from graphdeck.server.render.flat import cluster_flat

    view, calls = _flat_view(2, extra_ops=500)
    stacks = {f"relu_{j}": f'File "/x/model.py", line {10 + j % 3}, in step\n    y = x.relu()' for j in range(500)}
    out = cluster_flat(view, calls, stacks)
    frames = {n.namespace for n in out.nodes if n.id.startswith("relu_")}
    assert frames == {"frame model.py:10 step", "frame model.py:11 step", "frame model.py:12 step"}
