"""The graph view over HTTP (the real app on the captured stores): every ``/svg`` parameter,
good and bad; overlays, diff, forward/backward counterparts, Model Explorer export; the Python
API; cases V1–V6 of ``../shared/cases/graph-view.md`` on a captured hostile model (V7, the
20,000-node graph, is in ``bench/bench_svg.py``).
"""

from __future__ import annotations

import json
import sqlite3
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, run_python

SVG = "{http://www.w3.org/2000/svg}"
EVIL = "<script>alert(1)</script>"

#: V1, V3, V6: a model whose submodule is named with a script tag, with an einsum and a cat of 40.
HOSTILE_SCRIPT = r"""
import sys, torch
from graphdeck.capture import Agent
class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
    def forward(self, q, k):
        s = torch.einsum('bhqd,bhkd->bhqk', self.proj(q), k)
        parts = torch.cat([s * (i + 1) for i in range(40)], dim=-1)
        return torch.nn.functional.gelu(parts, approximate="tanh").sum()
class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(sys.argv[2], Inner())
    def forward(self, q, k):
        return getattr(self, sys.argv[2])(q, k)
torch.manual_seed(0)
agent = Agent(store=sys.argv[1], run="hostile")
model = agent.watch(Outer())
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
q, k = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 2, 4, 8)
compiled(q, k).backward()
agent.close()
"""


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode("utf-8"))


def node_gs(root: ET.Element) -> dict[str, ET.Element]:
    return {g.get("data-name"): g for g in root.iter(f"{SVG}g") if "node" in (g.get("class") or "").split()
            and g.get("data-name") is not None}


@pytest.fixture(scope="module")
def server(captured_store: Path):
    with LiveServer(captured_store) as live:
        yield live.url


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def graphs(client) -> dict[str, dict]:
    by_kind: dict[str, dict] = {}
    for g in sorted(client.get("/api/runs/tiny").json()["graphs"], key=lambda g: -g["num_nodes"]):
        by_kind.setdefault(g["kind"], g)
    return by_kind


def error(res: httpx.Response, status: int) -> str:
    assert res.status_code == status, f"expected {status}, got {res.status_code}: {res.text[:300]}"
    body = res.json()
    assert body["ok"] is False and body["status"] == status and body["error"], body
    return body["error"]


def test_svg_view_parameters(client, graphs):
    fwd = graphs["aot_forward"]["id"]
    url = f"/api/graphs/{fwd}/svg"
    res = client.get(url)
    assert res.status_code == 200 and res.headers["content-type"].startswith("image/svg+xml")
    assert client.get(url).content == res.content, "a repeat is the same bytes (served from the cache)"
    depth0 = parse(client.get(url, params={"max_depth": 0}).text)
    boxes = [g.get("data-path") for g in depth0.iter(f"{SVG}g") if "collapsed" in (g.get("class") or "")]
    assert boxes, "depth 0: the top-level module clusters are collapsed boxes"
    opened = parse(client.get(url, params={"max_depth": 0, "expand": boxes[0]}).text)
    assert boxes[0] in opened.get("data-open-clusters").split("|")
    closed = parse(client.get(url, params={"max_depth": 99, "collapse": boxes[0]}).text)
    assert boxes[0] not in closed.get("data-open-clusters").split("|")
    assert client.get(url, params={"expand": "no/such/module"}).status_code == 200, "unknown paths are ignored"
    filtered = parse(client.get(url, params={"max_depth": 99, "filter_by_op": ["addmm", "mm"]}).text)
    classes = [g.get("class") for g in node_gs(filtered).values()]
    assert any("match" in c.split() for c in classes) and any("faded" in c.split() for c in classes)
    for kind in ("bytes", "time", "partition", "rank"):
        assert client.get(url, params={"overlay": kind}).status_code == 200, kind
    res = client.get(url, params={"download": "1"})
    assert res.headers["content-disposition"] == f'attachment; filename="graph-{fwd}.svg"'
    nodes = client.get(f"/api/graphs/{fwd}/nodes").json()
    deep = next(n for n in nodes if (n["module_path"] or "").count("/") >= 2)
    focused = parse(client.get(url, params={"max_depth": 0, "node": deep["name"]}).text)
    assert deep["name"] in node_gs(focused), "node= opens the clusters of that node"


def test_svg_bad_parameters_answer_4xx_with_a_message(client, graphs):
    fwd = graphs["aot_forward"]["id"]
    url = f"/api/graphs/{fwd}/svg"
    assert "max_depth" in error(client.get(url, params={"max_depth": -1}), 422)
    assert "max_depth" in error(client.get(url, params={"max_depth": "deep"}), 422)
    assert "not a valid regular expression" in error(client.get(url, params={"filter_by_op": "(mm"}), 400)
    assert "unknown overlay" in error(client.get(url, params={"overlay": "heat"}), 400)
    assert "not found" in error(client.get("/api/graphs/999999/svg"), 404)
    assert "not found" in error(client.get(url, params={"diff_against": 999999}), 404)
    assert "unknown overlay" in error(client.get(f"/api/graphs/{fwd}/overlays/heat"), 400)
    for path in ("overlays/bytes", "diff/1", "model-explorer", "nodes/x/counterparts"):
        error(client.get(f"/api/graphs/999999/{path}"), 404)


def test_overlays_are_keyed_by_node_name(client, graphs):
    fwd = graphs["aot_forward"]["id"]
    names = {n["name"] for n in client.get(f"/api/graphs/{fwd}/nodes").json()}
    ov = client.get(f"/api/graphs/{fwd}/overlays/bytes").json()
    assert ov["unit"] == "bytes" and ov["values"] and set(ov["values"]) <= names
    rank = client.get(f"/api/graphs/{fwd}/overlays/rank").json()
    assert rank["categorical"] and set(rank["values"].values()) == {"rank 0"}
    time = client.get(f"/api/graphs/{fwd}/overlays/time").json()
    assert time["values"] or time["note"], "no kernel→node mapping: an empty overlay that says why"


def test_diff_against_itself_and_across_kinds(client, graphs):
    fwd, dyn = graphs["aot_forward"]["id"], graphs["dynamo"]["id"]
    same = client.get(f"/api/graphs/{fwd}/diff/{fwd}").json()
    assert same["counts"]["changed"] == same["counts"]["added"] == same["counts"]["removed"] == 0
    d = client.get(f"/api/graphs/{fwd}/diff/{dyn}").json()
    n_fwd = len(client.get(f"/api/graphs/{fwd}/nodes").json())
    n_dyn = len(client.get(f"/api/graphs/{dyn}/nodes").json())
    c = d["counts"]
    assert c["same"] + c["changed"] + c["removed"] == n_fwd and c["same"] + c["changed"] + c["added"] == n_dyn
    marked = parse(client.get(f"/api/graphs/{fwd}/svg", params={"max_depth": 99, "diff_against": dyn}).text)
    classes = " ".join(g.get("class") for g in node_gs(marked).values())
    assert "diff-removed" in classes or "diff-changed" in classes


def test_forward_backward_counterparts_by_seq_nr(client, graphs):
    fwd, bwd = graphs["aot_forward"]["id"], graphs["aot_backward"]["id"]
    fw_nodes = client.get(f"/api/graphs/{fwd}/nodes").json()
    mm = next(n for n in fw_nodes if n["name"].startswith("addmm") or n["name"].startswith("mm"))
    cp = client.get(f"/api/graphs/{fwd}/nodes/{mm['name']}/counterparts").json()
    (side,) = cp["graphs"]
    assert side["id"] == bwd and side["kind"] == "aot_backward" and side["nodes"], cp
    back = client.get(f"/api/graphs/{bwd}/nodes/{side['nodes'][0]}/counterparts").json()
    assert mm["name"] in back["graphs"][0]["nodes"], "and back from the backward node"


def test_model_explorer_export(client, graphs):
    bwd = graphs["aot_backward"]["id"]
    me = client.get(f"/api/graphs/{bwd}/model-explorer").json()
    (g,) = me["graphs"]
    view = client.get(f"/api/graphs/{bwd}/view").json()
    assert [n["id"] for n in g["nodes"]] == [n["id"] for n in view["nodes"]]
    assert sum(len(n["incomingEdges"]) for n in g["nodes"]) == len(view["edges"])
    by_id = {n["id"]: n for n in view["nodes"]}
    assert all(n["namespace"] == (by_id[n["id"]]["namespace"] or "") for n in g["nodes"]), "namespace = module path"
    data = client.get(f"/api/graphs/{bwd}/model-explorer/node-data/bytes").json()
    assert set(data) == {g["id"]} and data[g["id"]]["results"] and data[g["id"]]["gradient"]


def test_python_api_draws_the_same_bytes_as_the_server(client, graphs, captured_store):
    from graphdeck.visualize import GraphVisualizer

    bwd = graphs["aot_backward"]["id"]
    vis = GraphVisualizer(captured_store, bwd)
    ours = vis.render(max_depth=1, filter_by_op=["mm"])
    served = client.get(f"/api/graphs/{bwd}/svg", params={"max_depth": 1, "filter_by_op": "mm"}).text
    assert ours == served, "one renderer: the notebook and the dashboard draw the same SVG"
    assert vis._repr_html_().count("<svg") == 1


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A captured store of the hostile model, plus a node whose args hold V2's characters."""
    path = tmp_path_factory.mktemp("hostile") / "hostile.db"
    run_python(HOSTILE_SCRIPT, str(path), EVIL, timeout_s=300)
    with sqlite3.connect(path) as db:
        gid = db.execute("select id from graphs where kind='aot_forward'").fetchone()[0]
        v2 = json.dumps({"args": ["{a|b}", "<c>", 'say "hi"\nbye'], "kwargs": {"d": {"k": "v|w"}}})
        db.execute("update nodes set args_json=? where graph_id=? and idx=(select max(idx) from nodes where "
                   "graph_id=? and op='call_function')", (v2, gid, gid))
    with LiveServer(path) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def test_v1_v3_v6_hostile_model_renders_escaped(hostile):
    gs = {g["kind"]: g for g in hostile.get("/api/runs/hostile").json()["graphs"]}
    for kind in ("dynamo", "aot_forward", "aot_backward"):
        gid = gs[kind]["id"]
        svg = hostile.get(f"/api/graphs/{gid}/svg", params={"max_depth": 99}).text
        assert "<script>" not in svg, f"{kind}: the module name is escaped"
        root = parse(svg)
        paths = [g.get("data-path") for g in root.iter(f"{SVG}g") if g.get("data-path")]
        assert any("<script>alert(1)<" in p for p in paths), f"{kind}: the hostile module is a cluster: {paths}"
        nodes = hostile.get(f"/api/graphs/{gid}/nodes").json()
        einsum = [n for n in nodes if "einsum" in (n["target"] or "") or n["name"].startswith("einsum")]
        if kind == "dynamo":
            assert einsum, "V1: the einsum node is captured"
            full = hostile.get(f"/api/graphs/{gid}/nodes/{einsum[0]['name']}").json()
            assert "bhqd,bhkd->bhqk" in json.dumps(full["args"]), "V1: the equation reads back intact"
            assert einsum[0]["name"] in node_gs(root)
        cat = [n for n in nodes if n["name"].startswith("cat")]
        if kind == "aot_forward":
            cat_in = hostile.get(f"/api/graphs/{gid}/nodes/{cat[0]['name']}").json()["inputs"]
            assert len(cat_in) == 40 and cat[0]["name"] in node_gs(root), "V6: a 40-input cat is drawn"


def test_v2_args_with_braces_pipes_quotes_and_newline(hostile):
    gid = next(g["id"] for g in hostile.get("/api/runs/hostile").json()["graphs"] if g["kind"] == "aot_forward")
    nodes = hostile.get(f"/api/graphs/{gid}/nodes").json()
    last = max((n for n in nodes if n["op"] == "call_function"), key=lambda n: n["idx"])
    full = hostile.get(f"/api/graphs/{gid}/nodes/{last['name']}").json()
    assert full["args"] == ["{a|b}", "<c>", 'say "hi"\nbye'] and full["kwargs"] == {"d": {"k": "v|w"}}
    parse(hostile.get(f"/api/graphs/{gid}/svg", params={"max_depth": 99}).text)  # valid XML


def test_v4_backward_nodes_without_a_module_join_a_neighbour(hostile):
    gid = next(g["id"] for g in hostile.get("/api/runs/hostile").json()["graphs"] if g["kind"] == "aot_backward")
    view = hostile.get(f"/api/graphs/{gid}/view").json()
    inferred = [n for n in view["nodes"] if n["namespace_from"]]
    assert inferred, "the backward graph has nodes with no module metadata (tangents, saved values)"
    assert all(n["namespace"] for n in inferred)
    assert all(n["namespace"] or n["op"] == "output" for n in view["nodes"]), "every node but the output joins a module"


def test_graph_diff_pairs_renamed_nodes_and_marks_inserted_and_changed():
    from graphdeck.analysis.graphs.diff import diff_views
    from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode, node_label, op_category

    def view(gid, spec):
        nodes = [ViewNode(id=n, idx=i, label=node_label(op, t), op=op, target=t, category=op_category(op, t), shape=shape)
                 for i, (n, op, t, shape) in enumerate(spec)]
        edges = [ViewEdge(src=spec[i][0], dst=spec[i + 1][0]) for i in range(len(spec) - 1)]
        return GraphView(graph_id=gid, name=str(gid), kind="dynamo", nodes=nodes, edges=edges)

    a = view(1, [("x", "placeholder", "x", [4]), ("mm", "call_function", "aten.mm.default", [4]),
                 ("relu", "call_function", "aten.relu.default", [4]), ("output", "output", "output", None)])
    b = view(2, [("x_1", "placeholder", "x_1", [4]), ("mm_1", "call_function", "aten.mm.default", [4]),
                 ("gelu", "call_function", "aten.gelu.default", [4]),
                 ("relu_1", "call_function", "aten.relu.default", [8]), ("output", "output", "output", None)])
    d = diff_views(a, b)
    assert d.added == ["gelu"] and d.removed == [], "the inserted op is added; renames pair up"
    pairs = {p.a: (p.b, p.changed) for p in d.pairs}
    assert pairs["mm"] == ("mm_1", []) and pairs["relu"] == ("relu_1", ["shape", "inputs"])
    assert d.marks_b() == {"gelu": "added", "relu_1": "changed"}, "output reads relu_1 = relu: unchanged"


def test_captured_graphs_lay_out_without_overlaps(client, graphs):
    from tests.test_svg import assert_layout_sane

    for kind in ("dynamo", "aot_forward", "aot_backward"):
        for depth in (0, 1, 2, 99):
            svg = client.get(f"/api/graphs/{graphs[kind]['id']}/svg", params={"max_depth": depth}).text
            assert_layout_sane(svg)
