"""The dashboard in a real browser: Debian Chromium driven by Playwright's sync API, over the real
app (``create_app``) served by uvicorn on a free 127.0.0.1 port, reading a real SQLite store.

Run with ``pytest -m browser tests/test_browser.py``. Skipped when ``/usr/bin/chromium`` (or the
trace corpus) is missing, except under ``CI=true``, where that is a failure. Screenshots of every
page land in ``/tmp/graphdeck-*.png`` for a human to look at.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, CHROMIUM_ARGS, LiveServer, require, shared_path  # noqa: F401

pytestmark = pytest.mark.browser

#: Under ../shared: HTA's sampled Kineto trace of rank 0 (a real profile, about 1 MB gzipped).
TRACE = ("data", "traces", "hta", "trace_filter", "sampled_rank-0.json.gz")
RUN_NAME = "tiny"
TIMEOUT_MS = 15_000
SHOTS = Path("/tmp")


@pytest.fixture(scope="module")
def store(captured_store: Path, tmp_path_factory) -> Path:
    """A private copy of the captured store: this module uploads a trace into it."""
    copy = tmp_path_factory.mktemp("browser") / "store.db"
    src, dst = sqlite3.connect(captured_store), sqlite3.connect(copy)
    try:
        src.backup(dst)  # the backup API also copies what still sits in the WAL
    finally:
        src.close()
        dst.close()
    return copy


@pytest.fixture(scope="module")
def base_url(store: Path):
    """The real app over HTTP (conftest's LiveServer: uvicorn in a thread on a free port)."""
    pytest.importorskip("uvicorn")
    with LiveServer(store) as server:
        yield server.url


@pytest.fixture(scope="module")
def uploaded_trace(base_url: str) -> dict:
    """Upload the HTA sample trace of rank 0 into run "tiny"; returns the server's answer."""
    trace = shared_path(*TRACE)
    import httpx

    with trace.open("rb") as fh:
        res = httpx.post(
            f"{base_url}/api/runs/{RUN_NAME}/traces",
            params={"rank": 0},
            files={"file": (trace.name, fh, "application/gzip")},
            headers={"X-Graphdeck-Client": "1"},
            timeout=60,
        )
    assert res.status_code in (200, 201), f"trace upload answered {res.status_code}: {res.text[:500]}"
    return res.json()




@pytest.fixture
def page(browser, request):
    """A fresh page; any console error or uncaught exception fails the test at teardown."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("dialog", lambda d: (problems.append(f"unexpected dialog: {d.message}"), d.dismiss()))
    yield pg
    context.close()
    assert not problems, "the page logged errors:\n" + "\n".join(problems)


#: JS: the FX name of the first node drawn wholly inside the viewer, preferring computing nodes.
_VISIBLE_COMPUTE_NODE = """() => {
  const host = document.querySelector("#graph-svg").getBoundingClientRect();
  const shown = [...document.querySelectorAll("#graph-svg g.node")].filter((g) => {
    const r = g.getBoundingClientRect();
    return r.width > 0 && r.left >= host.left && r.right <= host.right && r.top >= host.top && r.bottom <= host.bottom;
  });
  const compute = shown.filter((g) => !/cat-(placeholder|output|get_attr)/.test(g.getAttribute("class")));
  return (compute[0] || shown[0])?.dataset.name ?? null;
}"""


def _shot(pg, name: str) -> None:
    pg.screenshot(path=str(SHOTS / f"graphdeck-{name}.png"), full_page=True)


def _open_run(pg, base_url: str) -> None:
    pg.goto(f"{base_url}/")
    runs = pg.locator("#runs-table")
    runs.wait_for()
    _shot(pg, "runs")
    pg.locator("#runs-table a", has_text=RUN_NAME).first.click()
    pg.wait_for_url(lambda url: "#/runs/" in url)
    pg.get_by_test_id("details-open-all").click()  # closed under the overview (issue 23 item 2)
    pg.locator(".graphs-table").first.wait_for()


def test_run_page_lists_graphs_and_gradient_report(page, base_url):
    _open_run(page, base_url)
    kinds = set(page.locator(".graphs-table tr[data-kind]").evaluate_all("rows => rows.map(r => r.dataset.kind)"))
    assert {"dynamo", "aot_forward", "aot_backward"} <= kinds, f"run {RUN_NAME!r} captures these kinds, page shows {kinds}"
    report = page.locator("#grad-report")
    report.wait_for()
    rows = report.locator("tbody tr")
    assert rows.count() > 0, "one report row per rank/parameter of the tiny model"
    statuses = set(rows.locator(".badge.status").all_inner_texts())
    assert statuses <= {"OK", "NO_GRAD", "NOT_IN_GRAPH", "FROZEN"}, f"unknown statuses {statuses}"
    page.fill("#grad-filter", "no-such-parameter-name")
    assert page.locator("#grad-report tbody tr:visible").count() == 0, "filter hides every non-matching row"
    page.fill("#grad-filter", "")
    _shot(page, "run")


def test_run_page_shows_compile_records(page, base_url):
    _open_run(page, base_url)
    section = page.locator("#compile-records")
    table = section.locator('[data-testid="compile-metrics-rank-0"]')
    table.wait_for()
    rows = table.locator("tbody tr")
    assert rows.count() >= 1, "one compilation_metrics row per frame Dynamo compiled on rank 0"
    captured = table.locator("tbody tr.frame-graph")
    assert captured.count() >= 1, "the model's forward frame produced a graph (graph_op_count > 0)"
    ops = int(captured.first.get_attribute("data-ops"))
    assert ops > 0, f"a frame drawn as captured has ops, got {ops}"
    assert captured.first.locator('a[href^="#/graphs/"]').count() >= 1, "a captured frame links to its Dynamo graph"
    frame = captured.first.locator("td.frame").inner_text()
    assert "/" not in frame.split("\n")[0], f"the frame shows the file's basename only: {frame!r}"
    section.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "graphdeck-compile-records.png"), full_page=False)


def test_graph_page_selects_node_and_shows_details(page, base_url):
    _open_run(page, base_url)
    page.locator('.graphs-table tr[data-kind="dynamo"] td.name a').first.click()
    nodes = page.locator("#graph-svg svg g.node")
    nodes.first.wait_for()
    assert nodes.count() > 0, "the Dynamo graph of the tiny model has nodes"
    # A computing node (not a placeholder or the output) that the initial view shows.
    name = page.evaluate(_VISIBLE_COMPUTE_NODE)
    assert name, "the initial view shows at least one node"
    page.locator(f'#graph-svg g.node[data-name="{name}"]').click()
    details = page.locator("#node-details")
    details.locator('[data-testid="node-name"]').filter(has_text=name).wait_for()
    op = details.locator('[data-testid="node-op"]').inner_text()
    assert op in {"call_function", "call_method", "call_module", "placeholder", "get_attr", "output"}, op
    assert page.url.endswith(f"?node={name}") or f"node={name}" in page.url, "the URL holds the selected node"
    details.locator("#node-stack").or_(details.get_by_text("no stack trace recorded")).first.wait_for()
    assert page.locator(f'#graph-svg g.node.selected[data-name="{name}"]').count() == 1, "clicked node highlighted"
    crumbs = page.locator("#crumbs a").all_inner_texts()
    assert RUN_NAME in crumbs, f"the breadcrumb names the run from the graph JSON's run_name: {crumbs}"
    _shot(page, "graph")

    # Zoom buttons edit the viewBox; fit always comes back to the same whole-graph view.
    svg = page.locator("#graph-svg svg")
    page.click("#zoom-fit")
    fitted = svg.get_attribute("viewBox")
    page.click("#zoom-in")
    assert svg.get_attribute("viewBox") != fitted, "zoom in changes the viewBox"
    page.click("#zoom-fit")
    assert svg.get_attribute("viewBox") == fitted, "fit restores the whole-graph view"

    # Related graphs: the Dynamo graph links to its AOT forward/backward.
    related = page.locator("#related-graphs a")
    assert related.count() >= 1, "a Dynamo graph links to the graphs AOTAutograd traced from it"


def test_trace_page_renders_plotly_timeline(page, base_url, uploaded_trace):
    _open_run(page, base_url)
    trace_id = uploaded_trace["trace_id"]
    link = page.locator(f'[data-testid="traces-rank-0"] td:first-child a[href="#/traces/{trace_id}"]')
    assert link.count() == 1, f"rank 0 lists the uploaded trace {trace_id}; upload answered {uploaded_trace}"
    link.click()
    page.wait_for_url(f"**/#/traces/{trace_id}")
    page.locator("#timeline .main-svg").first.wait_for(timeout=30_000)
    assert page.locator("#trace-meta").count() == 1
    _shot(page, "trace")


def _graphs(base_url: str) -> list[dict]:
    import httpx

    res = httpx.get(f"{base_url}/api/runs/{RUN_NAME}", timeout=30)
    assert res.status_code == 200, f"run {RUN_NAME!r} answered {res.status_code}: {res.text[:300]}"
    return res.json()["graphs"]


def _open_graph(pg, base_url: str, graph_id: int) -> None:
    pg.goto(f"{base_url}/#/graphs/{graph_id}")
    pg.locator("#graph-svg svg g.node").first.wait_for()


#: JS: one element per kind of <g> in the SVG ("node", "node stub", "cluster ns", "edge", …), as
#: [kind, css selector of that element]; the ids are Graphviz's, unique in the document.
_G_KINDS = """() => {
  const seen = new Map();
  for (const g of document.querySelectorAll("#graph-svg svg g[class]")) {
    const kind = g.getAttribute("class").split(/\\s+/).filter((c) => !c.startsWith("cat-")).join(" ");
    if (!seen.has(kind) && g.id) seen.set(kind, `#graph-svg [id="${g.id}"]`);
  }
  return [...seen];
}"""

#: JS: the long-edge stubs: [{id, far: [names in the tooltip]}] (server/render/svg.py's markup).
_STUBS = """() => [...document.querySelectorAll("#graph-svg g.node.stub")].map((g) => ({
  id: g.id,
  far: (g.querySelector("a")?.getAttributeNS("http://www.w3.org/1999/xlink", "title") || "").split(/,\\s*/),
}))"""


def test_graph_page_clicks_on_every_kind_of_svg_element_never_error(page, base_url):
    graphs = [g for g in _graphs(base_url) if g["kind"] in ("dynamo", "aot_forward", "aot_backward")]
    assert graphs, f"run {RUN_NAME!r} has Dynamo and AOT graphs"
    stubs_seen = 0
    for graph in graphs:
        _open_graph(page, base_url, graph["id"])
        kinds = dict(page.evaluate(_G_KINDS))
        assert "node" in kinds and "edge" in kinds, f"graph {graph['id']} draws nodes and edges: {sorted(kinds)}"
        for kind, selector in kinds.items():
            page.locator(selector).dispatch_event("click")
            page.wait_for_timeout(50)
            errors = page.locator('[data-testid="error"]').all_inner_texts()
            assert not errors, f"graph {graph['id']}: a click on a <g class={kind!r}> showed {errors}"
        for stub in page.evaluate(_STUBS)[:3]:
            stubs_seen += 1
            page.goto(f"{base_url}/#/graphs/{graph['id']}")
            page.locator(f'#graph-svg [id="{stub["id"]}"]').wait_for(state="attached")
            page.locator(f'#graph-svg [id="{stub["id"]}"]').dispatch_event("click")
            if len(stub["far"]) == 1:
                page.wait_for_url(lambda url: "?node=" in url)
                target = page.url.split("?node=", 1)[1]
                assert target == stub["far"][0], f"a stub naming one node selects it: {stub} → {page.url}"
                page.locator('[data-testid="node-name"]').filter(has_text=stub["far"][0]).wait_for()
            else:
                listed = page.locator("#search-results button").all_inner_texts()
                assert listed and set(listed) <= set(stub["far"]), f"a stub naming several nodes lists them: {stub} → {listed}"
            assert page.locator('[data-testid="error"]').count() == 0, f"clicking stub {stub} showed an error"
    if stubs_seen:
        _shot(page, "graph-stub")


def test_graph_search_list_closes(page, base_url):
    graph = next(g for g in _graphs(base_url) if g["kind"] == "aot_forward")
    _open_graph(page, base_url, graph["id"])
    results = page.locator("#search-results")
    search = page.locator("#node-search")

    search.fill("view")
    assert results.is_visible(), "typing a query opens the result list"
    search.press("Enter")
    page.wait_for_url(lambda url: "?node=" in url)
    assert results.is_hidden(), "Enter selects the first hit and closes the list (it covered the graph)"

    search.fill("add")
    assert results.is_visible()
    search.press("Escape")
    assert results.is_hidden() and search.input_value() == "", "Escape clears the query and closes the list"

    search.fill("add")
    assert results.is_visible()
    page.locator("h1").click()
    assert results.is_hidden(), "a click outside the list and the search box closes it"

    search.click()
    assert results.is_visible(), "focusing the search box with a query in it reopens the list"
    first = results.locator("button").first
    name = first.inner_text()
    first.click()
    page.locator('[data-testid="node-name"]').filter(has_text=name).wait_for()
    assert results.is_hidden(), "picking a result closes the list"


def test_related_graphs_list_parent_and_siblings(page, base_url):
    graphs = _graphs(base_url)
    by_parent: dict[int, list[dict]] = {}
    for g in graphs:
        if g.get("parent_id") is not None:
            by_parent.setdefault(g["parent_id"], []).append(g)
    pairs = [(p, kids) for p, kids in by_parent.items()
             if {"aot_forward", "aot_backward"} <= {k["kind"] for k in kids}]
    assert pairs, f"AOTAutograd traced a forward and a backward from one Dynamo graph: {graphs}"
    parent_id, kids = pairs[0]
    forward = next(k for k in kids if k["kind"] == "aot_forward")
    backward = next(k for k in kids if k["kind"] == "aot_backward")
    for here, other in ((forward, backward), (backward, forward)):
        _open_graph(page, base_url, here["id"])
        related = page.locator("#related-graphs")
        related.locator(f'li[data-relation="parent"] a[href="#/graphs/{parent_id}"]').wait_for()
        sibling = related.locator(f'li[data-relation="sibling"] a[href="#/graphs/{other["id"]}"]')
        sibling.wait_for()
        assert related.locator(f'li[data-relation="sibling"] a[href="#/graphs/{here["id"]}"]').count() == 0, \
            "a graph is not listed as its own sibling"
    related.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "graphdeck-related.png"), full_page=False)
