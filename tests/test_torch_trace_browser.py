"""The run page's compile index over an imported TORCH_TRACE run, in a real browser (Debian
Chromium via Playwright, the real app over HTTP): one table per rank, graph links that open the
graph view, Inductor output code with kernel → node links, and log text that stays text (a log
whose graph-break reason and frame name carry HTML is rendered escaped).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from graphdeck.store.db import open_engine
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import LiveServer, shared_path

pytestmark = pytest.mark.browser
HOSTILE = '<img src=x onerror="window.__pwned=1">'


def _record(envelope: dict, payload: str | None = None) -> str:
    """One glog line in torch's TORCH_TRACE format, with its md5-checked tab payload."""
    if payload is not None:
        envelope = {**envelope, "has_payload": hashlib.md5(payload.encode()).hexdigest()}
    line = "V1129 07:15:42.515000 18880 torch/_logging/structured.py:1] " + json.dumps(envelope)
    if payload is not None:
        line += "\n" + "\n".join("\t" + x for x in payload.split("\n"))
    return line + "\n"


def hostile_log(path: Path) -> Path:
    cid = {"rank": 0, "frame_id": 0, "frame_compile_id": 0, "attempt": 0}
    graph = (f'class GraphModule(torch.nn.Module):\n    def forward(self, L_x_: "f32[4][1]cpu"):\n'
             f'        l_x_ = L_x_\n        # File: /job/{HOSTILE}.py:3 in forward, code: y = x.relu()\n'
             f'        y: "f32[4][1]cpu" = l_x_.relu();  l_x_ = None\n        return (y,)\n')
    text = (_record({"str": [f"/job/{HOSTILE}.py", 0]})
            + _record({"dynamo_start": {"stack": [{"line": 3, "name": HOSTILE, "filename": 0}]}, **cid})
            + _record({"artifact": {"name": "dynamo_graph_break_reason", "encoding": "string"}, **cid},
                      f"Graph break in user code at /job/m.py:3\nReason: {HOSTILE}")
            + _record({"dynamo_output_graph": {}, **cid}, graph)
            + _record({"compilation_metrics": {"entire_frame_compile_time_s": 0.5, "graph_op_count": 1}, **cid}))
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("uvicorn")
    tmp = tmp_path_factory.mktemp("ttb")
    engine = open_engine(tmp / "s.db")
    import_torch_trace(engine, shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach"),
                       run_name="detach", strict=True)
    import_torch_trace(engine, hostile_log(tmp / "dedicated_log_torch_trace_rank_0_x.log"), run_name="hostile",
                       strict=True)
    import_torch_trace(engine, shared_path("data", "torch_trace", "tlparse_tests", "inputs", "multi_rank_runtime"),
                       run_name="mismatch")
    with LiveServer(tmp / "s.db") as srv:
        yield srv




def test_compile_index_page(server, browser):
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.url}/#/runs/detach?details=open")
    for rank in (0, 1):
        page.wait_for_selector(f'[data-testid="compile-index-rank-{rank}"] tr[data-compile-id="4/0"]')
    row = page.locator('[data-testid="compile-index-rank-0"] tr[data-compile-id="4/0"]')
    assert "forward (ddp_trace.py:13)" in row.inner_text()
    panel = row.locator("details.output-code").first
    summaries = row.locator("details.output-code summary").all_inner_texts()
    assert all(" of " in t and "#" in t for t in summaries), f"each output code names its graph: {summaries}"
    assert len(set(summaries)) == len(summaries), summaries
    panel.locator("summary").click()
    page.wait_for_selector("tr.code-row .kernel-links")
    code_row = page.locator("tr.code-row").first
    assert code_row.bounding_box()["width"] > 0.8 * row.bounding_box()["width"], "the code gets the table's width"
    link = code_row.locator(".kernel-links a.node-link").first
    href = link.get_attribute("href")
    assert href.startswith("#/graphs/") and "?node=" in href, "a kernel's node opens the graph view on it"
    graph_link = row.locator(".index-graph a").first
    graph_link.click()
    page.wait_for_url("**/#/graphs/*")
    page.screenshot(path="/tmp/graphdeck-compile-index.png")
    assert not errors, errors


def test_imported_run_page_fits_a_1440_px_window(server, browser):
    """Issue 24.12: imported run pages were wider than a 1440-px window."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(f"{server.url}/#/runs/detach?details=open")
    page.wait_for_selector('[data-testid="compile-index-rank-1"] tr[data-compile-id="4/0"]')
    page.locator("details.output-code summary").first.click()
    page.wait_for_selector("tr.code-row pre.output-code-text")
    widths = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], f"the page scrolls sideways: {widths[0]} px wide in a {widths[1]} px window"
    page.close()


def test_log_text_is_escaped(server, browser):
    page = browser.new_page()
    page.goto(f"{server.url}/#/runs/hostile?details=open")
    row = page.wait_for_selector('[data-testid="compile-index-rank-0"] tr[data-compile-id="0/0"]')
    assert HOSTILE in row.inner_text(), "the reason and frame name are shown as text"
    assert page.locator('[data-testid="compile-index"] img').count() == 0, "no element made from log text"
    assert page.evaluate("window.__pwned") is None


def test_rank_mismatch_shown(server, browser):
    """multi_rank_runtime/: the rank-5 file's records say rank 1; the page says so on rank 5."""
    page = browser.new_page()
    page.goto(f"{server.url}/#/runs/mismatch?details=open")
    block = page.wait_for_selector('[data-testid="compile-index-rank-5"] [data-testid="rank-source"]')
    assert "rank mismatch" in block.inner_text() and "rank 1" in block.inner_text()
    ok = page.wait_for_selector('[data-testid="compile-index-rank-0"] [data-testid="rank-source"]')
    assert "rank mismatch" not in ok.inner_text()
    assert "4 unverified" in ok.inner_text() and "md5_mismatch 4" in ok.inner_text(), \
        "records kept though their md5 failed are shown per rank"


def test_compile_records_open(server, browser):
    """Each compile lists its records (guards, metrics, artifacts) like tlparse's per-compile
    artifact list; opening one shows its payload."""
    page = browser.new_page()
    page.goto(f"{server.url}/#/runs/detach?details=open")
    row = page.wait_for_selector('[data-testid="compile-index-rank-0"] tr[data-compile-id="4/0"]')
    lists = row.query_selector('[data-testid="compile-records-list"]')
    lists.query_selector("summary").click()
    guards = next(d for d in lists.query_selector_all("details.record") if "dynamo_cpp_guards_str" in d.inner_text())
    guards.query_selector("summary").click()
    page.wait_for_function("el => el.querySelector('pre') && el.querySelector('pre').textContent.includes('TREE_GUARD')",
                           arg=guards)
