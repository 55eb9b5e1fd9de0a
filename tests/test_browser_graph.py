"""The graph view in a real browser (Chromium via Playwright) over the real app and the captured
tiny GPT-2 store: expand/collapse, filter, search into a collapsed cluster, node details with
inputs/users, forward↔backward jump by seq_nr, URL round trip, the diff page, hostile names.

Run with ``pytest -m browser tests/test_browser_graph.py``; setup as in ``tests/test_browser.py``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from tests.conftest import LiveServer
from tests.test_browser import TIMEOUT_MS

pytestmark = pytest.mark.browser
EVIL_MODULE = "<script>alert(1)</script>"
EVIL_STACK = '"><img src=x onerror=alert(1)>'


@pytest.fixture(scope="module")
def store(captured_store: Path, tmp_path_factory) -> Path:
    """A copy of the captured store in which one backward node's module path holds a script tag
    and one stack trace an onerror attribute (case V3), as a hostile model would make them."""
    copy = tmp_path_factory.mktemp("browser-graph") / "store.db"
    src, dst = sqlite3.connect(captured_store), sqlite3.connect(copy)
    src.backup(dst)
    src.close()
    bw = dst.execute("select id from graphs where kind='aot_backward' order by num_nodes desc").fetchone()[0]
    sid = dst.execute("insert into strings(value) values (?)", (f"transformer/{EVIL_MODULE}",)).lastrowid
    tid = dst.execute("insert into strings(value) values (?)", (f"File x.py, line 1\n{EVIL_STACK}",)).lastrowid
    dst.execute("update nodes set module_path_id=?, stack_trace_id=? where graph_id=? and idx=(select max(idx) from nodes "
                "where graph_id=? and op='call_function')", (sid, tid, bw, bw))
    dst.commit()
    dst.close()
    return copy


@pytest.fixture(scope="module")
def server(store: Path):
    with LiveServer(store) as live:
        yield live.url


@pytest.fixture(scope="module")
def graphs(server) -> dict[str, dict]:
    all_graphs = httpx.get(f"{server}/api/runs/tiny", timeout=30).json()["graphs"]
    by_kind = {}
    for g in sorted(all_graphs, key=lambda g: -g["num_nodes"]):
        by_kind.setdefault(g["kind"], g)
    return by_kind




@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    # a 400 the test asked for (a bad filter regex) is logged by the browser; the page must show it
    expected = "the server responded with a status of 400"
    pg.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}")
          if m.type == "error" and expected not in m.text else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("dialog", lambda d: (problems.append(f"dialog (a script ran!): {d.message}"), d.dismiss()))
    yield pg
    context.close()
    assert not problems, "the page logged errors:\n" + "\n".join(problems)


def _query(pg) -> dict[str, list[str]]:
    return parse_qs(urlparse(pg.url.replace("#/", "/", 1)).query)


def _wait_nodes(pg) -> None:
    pg.locator("#graph-svg svg g.node").first.wait_for()


def test_expand_and_collapse_one_cluster(page, server, graphs):
    fwd = graphs["aot_forward"]
    page.goto(f"{server}/#/graphs/{fwd['id']}?depth=1")
    _wait_nodes(page)
    collapsed = page.locator("#graph-svg g.cluster.collapsed")
    assert collapsed.count() >= 1, "depth 1 leaves the block clusters collapsed"
    path = collapsed.first.get_attribute("data-path")
    count = int(collapsed.first.get_attribute("data-nodes"))
    assert f"{count} nodes" in collapsed.first.text_content(), "a collapsed cluster says how many nodes it holds"
    before = page.locator("#graph-svg g.node").count()
    collapsed.first.dispatch_event("click")
    page.wait_for_url(lambda url: "expand=" in url)
    page.locator(f'#graph-svg g.cluster.open[data-path="{path}"]').wait_for()
    assert path in _query(page)["expand"], "the URL records the expanded cluster"
    assert page.locator("#graph-svg g.node").count() > before, "expanding shows the cluster's nodes"
    page.locator(f'#graph-svg g.cluster.open[data-path="{path}"] > text').dispatch_event("click")
    page.locator(f'#graph-svg g.cluster.collapsed[data-path="{path}"]').wait_for()
    assert path in _query(page).get("collapse", []) and path not in _query(page).get("expand", [])

    # selecting a node inside the cluster closed by hand opens it again
    nodes = httpx.get(f"{server}/api/graphs/{fwd['id']}/nodes", timeout=30).json()
    inside = next(n for n in nodes if (n["module_path"] or "").startswith(path) and n["op"] == "call_function")
    page.fill("#node-search", inside["name"])
    page.press("#node-search", "Enter")
    page.locator(f'#graph-svg g.node.selected[data-name="{inside["name"]}"]').wait_for()
    assert path not in _query(page).get("collapse", [])


def test_filter_keeps_matches_and_fades_the_rest(page, server, graphs):
    fwd = graphs["aot_forward"]
    page.goto(f"{server}/#/graphs/{fwd['id']}?depth=99")
    _wait_nodes(page)
    page.fill("#op-filter", "mm|addmm")
    page.press("#op-filter", "Enter")
    page.wait_for_url(lambda url: "filter=" in url)
    page.locator("#graph-svg g.node.match").first.wait_for()
    assert page.locator("#graph-svg g.node.faded").count() > 0, "non-matching nodes are faded"
    labels = page.locator("#graph-svg g.node.match").evaluate_all("gs => gs.map(g => g.querySelector('text').textContent)")
    assert labels and set(labels) <= {"mm", "addmm"}, labels
    page.fill("#op-filter", "(")
    page.press("#op-filter", "Enter")
    page.locator('[data-testid="error"]').wait_for()
    assert "regular expression" in page.locator('[data-testid="error"]').inner_text()


def test_search_opens_the_cluster_of_a_hidden_node_and_shows_details(page, server, graphs):
    fwd = graphs["aot_forward"]
    nodes = httpx.get(f"{server}/api/graphs/{fwd['id']}/nodes", timeout=30).json()
    target = next(n for n in nodes if n["op"] == "call_function" and (n["module_path"] or "").count("/") >= 2)
    page.goto(f"{server}/#/graphs/{fwd['id']}?depth=0")
    _wait_nodes(page)
    assert page.locator(f'#graph-svg g.node[data-name="{target["name"]}"]').count() == 0, "hidden at depth 0"
    page.fill("#node-search", target["module_path"].split("/")[-1])
    page.locator("#search-results button", has_text=target["name"]).first.wait_for()
    page.fill("#node-search", target["name"])
    page.press("#node-search", "Enter")
    page.locator(f'#graph-svg g.node.selected[data-name="{target["name"]}"]').wait_for()
    assert _query(page).get("expand"), "the clusters opened for the selection are in the URL"
    details = page.locator("#node-details")
    details.locator('[data-testid="node-name"]').filter(has_text=target["name"]).wait_for()
    text = details.inner_text()
    for field in ("target", "shape", "module path", "inputs", "users"):
        assert field in text, f"details show {field}: {text[:400]}"

    # URL round trip: the same link in a fresh page reproduces the view and the selection
    url = page.url
    svg_before = page.locator("#graph-svg svg").get_attribute("data-open-clusters")
    page.goto("about:blank")
    page.goto(url)
    page.locator(f'#graph-svg g.node.selected[data-name="{target["name"]}"]').wait_for()
    assert page.locator("#graph-svg svg").get_attribute("data-open-clusters") == svg_before


def test_forward_backward_jump_by_seq_nr(page, server, graphs):
    fwd, bwd = graphs["aot_forward"], graphs["aot_backward"]
    nodes = httpx.get(f"{server}/api/graphs/{fwd['id']}/nodes", timeout=30).json()
    bw_seq = {n["seq_nr"] for n in httpx.get(f"{server}/api/graphs/{bwd['id']}/nodes", timeout=30).json()}
    src = next(n for n in nodes if n["op"] == "call_function" and n["seq_nr"] in bw_seq and "mm" in n["name"])
    page.goto(f"{server}/#/graphs/{fwd['id']}?node={src['name']}")
    link = page.locator(f'#node-counterparts a[data-graph-id="{bwd["id"]}"]').first
    link.wait_for()
    name = link.inner_text()
    link.click()
    page.wait_for_url(lambda url: f"#/graphs/{bwd['id']}" in url)
    page.locator(f'#graph-svg g.node.selected[data-name="{name}"]').wait_for()
    back = page.locator(f'#node-counterparts a[data-graph-id="{fwd["id"]}"]')
    back.first.wait_for()
    assert src["name"] in back.all_inner_texts(), "the backward node links back to its forward node"


def test_diff_page_marks_and_links_nodes(page, server, graphs):
    fwd, bwd, dyn = graphs["aot_forward"], graphs["aot_backward"], graphs["dynamo"]
    page.goto(f"{server}/#/compare/{fwd['id']}/{dyn['id']}")
    page.locator("#compare-svg-a svg g.node").first.wait_for()
    page.locator("#compare-svg-b svg g.node").first.wait_for()
    assert page.locator("#compare-svg-a g.node.diff-removed, #compare-svg-a g.node.diff-changed").count() > 0
    assert "changed" in page.locator("#diff-counts").inner_text()
    page.goto(f"{server}/#/compare/{fwd['id']}/{bwd['id']}")
    page.locator("#compare-svg-a svg g.node").first.wait_for()
    mm = page.locator('#compare-svg-a g.node.cat-matmul').first
    mm.dispatch_event("click")
    page.locator("#compare-svg-b g.node.related").first.wait_for()
    assert page.locator("#compare-selection").get_attribute("data-partners"), "a forward mm has backward partners"


def test_hostile_module_and_stack_trace_stay_text(page, server, graphs):
    bwd = graphs["aot_backward"]
    page.goto(f"{server}/#/graphs/{bwd['id']}?depth=99")
    _wait_nodes(page)
    cluster = page.locator("#graph-svg g.cluster", has_text="<script>")
    # the namespace splits on "/", so "</script>" makes two levels: "<script>alert(1)<" and "script>"
    assert cluster.count() >= 1, "the hostile module name is drawn as text"
    assert page.locator("#graph-svg script, #graph-svg img").count() == 0
    svg = httpx.get(f"{server}/api/graphs/{bwd['id']}/svg?max_depth=99", timeout=30).text
    assert "<script>" not in svg and "<img" not in svg
    nodes = httpx.get(f"{server}/api/graphs/{bwd['id']}/nodes", timeout=30).json()
    evil = next(n for n in nodes if EVIL_MODULE in (n["module_path"] or ""))
    page.locator(f'#graph-svg g.node[data-name="{evil["name"]}"]').dispatch_event("click")
    stack = page.locator("#node-stack")
    stack.wait_for()
    assert EVIL_STACK in stack.inner_text(), "the stack trace shows the attribute text literally"
    assert EVIL_MODULE in page.locator("#node-details").inner_text(), "and the module path too"
    assert page.locator("#node-details img, #node-details script").count() == 0
