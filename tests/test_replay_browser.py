"""The replay page in a real browser (Debian Chromium via Playwright) over the real app: the
cursor moves over the step's timeline and the graph node whose kernel runs lights up.

Input: the GPT-2 Inductor store from one H200 (tests/data/gpt2_inductor). Skipped without
/usr/bin/chromium except under CI=true.
"""

from __future__ import annotations

import pytest

from tests.conftest import CHROMIUM, CHROMIUM_ARGS, LiveServer, require
from tests.trace_helpers import gpt2_store  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def base_url(gpt2_store):  # noqa: F811
    with LiveServer(gpt2_store) as server:
        yield server.url


@pytest.fixture(scope="module")
def page(base_url):
    require(CHROMIUM.exists(), f"{CHROMIUM} is missing (Debian package chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    problems: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        pg.set_default_timeout(60_000)
        pg.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        yield pg
        browser.close()
    assert not problems, "the page logged errors:\n" + "\n".join(problems)


CURSOR_X = "() => { const t = document.getElementById('replay-timeline'); const s = t.layout.shapes; return s[s.length - 1].x0; }"


def test_cursor_moves_and_the_running_kernels_node_lights_up(page, base_url):
    page.goto(f"{base_url}/#/traces/1/replay?step_interval_ms=40&highlight=mm&autoplay=0")
    status = page.locator("#replay-status")
    page.wait_for_function("() => document.getElementById('replay-timeline')?.layout?.shapes?.length > 0")
    assert status.get_attribute("data-frame") == "0", "paused on the first frame with autoplay=0"
    x0 = page.evaluate(CURSOR_X)
    page.wait_for_selector("#replay-graph svg g.replay-active", state="attached")
    page.click("#replay-play")
    page.wait_for_function("() => Number(document.getElementById('replay-status').dataset.frame) >= 40")
    page.click("#replay-play")  # pause
    frame = int(status.get_attribute("data-frame"))
    x1 = page.evaluate(CURSOR_X)
    assert x1 > x0, f"the cursor moved right while playing ({x0} -> {x1} ms) to frame {frame}"
    for _ in range(200):  # a busy host pauses on any frame: step on to one whose kernel maps to a node
        if status.get_attribute("data-node-idx"):
            break
        frame += 1
        page.locator("#replay-slider").fill(str(frame))
        page.wait_for_function("(f) => document.getElementById('replay-status').dataset.frame === String(f)", arg=frame)
    want = status.get_attribute("data-node-idx")
    assert want, f"frame {frame}'s kernel maps to a graph node"
    page.wait_for_function(
        "(idx) => document.querySelector('#replay-graph svg g.replay-active')?.id === 'node-' + idx", arg=want)
    lit = page.locator("#replay-graph svg g.replay-active")
    assert lit.count() == 1, "exactly one node is lit"
    assert lit.get_attribute("id") == f"node-{want}"
    node_name = page.locator("#replay-node").text_content()
    assert lit.get_attribute("data-name") == node_name, "the lit <g> is the node the status line names"
    box, host = lit.bounding_box(), page.locator("#replay-graph").bounding_box()
    assert box and host and box["x"] + box["width"] > host["x"] and box["x"] < host["x"] + host["width"] \
        and box["y"] + box["height"] > host["y"] and box["y"] < host["y"] + host["height"], \
        f"the lit node is inside the visible graph area (issue 24.10): {box} vs {host}"
    page.screenshot(path="/tmp/graphdeck-replay.png", full_page=True)


def test_slider_jumps_to_a_frame_and_moves_the_cursor(page, base_url):
    page.goto(f"{base_url}/#/traces/1/replay?step_interval_ms=10")  # opens paused (issue 24.10)
    page.wait_for_selector("#replay-graph svg g.replay-active", state="attached")
    assert page.locator("#replay-status").get_attribute("data-frame") == "0", "no autoplay on open"
    page.wait_for_function("() => document.getElementById('replay-timeline')?.layout?.shapes?.length > 0")
    page.locator("#replay-slider").fill("300")
    page.wait_for_function("() => document.getElementById('replay-status').dataset.frame === '300'")
    assert page.evaluate(CURSOR_X) > 0


def test_run_timeline_page_stacks_ranks_and_lists_collectives(page, tmp_path):
    """The 2-rank HTA set (../shared): lanes of both ranks, offsets, collectives with who arrived last."""
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace
    from tests.conftest import shared_path

    engine = open_engine(tmp_path / "two.db")
    for r in (0, 1):
        ingest_trace(engine, shared_path("data", "traces", "hta", "trace_filter", f"sampled_rank-{r}.json.gz"), run_name="two")
    engine.dispose()
    with LiveServer(tmp_path / "two.db") as srv:
        page.goto(f"{srv.url}/#/runs/two/timeline")
        page.wait_for_selector("#collectives-table tbody tr", timeout=60_000)
        ticks = page.evaluate("() => document.getElementById('run-timeline').layout.yaxis.ticktext")
        assert any(t.startswith("rank 0") for t in ticks) and any(t.startswith("rank 1") for t in ticks)
        assert page.locator("#collectives-table tbody tr").count() == 10
        assert page.locator("#offsets-table tbody tr").count() == 2
        assert page.locator("#step-times-table tbody tr").count() == 2, "step times per rank"
        page.screenshot(path="/tmp/graphdeck-run-timeline.png", full_page=True)
