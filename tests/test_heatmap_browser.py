"""The rank heatmap (issue 26 item 2; NOTE: [Rank heatmap] in analysis/ranks/heatmap.py) over HTTP and in
Chromium: a large run's page draws its ranks as one canvas (not a section per rank), a rank
without a trace is missing evidence (striped, "no trace"), hovering names rank / column / value,
a click opens that rank's page, and strings from the traces stay text.

Input: HTA's sampled NCCL job from ../shared/data/traces (ranks 0 and 1 of a 128-rank world, two
profiled steps, ten SendRecv kernels each), ingested as they are except for one edit — every NCCL
kernel's ``Process Group Name`` set to a string of markup — so a label from the traces reaches the
page. 126 of the run's 128 ranks have no trace: the picture must say so, never draw them healthy.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
from tests.conftest import LiveServer, shared_path

HTA = ("data", "traces", "hta", "trace_filter")
HOSTILE = '<img src=x onerror="window.__xss=1">'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("heatmap")
    store = tmp / "hta.db"
    engine = open_engine(store)
    for r in (0, 1):
        doc = json.loads(gzip.open(shared_path(*HTA, f"sampled_rank-{r}.json.gz")).read())
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower():
                e.setdefault("args", {})["Process Group Name"] = HOSTILE
        path = tmp / f"rank{r}.json"
        path.write_text(json.dumps(doc))
        ingest_trace(engine, path, run_name="hta")
    engine.dispose()
    with LiveServer(store) as srv:
        yield srv


def test_api_one_matrix_with_missing_ranks_named(server, monkeypatch):
    get = lambda q: httpx.get(f"{server.url}/api/runs/hta/heatmap{q}", timeout=60)  # noqa: E731
    doc = get("?metric=step_time&axis=steps").json()
    assert doc["ranks"] == list(range(128)) and doc["counts"] == {"ranks": 128, "traced": 2, "no_trace": 126}
    assert doc["row_state"][:3] == ["trace", "trace", "no_trace"] and doc["trace_ids"][2] is None
    assert [c["step"] for c in doc["columns"]] == [551, 552]
    assert all(v > 0 for v in doc["values"][0] + doc["values"][1])
    assert all(row == [None, None] for row in doc["values"][2:]), "no trace: no value, never a zero"
    coll = get("?metric=finding&axis=collectives&max_columns=4").json()
    assert coll["binned"] == 3 and len(coll["columns"]) == 4 and sum(c["count"] for c in coll["columns"]) == 10
    assert {f["key"] for f in coll["findings"]} >= {"ok", "late", "suspect", "absent"}
    assert coll["values"][0][0] == 2, "HTA's first SendRecv matches are suspect (see test_export_trace)"
    for q, named in (("?metric=speed", "speed"), ("?axis=ranks", "ranks"), ("?metric=step_time&axis=collectives", "per step")):
        r = get(q)
        assert r.status_code == 400 and named in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/api/runs/nope/heatmap").status_code == 404
    r = httpx.get(f"{server.url}/api/runs/hta/summary/everything")
    assert r.status_code == 400 and "layout" in r.json()["error"]
    assert httpx.get(f"{server.url}/api/runs/hta/ranks/128").status_code == 404
    # Past max_rows, ranks share rows (the worst kept): 128 ranks in 16 rows of 8; the first bin
    # holds the two traced ranks and six without a trace — "partial", never a healthy full row.
    binned = get("?metric=step_time&axis=steps&max_rows=16").json()
    assert binned["binned_rows"] == 8 and binned["ranks"] == list(range(0, 128, 8))
    assert binned["rank_last"][:2] == [7, 15] and binned["row_no_trace"][:2] == [6, 8]
    assert binned["row_state"][:2] == ["partial", "no_trace"] and binned["counts"]["ranks"] == 128
    assert binned["values"][0] == [max(doc["values"][0][c], doc["values"][1][c]) for c in range(2)]
    assert binned["rank_worst"][0] in (0, 1) and binned["trace_ids"][0] == doc["trace_ids"][binned["rank_worst"][0]]
    assert get("?max_rows=0").status_code == 422
    # A large run's page gets its first heatmap with the rank index: one round trip, the same matrix.
    idx = httpx.get(f"{server.url}/api/runs/hta/rank-index?heatmap=step_time", timeout=60).json()
    assert idx["heatmap"]["values"] == doc["values"] and idx["heatmap"]["axis"] == "steps"
    assert "heatmap" not in httpx.get(f"{server.url}/api/runs/hta/rank-index", timeout=60).json()
    assert httpx.get(f"{server.url}/api/runs/hta/rank-index?heatmap=speed", timeout=60).status_code == 400
    # Kept once computed (NOTE: [Derived-document cache]): the same answer from memory, and from the
    # store for a fresh process (its memory cleared); a check's part likewise.
    from graphdeck.server.derived import clear_memory, flush

    again = get("?metric=step_time&axis=steps&max_rows=16").json()
    assert again["cache"] == "memory" and {**again, "cache": None} == {**binned, "cache": None}
    flush()
    clear_memory()
    stored = get("?metric=step_time&axis=steps&max_rows=16").json()
    assert stored["cache"] == "store" and stored["values"] == binned["values"]
    first = httpx.get(f"{server.url}/api/runs/hta/summary/layout", timeout=60).json()
    assert first["cache"] in ("computed", "memory") and first["verdict"] == "N/A"
    assert httpx.get(f"{server.url}/api/runs/hta/summary/layout", timeout=60).json()["cache"] == "memory"
    # Trace coverage past the page's budget (here none): INCOMPLETE with the ranks mapped so far,
    # never PASS; the rest mapped in the background, then the whole answer kept — the CLI's.
    import time

    import graphdeck.server.routes.summary as summary_route
    from graphdeck.analysis.summary import run_check
    from graphdeck.store.schema import Run

    monkeypatch.setattr(summary_route, "PAGE_TRACES_BUDGET_S", 0.0)
    part = httpx.get(f"{server.url}/api/runs/hta/summary/traces", timeout=60).json()
    assert part["verdict"] == "INCOMPLETE" and part["continuing"] and "background" in part["reasons"][-1], part
    assert any("not mapped: the check's time budget was spent" in r for r in part["reasons"])
    deadline = time.monotonic() + 60
    while part.get("continuing") and time.monotonic() < deadline:
        time.sleep(0.2)
        part = httpx.get(f"{server.url}/api/runs/hta/summary/traces", timeout=60).json()
    assert part["cache"] in ("store", "computed") and not part.get("continuing"), part  # computed: every trace mapped already
    from sqlalchemy.orm import Session

    with Session(open_engine(server.server.config.app.state.settings.store, read_only=True)) as s:
        cli = run_check(s, s.scalar(select(Run).where(Run.name == "hta")), "traces")
    assert (part["verdict"], part["count"], part["detail"]) == (cli["verdict"], cli["count"], cli["detail"])


def _pixel(page, rank: int, col: int) -> list[int]:
    """The canvas colour at the middle of (rank row, column)."""
    return page.evaluate("""([r, c]) => {
      const cv = document.querySelector('[data-testid="heatmap-canvas"]');
      const d = cv.dataset, x = Number(d.left) + (c + 0.5) * Number(d.cw), y = Number(d.top) + (r + 0.5) * Number(d.rh);
      return [...cv.getContext("2d").getImageData(Math.floor(x), Math.floor(y), 1, 1).data];
    }""", [rank, col])


def _hover(page, rank: int, col: int) -> str:
    cv = page.get_by_test_id("heatmap-canvas")
    cv.scroll_into_view_if_needed()
    d = cv.evaluate("(c) => ({...c.dataset})")
    cv.hover(position={"x": int(d["left"]) + (col + 0.5) * int(d["cw"]), "y": int(d["top"]) + (rank + 0.5) * int(d["rh"])})
    tip = page.get_by_test_id("heatmap-tip")
    tip.wait_for(state="visible")
    return tip.inner_text()


@pytest.mark.browser
def test_large_run_page_draws_the_heatmap_and_drills_down(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.url}/#/runs/hta")
    page.wait_for_selector("[data-testid=rank-heatmap][data-state=done]")
    assert page.get_by_test_id("large-run").get_attribute("data-ranks") == "128"
    assert page.locator("section.rank").count() == 0, "no section per rank on a 128-rank run"
    box = page.get_by_test_id("rank-heatmap")
    assert (box.get_attribute("data-rows"), box.get_attribute("data-cols"), box.get_attribute("data-no-trace")) == ("128", "2", "126")
    assert "126 ranks" in page.get_by_test_id("heatmap-legend-no-trace").inner_text()
    assert "http" not in page.get_by_test_id("heatmap-status").inner_text(), "links are elements, not text"
    traced, missing = _pixel(page, 1, 1), _pixel(page, 50, 0)
    assert traced[:3] != missing[:3] and missing[0] == missing[1] == missing[2], "no trace is grey, not a scale colour"
    assert "rank 1 · step 552 · " in _hover(page, 1, 1) and "ms" in _hover(page, 1, 1)
    assert "no trace" in _hover(page, 50, 0)
    # the overview answered part by part, and came to the run's verdict
    page.wait_for_selector("[data-testid=run-overview][data-state=done]")
    assert page.locator("[data-testid=overview-check][data-verdict=pending]").count() == 0
    assert page.get_by_test_id("overview-verdict").get_attribute("data-verdict") == "INCOMPLETE"
    # per collective, coloured by finding: the group name from the traces is shown as text
    page.get_by_test_id("heatmap-metric").select_option("finding")
    page.get_by_test_id("heatmap-axis").select_option("collectives")
    page.wait_for_selector("[data-testid=rank-heatmap][data-state=done][data-axis=collectives]")
    assert HOSTILE in _hover(page, 0, 0) and "suspect" in _hover(page, 0, 0)
    assert page.evaluate("window.__xss") is None and page.locator("#app img").count() == 0
    # drill down: a click opens the rank's page at that column
    page.get_by_test_id("heatmap-metric").select_option("step_time")
    page.wait_for_selector("[data-testid=rank-heatmap][data-state=done][data-axis=steps]")
    _hover(page, 1, 1)
    page.get_by_test_id("heatmap-canvas").click(position=page.evaluate("""() => {
      const d = document.querySelector('[data-testid="heatmap-canvas"]').dataset;
      return {x: Number(d.left) + 1.5 * Number(d.cw), y: Number(d.top) + 1.5 * Number(d.rh)}; }"""))
    page.wait_for_url(lambda url: url.endswith("#/runs/1/rank/1?step=552"))
    page.get_by_test_id("rank-page").wait_for()
    assert page.get_by_test_id("rank-page-replay").get_attribute("href").endswith("/replay?step=552")
    page.goto(f"{server.url}/#/runs/hta/rank/7")
    assert "no usable trace" in page.get_by_test_id("rank-page-trace").inner_text()
    # Binned rows (the server's max_rows): 16 rows of 8 ranks; the first bin, two traced ranks and
    # six without a trace, keeps a striped mark and says so; its click opens the bin's worst rank.
    page.evaluate("""async () => {
      const {rankHeatmap} = await import("/static/heatmap.js");
      const [box] = rankHeatmap({alive: () => true}, "hta", {maxRows: 16});
      document.getElementById("app").replaceChildren(box);
    }""")
    page.wait_for_selector("[data-testid=rank-heatmap][data-state=done][data-binned-rows='8']")
    assert page.get_by_test_id("rank-heatmap").get_attribute("data-rows") == "16"
    tip = _hover(page, 0, 1)
    assert tip.startswith("ranks 0-7 · step 552 · ") and "6 ranks of the bin without a trace" in tip, tip
    assert _pixel(page, 0, 0)[:3] != _pixel(page, 1, 0)[:3], "a partial bin is drawn with its values"
    assert "8 ranks per row" in page.get_by_test_id("heatmap-status").inner_text()
    page.screenshot(path=str(Path("/tmp") / "graphdeck-rank-page.png"))
    assert errors == []
    page.close()
