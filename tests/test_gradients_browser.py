"""The gradient page (#/runs/<run>/grads) in a real browser (Debian Chromium via Playwright) over
the real app, on a real capture of case G5 (blk2 behind a detach): the table, the status and
rank filters (kept in the URL), and the link from a cut to its node in the graph view."""

from __future__ import annotations

import pytest
import torch

from tests import grad_cases as C
from tests.conftest import LiveServer
from tests.test_browser import page  # noqa: F401  (fixture: a page failing on console errors; Chromium from conftest)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    from graphdeck.capture import Agent

    store = tmp_path_factory.mktemp("grads_browser") / "g5.db"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = C.DetachInMiddle()
    agent = Agent(store=store, run="g5")
    agent.watch(model)
    torch.compile(model, backend=agent.backend("aot_eager"))(torch.randint(0, 16, (4, 3))).sum().backward()
    agent.close()
    torch._dynamo.reset()
    with LiveServer(store) as server:
        yield server.url


def visible_rows(pg):
    return pg.locator("#grad-report tbody tr:visible")


def test_gradient_page_filters_and_links_to_the_cut(page, base_url):  # noqa: F811
    page.goto(f"{base_url}/#/runs/g5/grads")
    page.locator("#grad-report").wait_for()
    assert visible_rows(page).count() == 9, "one row per parameter of G5's model on rank 0"
    assert "problems found" in page.locator("#grad-summary").inner_text()
    page.select_option("#grad-status", "NO_GRAD")
    rows = visible_rows(page)
    assert rows.count() == 2 and set(rows.locator("td:nth-child(2) code").all_inner_texts()) >= {"blk2.weight", "blk2.bias"}
    assert "status=NO_GRAD" in page.evaluate("location.hash"), "the filter is kept in the URL"
    assert C.line_of("G5-cut") in rows.first.inner_text(), "the row names the detach's source line"
    cut = rows.first.locator("div.cut").inner_text()
    assert cut.startswith("cut: detach") and "detach detach" not in cut, f"the op is not repeated (issue 24.14): {cut}"
    page.select_option("#grad-rank", "0")
    assert visible_rows(page).count() == 2 and "rank=0" in page.evaluate("location.hash")
    page.goto(f"{base_url}/#/runs/g5/grads?status=OK")
    page.locator("#grad-report").wait_for()
    assert visible_rows(page).count() == 7, "a link with ?status=OK opens filtered"
    page.select_option("#grad-status", "NO_GRAD")
    link = visible_rows(page).first.locator('[data-testid="cut-link"]')
    href = link.get_attribute("href")
    assert href.startswith("#/graphs/") and "node=" in href and "path=" in href, href
    page.screenshot(path="/tmp/graphdeck-grads.png", full_page=True)
    link.click()
    page.wait_for_url(lambda url: "#/graphs/" in url)
    selected = page.locator("#graph-svg g.node.selected")
    selected.wait_for()
    node = href.split("node=")[1].split("&")[0]
    assert selected.first.get_attribute("data-name") == node, "the graph page opens on the cut node"
    assert "detach" in page.locator("#node-details").inner_text()
    # The path from the parameter to the cut is marked: every drawn node on it, and its edges.
    from urllib.parse import unquote

    path = unquote(href.split("path=")[1].split("&")[0]).split(",")
    marked = page.locator("#graph-svg g.node.on-path")
    marked.first.wait_for()
    assert set(marked.evaluate_all("els => els.map(e => e.dataset.name)")) <= set(path)
    assert marked.count() >= 2 and page.locator("#graph-svg g.edge.on-path").count() >= 1


def test_run_page_section_links_to_the_gradient_page(page, base_url):  # noqa: F811
    page.goto(f"{base_url}/#/runs/g5?details=open")
    page.locator("#grad-report").wait_for()
    assert page.locator("#grad-report tbody tr").count() == 9
    page.locator("#grad-page-link").click()
    page.wait_for_url(lambda url: url.endswith("/grads"))
    page.locator("#grads-page #grad-report").wait_for()
