"""Every JSON/SVG endpoint over HTTP: the real app served by uvicorn over a store made by a real
capture (``captured_store``), read with httpx."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def api(captured_store):
    with LiveServer(captured_store) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def run(api) -> dict:
    return api.get("/api/runs/tiny").json()


def assert_error_shape(resp: httpx.Response, status: int) -> dict:
    body = resp.json()
    assert resp.status_code == status and body["ok"] is False and body["status"] == status, body
    assert isinstance(body["error"], str) and body["error"], "errors name the problem"
    return body


def test_runs_list_and_run_by_name_or_id(api, run):
    runs = api.get("/api/runs").json()
    assert [r["name"] for r in runs] == ["tiny"]
    assert runs[0]["num_ranks"] == 1 and runs[0]["num_graphs"] == len(run["graphs"]) >= 3
    assert api.get(f"/api/runs/{run['id']}").json()["name"] == "tiny", "a run is reached by id and by name"
    assert [r["rank"] for r in run["ranks"]] == [0]
    assert {g["kind"] for g in run["graphs"]} == {"dynamo", "aot_forward", "aot_backward"}
    assert len(run["traces"]) == 1 and run["traces"][0]["num_events"] > 0
    assert api.get("/api/runs/tiny/ranks").json()[0]["world_size"] == 1
    bw = api.get("/api/runs/tiny/graphs", params={"kind": "aot_backward"}).json()
    assert bw and all(g["kind"] == "aot_backward" for g in bw)


def test_graph_nodes_and_node_details(api, run):
    dyn = next(g for g in run["graphs"] if g["kind"] == "dynamo")
    graph = api.get(f"/api/graphs/{dyn['id']}").json()
    assert {c["kind"] for c in graph["children"]} == {"aot_forward", "aot_backward"}
    assert "def forward" in graph["code"] and graph["run_name"] == "tiny"
    assert any(b["param_fqn"] == "transformer.wte.weight" for b in graph["io"])
    nodes = api.get(f"/api/graphs/{dyn['id']}/nodes").json()
    assert len(nodes) == dyn["num_nodes"] and [n["idx"] for n in nodes] == list(range(len(nodes)))
    emb = next(n for n in nodes if n["op"] == "call_function" and "embedding" in n["target"])
    detail = api.get(f"/api/graphs/{dyn['id']}/nodes/{emb['name']}").json()
    assert detail["module_path"] == "transformer/wte", detail["module_path"]
    assert detail["shape"] == [2, 16, 32] and detail["dtype"] == "float32"
    assert "modeling_gpt2.py" in detail["stack_trace"], "the node's stack_trace names the user's source"
    assert detail["inputs"] and detail["users"], "edges give inputs and users"


def test_backward_graph_binds_gradients(api, run):
    bw = next(g for g in run["graphs"] if g["kind"] == "aot_backward")
    graph = api.get(f"/api/graphs/{bw['id']}").json()
    grads = [b for b in graph["io"] if b["direction"] == "grad"]
    assert grads and all(b["has_grad"] for b in grads)
    assert any("GradAOTOutput" in (b["desc"] or "") for b in grads)
    nodes = api.get(f"/api/graphs/{bw['id']}/nodes").json()
    assert any(n["seq_nr"] is not None for n in nodes)


def test_svg_and_its_json_twin(api, run):
    fw = next(g for g in run["graphs"] if g["kind"] == "aot_forward")
    resp = api.get(f"/api/graphs/{fw['id']}/svg")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("image/svg+xml")
    svg = resp.text
    assert svg.count('class="node') >= fw["num_nodes"] * 0.5, "most nodes are drawn"
    assert "viewBox" in svg and 'id="node&#45;0"' in svg or 'id="node-0"' in svg
    assert "cluster" in svg, "nodes are clustered by module path"
    view = api.get(f"/api/graphs/{fw['id']}/view").json()
    assert len(view["nodes"]) == fw["num_nodes"] and view["edges"]
    assert api.get(f"/api/graphs/{fw['id']}/svg").text == svg, "same graph, same bytes"


def test_gradient_report_and_compile_events(api):
    rep = api.get("/api/runs/tiny/gradients").json()
    assert rep["ok"] is True and rep["summary"]["OK"] == len(rep["params"]) > 0
    wte = next(p for p in rep["params"] if p["fqn"] == "transformer.wte.weight")
    assert sorted(wte["aliases"]) == ["lm_head.weight", "transformer.wte.weight"] and wte["paths"] == 2
    events = api.get("/api/runs/tiny/compile-events").json()
    assert any(e["name"] == "compilation_metrics" and e["fields"].get("co_name") for e in events)


def test_trace_and_timeline(api, run):
    trace = run["traces"][0]
    meta = api.get(f"/api/traces/{trace['id']}").json()
    assert meta["status"] == "ok" and meta["rank"] == 0
    fig = api.get(f"/api/traces/{trace['id']}/timeline").json()
    assert fig["data"] and "layout" in fig
    assert sum(len(d.get("x") or []) for d in fig["data"]) > 0


def test_errors_have_one_shape(api):
    assert_error_shape(api.get("/api/runs/nope"), 404)
    assert_error_shape(api.get("/api/graphs/999999"), 404)
    assert_error_shape(api.get("/api/graphs/999999/svg"), 404)
    assert_error_shape(api.get("/api/traces/999999"), 404)
    assert_error_shape(api.get("/api/graphs/1/nodes/no_such_node"), 404)
    assert_error_shape(api.get("/api/graphs/not-a-number"), 422)
    assert_error_shape(api.get("/api/no/such/route"), 404)


def test_openapi_lists_every_route_and_dashboard_is_served(api):
    paths = set(api.get("/openapi.json").json()["paths"])
    for p in ("/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/graphs", "/api/graphs/{graph_id}/svg",
              "/api/graphs/{graph_id}/nodes/{node_name}", "/api/traces/{trace_id}/timeline",
              "/api/runs/{run_name}/traces", "/api/runs/{run_id}/gradients"):
        assert p in paths, p
    index = api.get("/")
    assert index.status_code == 200 and "<html" in index.text.lower()
    assert api.get("/static/vendor/plotly.min.js").status_code == 200, "plotly.js served locally, no CDN"


def test_query_parameters_filter_and_validate(api, run):
    assert [g["rank"] for g in api.get("/api/runs/tiny/graphs", params={"rank": 0}).json()] == \
        [g["rank"] for g in run["graphs"]], "rank 0 holds every graph of a 1-process run"
    assert api.get("/api/runs/tiny/graphs", params={"rank": 5}).json() == [], "no such rank: an empty list, not 404"
    dyn = next(g for g in run["graphs"] if g["kind"] == "dynamo")
    flat = api.get(f"/api/graphs/{dyn['id']}/svg", params={"max_depth": 0}).text
    assert 'class="cluster open' not in flat, "max_depth=0 opens no module cluster (top-level ones are boxes)"
    body = assert_error_shape(api.get(f"/api/graphs/{dyn['id']}/svg", params={"max_depth": -1}), 422)
    assert body["problems"][0]["loc"] == ["query", "max_depth"], body
    assert_error_shape(api.get("/api/runs/tiny/graphs", params={"rank": "x"}), 422)
    assert_error_shape(api.post("/api/runs"), 405)


# A store written row by row with the schema (no capture), for text no real model produces.
EVIL = "<script>alert(1)</script>"
QUOTES = "a&b\"c'd"
NODE = "<img src=x onerror=\"alert(1)\">&'"  # a node name has no '/': it is one URL path segment


def build_hostile_store(path) -> None:
    """Run ``<b>r</b>``: one graph ``x → NODE (in module EVIL/QUOTES) → output``."""
    import json

    from graphdeck.store.db import Interner, get_or_create_rank, get_or_create_run, open_engine, write_session
    from graphdeck.store.schema import Edge, Graph, Node

    engine = open_engine(path)
    with write_session(engine) as s:
        intern = Interner(s)
        run = get_or_create_run(s, "<b>r</b>", world_size=1)
        get_or_create_rank(s, run, 0, world_size=1, hostname=EVIL)
        graph = Graph(run_id=run.id, rank=0, ordinal=0, kind="dynamo", name=EVIL, num_nodes=3, code="# " + EVIL)
        s.add(graph)
        s.flush()
        rows = [("x", "placeholder", "x", None), (NODE, "call_function", f"aten.{QUOTES}.default", f"{EVIL}/{QUOTES}"),
                ("output", "output", "output", None)]
        for idx, (name, op, target, module_path) in enumerate(rows):
            s.add(Node(graph_id=graph.id, idx=idx, name=name, op=op, target_id=intern(target),
                       module_path_id=intern(module_path), shape_json=json.dumps([2, 3]), dtype="torch.float32",
                       args_json=json.dumps([QUOTES])))
        s.add_all([Edge(graph_id=graph.id, src_idx=0, dst_idx=1), Edge(graph_id=graph.id, src_idx=1, dst_idx=2)])
    engine.dispose()


def test_text_from_user_code_is_escaped_end_to_end(tmp_path):
    import xml.etree.ElementTree as ET
    from urllib.parse import quote

    store = tmp_path / "hostile.db"
    build_hostile_store(store)
    with LiveServer(store) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        (run,) = client.get("/api/runs").json()
        assert run["name"] == "<b>r</b>", "a name with '/' is reached by the run's id"
        (graph,) = client.get(f"/api/runs/{run['id']}/graphs").json()
        svg = client.get(f"/api/graphs/{graph['id']}/svg").text
        assert "<script" not in svg and "<img" not in svg and "<b>" not in svg, "user text reaches the SVG escaped"
        root = ET.fromstring(svg.encode())  # well-formed: quotes and ampersands are escaped too
        names = [g.get("data-name") for g in root.iter("{http://www.w3.org/2000/svg}g")]
        titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
        assert NODE in names and EVIL in titles, "…and reads back exactly once decoded"
        view = client.get(f"/api/graphs/{graph['id']}/view").json()
        assert [n["id"] for n in view["nodes"]] == ["x", NODE, "output"] and view["nodes"][1]["namespace"] == f"{EVIL}/{QUOTES}"
        node = client.get(f"/api/graphs/{graph['id']}/nodes/{quote(NODE, safe='')}")
        assert node.status_code == 200 and node.json()["name"] == NODE and node.json()["inputs"] == ["x"], node.text


def test_docs_are_served_without_a_cdn(api):
    page = api.get("/docs")
    assert page.status_code == 200 and "cdn" not in page.text.lower(), "offline machines get working docs"
    assert "/static/swagger/swagger-ui-bundle.js" in page.text
    assert api.get("/static/swagger/swagger-ui-bundle.js").status_code == 200
