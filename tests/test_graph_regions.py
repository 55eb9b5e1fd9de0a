"""Graph view of issue 20 item 4: activation-checkpoint and autocast regions drawn as labelled boxes
holding the right nodes (a real torch.compile, aot_eager, in this process, captured by the Agent
into a temporary SQLite store, served by the real app over HTTP), and the ``partition`` overlay
on the N-D parallel stores of ``tests/nd_fixtures.py`` (TP collectives by mesh dimension, FSDP2
groups, pipeline stages).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from graphdeck.capture import Agent
from tests.conftest import LiveServer
from tests.nd_fixtures import nd_fsdp_tp_store, nd_pipeline_store  # noqa: F401

SVG = "{http://www.w3.org/2000/svg}"
EVIL = "<script>alert(1)</script>"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(torch.nn.Module):
    """layers.0 plain, layers.1 checkpointed, layers.2 under autocast(cpu, bfloat16), and a block
    named with a script tag, checkpointed too."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block(), Block()])
        self.add_module(EVIL, Block())

    def forward(self, x):
        x = self.layers[0](x)
        x = checkpoint(self.layers[1], x, use_reentrant=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.layers[2](x)
        x = checkpoint(getattr(self, EVIL), x.float(), use_reentrant=False)
        return x.sum()


@pytest.fixture(scope="module")
def regions_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("regions") / "regions.db"
    torch._dynamo.reset()
    torch.manual_seed(0)
    agent = Agent(store=path, run="regions")
    model = agent.watch(Net())
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    compiled(torch.randn(4, 8, requires_grad=True)).backward()
    agent.close()
    torch._dynamo.reset()
    return path


@pytest.fixture(scope="module")
def server(regions_store):
    with LiveServer(regions_store) as live:
        yield live.url


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def graphs(client) -> dict[str, int]:
    rows = client.get("/api/runs/regions").json()["graphs"]
    by_kind = {g["kind"]: g["id"] for g in rows}
    assert set(by_kind) == {"dynamo", "aot_forward", "aot_backward"}, rows
    return by_kind


def boxes(svg: str) -> tuple[dict[str, tuple], dict[str, tuple], ET.Element]:
    """(region label → (x, y, w, h, <g>), node name → (x, y, w, h), root) of a rendered SVG."""
    root = ET.fromstring(svg.encode("utf-8"))
    regions, nodes = {}, {}
    for g in root.iter(f"{SVG}g"):
        cls = (g.get("class") or "").split()
        rect = g.find(f"{SVG}rect")
        if rect is None:
            continue
        box = tuple(float(rect.get(k)) for k in ("x", "y", "width", "height"))
        if "region" in cls:
            regions[g.get("data-label")] = (*box, g)
        elif "node" in cls and g.get("data-name"):
            nodes[g.get("data-name")] = box
    return regions, nodes, root


def inside(node: tuple, box: tuple) -> bool:
    x, y, w, h = node
    bx, by, bw, bh = box[:4]
    return bx <= x and by <= y and x + w <= bx + bw and y + h <= by + bh


def region_json(client, gid: int) -> dict[str, dict]:
    return {r["label"]: r for r in client.get(f"/api/graphs/{gid}/regions").json()["regions"]}


def test_dynamo_graph_boxes_autocast_and_checkpoint_regions(client, graphs):
    gid = graphs["dynamo"]
    regions = region_json(client, gid)
    auto = regions["autocast cpu bfloat16"]
    nodes = {n["name"]: n for n in client.get(f"/api/graphs/{gid}/nodes").json()}
    in_layer2 = {n for n, v in nodes.items() if (v["module_path"] or "").startswith("layers/2") and v["op"] != "placeholder"}
    assert in_layer2 and in_layer2 <= set(auto["nodes"]), (in_layer2, auto)
    assert {"_enter_autocast", "_exit_autocast"} <= set(auto["nodes"])
    assert not any((nodes[n]["module_path"] or "").startswith(("layers/0", "layers/1")) for n in auto["nodes"])
    ck = regions["activation checkpoint: layers.1"]
    hops = [n for n in ck["nodes"] if nodes[n]["target"].endswith("tag_activation_checkpoint")]
    assert len(hops) == 1, ck
    assert "body wrap_body_" in ck["detail"] and "linear" in ck["detail"] and "relu" in ck["detail"], ck["detail"]
    evil = next(r for label, r in regions.items() if label.startswith("activation checkpoint: <script>"))
    assert evil["kind"] == "activation_checkpoint" and evil is not ck

    svg = client.get(f"/api/graphs/{gid}/svg", params={"max_depth": 99}).text
    assert "<script>" not in svg, "user strings are escaped"
    drawn, at, _root = boxes(svg)
    for label, region in regions.items():
        assert label in drawn, (label, list(drawn))
        assert drawn[label][4].get("data-path") == region["path"]
        assert drawn[label][4].get("data-region") == region["kind"]
        for name in region["nodes"]:
            assert inside(at[name], drawn[label]), (name, label)
    outside = [n for n in at if n not in auto["nodes"] and nodes[n]["op"] != "placeholder"
               and not (nodes[n]["module_path"] or "").startswith("layers/2")]
    assert outside and not any(inside(at[n], drawn["autocast cpu bfloat16"]) for n in outside)
    assert not any(inside(at[n], drawn["activation checkpoint: layers.1"]) for n in auto["nodes"])

    closed = client.get(f"/api/graphs/{gid}/svg", params={"max_depth": 99, "collapse": auto["path"]}).text
    _drawn, at_closed, root = boxes(closed)
    box = next(g for g in root.iter(f"{SVG}g") if g.get("data-path") == auto["path"])
    assert "collapsed" in box.get("class").split() and "region" in box.get("class").split()
    assert "autocast cpu bfloat16" in "".join(box.itertext())
    assert not set(auto["nodes"]) & set(at_closed), "a collapsed region hides its nodes"


def test_aot_forward_boxes_the_checkpointed_ops(client, graphs):
    gid = graphs["aot_forward"]
    regions = region_json(client, gid)
    assert not any(label.startswith("autocast") for label in regions), "AOT graphs keep no autocast region"
    ck = regions["activation checkpoint: layers.1"]
    nodes = {n["name"]: n for n in client.get(f"/api/graphs/{gid}/nodes").json()}
    ops = {nodes[n]["target"] for n in ck["nodes"]}
    assert {"aten.addmm.default", "aten.relu.default"} <= ops, ops
    assert all((nodes[n]["module_path"] or "").startswith("layers/1") for n in ck["nodes"])
    assert not any((v["module_path"] or "").startswith("layers/1") and v["op"] == "call_function"
                   and n not in ck["nodes"] for n, v in nodes.items()), "every op of layers.1 is in the box"
    evil = [label for label in regions if label.startswith("activation checkpoint: <script>")]
    assert len(evil) == 1, regions
    drawn, at, _root = boxes(client.get(f"/api/graphs/{gid}/svg", params={"max_depth": 99}).text)
    assert all(inside(at[n], drawn[ck["label"]]) for n in ck["nodes"])
    assert not any(inside(at[n], drawn[ck["label"]]) for n in regions[evil[0]]["nodes"])


def test_aot_backward_boxes_the_recomputed_ops(client, graphs):
    gid = graphs["aot_backward"]
    regions = region_json(client, gid)
    rec = regions["activation checkpoint (recomputed): layers.1"]
    assert rec["kind"] == "activation_checkpoint_recomputed"
    nodes = {n["name"]: n for n in client.get(f"/api/graphs/{gid}/nodes").json()}
    assert all(nodes[n]["partitioner_tag"] == "is_forward" for n in rec["nodes"]), "forward ops, run again"
    assert "aten.addmm.default" in {nodes[n]["target"] for n in rec["nodes"]}
    svg = client.get(f"/api/graphs/{gid}/svg", params={"max_depth": 99}).text
    drawn, at, root = boxes(svg)
    box = drawn[rec["label"]]
    assert all(inside(at[n], box) for n in rec["nodes"])
    classes = {g.get("data-name"): g.get("class").split() for g in root.iter(f"{SVG}g") if g.get("data-name")}
    assert all("recomputed" in classes[n] for n in rec["nodes"])
    assert any(label.startswith("activation checkpoint (recomputed): <script>") for label in regions)
    assert client.get("/api/graphs/999999/regions").status_code == 404


@pytest.mark.browser
def test_region_box_in_the_browser_closes_and_opens_for_a_hidden_node(browser, server, graphs):
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("dialog", lambda d: (problems.append(f"a script ran: {d.message}"), d.dismiss()))
    page.goto(f"{server}/#/graphs/{graphs['dynamo']}?depth=99")
    box = page.locator('#graph-svg g.cluster.open.region[data-label="autocast cpu bfloat16"]')
    box.wait_for()
    path = box.get_attribute("data-path")
    assert "autocast cpu bfloat16" in box.text_content()
    assert page.locator('#graph-svg g.cluster.region[data-region="activation_checkpoint"]').count() == 2
    box.locator("text").dispatch_event("click")  # the label closes the box, the URL keeps it
    page.locator(f'#graph-svg g.cluster.collapsed.region[data-path="{path}"]').wait_for()
    assert page.locator('#graph-svg g.node[data-name="linear_1"]').count() == 0
    assert path in parse_qs(urlparse(page.url.replace("#/", "/", 1)).query).get("collapse", [])
    page.fill("#node-search", "linear_1")
    page.press("#node-search", "Enter")
    page.locator('#graph-svg g.node.selected[data-name="linear_1"]').wait_for()  # the box opened again
    context.close()
    assert not problems, problems


# ---------------------------------------------------------------------------- N-D parallel stores


@pytest.mark.slow
def test_partition_overlay_labels_tp_collectives_and_fsdp2_groups(nd_fsdp_tp_store):  # noqa: F811
    with LiveServer(nd_fsdp_tp_store) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        run = c.get("/api/runs/nd_fsdp_tp").json()
        rows, layout = run["graphs"], c.get(f"/api/runs/{run['id']}/layout").json()
        aot = [g for g in rows if g["kind"] in ("aot_forward", "aot_backward")]
        assert {g["rank"] for g in aot} == {0, 1, 2, 3}, "every rank has its AOT graphs"
        seen_tp = seen_fsdp = 0
        for g in aot:
            ov = c.get(f"/api/graphs/{g['id']}/overlays/partition").json()
            nodes = {n["name"]: n for n in c.get(f"/api/graphs/{g['id']}/nodes").json()}
            comm = [n for n, v in nodes.items() if (v["target"] or "").startswith("_c10d_functional.")]
            assert comm, f"DTensor's collectives are on graph {g['id']}"
            assert all(ov["values"].get(n) == "tp collective" for n in comm), (g["id"], ov)
            record = layout["records"][str(g["rank"])]
            tp_group = next(d["name"] for m in record["meshes"] for d in m["dim_groups"] if d["dim"] == "tp")
            groups = {next(a for a in reversed(c.get(f"/api/graphs/{g['id']}/nodes/{n}").json()["args"])
                           if isinstance(a, str)) for n in comm if not nodes[n]["target"].startswith(
                               "_c10d_functional.wait_tensor")}
            assert groups == {tp_group}, "labelled by the layout's process group of the tp dimension"
            seen_tp += len(comm)
            fsdp = {n: v for n, v in ov["values"].items() if v.startswith("fsdp ")}
            params = [n for n, v in nodes.items() if v["param_fqn"]]
            assert params and all(fsdp.get(n) == "fsdp " + ".".join(nodes[n]["param_fqn"].split(".")[:2])
                                  for n in params), (g["id"], fsdp)
            assert any(nodes[n]["op"] == "call_function" for n in fsdp), "the ops reading a group's parameters"
            seen_fsdp += len(fsdp)
            svg = c.get(f"/api/graphs/{g['id']}/svg", params={"overlay": "partition", "max_depth": 99}).text
            legend = "".join(ET.fromstring(svg.encode()).find(f".//{SVG}text[@class='overlay-legend']").itertext())
            assert "tp collective" in legend and "fsdp blocks." in legend, legend
        assert seen_tp >= 16 and seen_fsdp
        ck = [r for g in aot for r in c.get(f"/api/graphs/{g['id']}/regions").json()["regions"]]
        assert {r["label"] for r in ck} >= {"activation checkpoint: blocks.1",
                                            "activation checkpoint (recomputed): blocks.1"}, ck


@pytest.mark.slow
def test_partition_overlay_labels_pipeline_stage_graphs(nd_pipeline_store):  # noqa: F811
    with LiveServer(nd_pipeline_store) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        run = c.get("/api/runs/nd_pipeline").json()
        layout = c.get(f"/api/runs/{run['id']}/layout").json()
        graphs = [g for g in run["graphs"] if g["kind"] in ("dynamo", "aot_forward", "aot_backward")]
        assert {g["rank"] for g in graphs} == {0, 1}
        for g in graphs:
            stage = layout["stages"][str(g["rank"])]
            assert stage == g["rank"], layout["stages"]
            ov = c.get(f"/api/graphs/{g['id']}/overlays/partition").json()
            assert ov["label"].startswith(f"pipeline stage {stage} of 2"), ov
            nodes = {n["name"]: n for n in c.get(f"/api/graphs/{g['id']}/nodes").json()}
            assert ov["values"]["output"] == f"stage {stage} output"
            boundary = [n for n, v in ov["values"].items() if v == f"stage {stage} input"]
            assert boundary and all(nodes[n]["op"] == "placeholder" and not nodes[n]["param_fqn"] for n in boundary)
            if g["kind"] == "aot_backward":
                assert all("Tangent" in (nodes[n]["desc"] or "") for n in boundary), "the gradient from the next stage"
            svg = c.get(f"/api/graphs/{g['id']}/svg", params={"overlay": "partition"}).text
            assert f"pipeline stage {stage} of 2" in svg


# ---------------------------------------------------------------------------- pure parts


def test_group_dims_prefer_the_ranks_layout_then_others_then_mesh_names():
    from graphdeck.analysis.parallel.layout import build_layout
    from graphdeck.analysis.parallel.partition import group_dims, norm_fqn
    from tests.nd_fixtures import layout_record

    layout = build_layout({r: layout_record(r) for r in (0, 1)}, 4)
    dims = group_dims(layout, 1, {"groups": [{"name": "7", "desc": "mesh_cp"}, {"name": "pg_tp_0_1", "desc": "x"}]})
    assert dims["pg_tp_0_1"] == "tp" and dims["pg_dp_0_2"] == "dp" and dims["pg_dp_1_3"] == "dp"
    assert dims["7"] == "cp", "a DeviceMesh's group description names its dimension when no layout does"
    assert group_dims(None, 0, {}) == {}
    assert norm_fqn("blocks.1._checkpoint_wrapped_module.w1.weight") == "blocks.1.w1.weight"


def test_nested_regions_are_boxes_inside_boxes():
    from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode
    from graphdeck.analysis.parallel.regions import Region
    from graphdeck.server.render.regions import apply_regions
    from graphdeck.server.render.svg import render_graph_svg

    def node(i, name, ns, op="call_function"):
        return ViewNode(id=name, idx=i, label=name, op=op, target=f"aten.{name}.default", category="other",
                        namespace=ns)

    view = GraphView(graph_id=1, name="g", kind="aot_forward", nodes=[
        node(0, "x", None, "placeholder"), node(1, "a", "blk"), node(2, "b", "blk/inner"), node(3, "c", "blk/inner"),
        node(4, "d", None), node(5, "output", None, "output")],
        edges=[ViewEdge(src=s, dst=d) for s, d in (("x", "a"), ("a", "b"), ("b", "c"), ("c", "d"), ("d", "output"))])
    outer = Region("autocast", f"autocast {EVIL}", ["a", "b", "c", "d"])
    inner = Region("activation_checkpoint", "activation checkpoint: blk.inner", ["b", "c"])
    twin = Region("activation_checkpoint", "activation checkpoint: blk.inner", ["d"])
    out = apply_regions(view, [outer, inner, twin])
    paths = {r.label + str(i): r.path for i, r in enumerate(out.regions)}
    seg = "\u27e8autocast <script>alert(1)<\u2215script>\u27e9"
    assert paths[f"autocast {EVIL}0"] == seg
    assert paths["activation checkpoint: blk.inner1"] == f"{seg}/blk/\u27e8activation checkpoint: blk.inner\u27e9"
    assert paths["activation checkpoint: blk.inner2"].startswith(seg + "/"), "inside the autocast box"
    assert {n.id: n.namespace for n in out.nodes}["output"] is None
    svg = render_graph_svg(out, max_depth=99)
    assert "<script>" not in svg and svg.count('class="cluster open region') == 3
    assert ET.fromstring(svg.encode()).find(f".//{SVG}g[@data-region='autocast']").get("data-label") == f"autocast {EVIL}"


def test_partition_overlay_on_recorded_fsdp2_and_ddp_stores(tmp_path):
    """The H200 stores (tests/data): FSDP2 groups from the communication-group record (no layout
    record: captured before it existed), DDP buckets as before."""
    import gzip
    from pathlib import Path

    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from graphdeck.analysis.parallel.overlays import graph_overlay
    from graphdeck.store.db import open_engine

    data = Path(__file__).parent / "data"
    for name, src in (("fsdp2", data / "fsdp2_h200x2" / "fsdp2.db.gz"), ("ddp", data / "ddp_h200x2" / "ddp.db.gz")):
        path = tmp_path / f"{name}.db"
        with gzip.open(src) as fin, open(path, "wb") as fout:
            fout.write(fin.read())
        engine = open_engine(path, read_only=True)
        with Session(engine) as s:
            if name == "fsdp2":
                fwd = s.execute(text("SELECT id FROM graphs WHERE kind = 'aot_forward' ORDER BY id")).scalars().all()
                assert fwd
                for gid in fwd:
                    ov = graph_overlay(s, gid, "partition")
                    params = dict(s.execute(text("SELECT name, param_fqn FROM nodes WHERE graph_id = :g AND "
                                                 "param_fqn IS NOT NULL"), {"g": gid}).all())
                    want = {n: "fsdp " + (".".join(f.split(".")[:3]) if f.startswith("transformer.h.") else "(root)")
                            for n, f in params.items()}
                    assert params and all(ov.values[n] == w for n, w in want.items()), ov
                    assert "FSDP2 group" in ov.note and ov.label is None
            else:
                split = s.execute(text("SELECT DISTINCT parent_graph_id FROM partitions")).scalar()
                values = set(graph_overlay(s, split, "partition").values.values())
                assert {"bucket 0", "bucket 1"} <= values and not any(v.startswith(("fsdp", "stage")) for v in values)
        engine.dispose()
