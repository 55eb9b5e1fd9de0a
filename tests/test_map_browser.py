"""The parallel map page (#/runs/<run>/map, issue 20 item 2) in a real browser (Debian Chromium via
Playwright) over the real app, reading a real SQLite store: a copy of the real FSDP2 x TP 4-rank
torchrun job (``nd_fsdp_tp``, a 2 x 2 dp x tp mesh), the real 2-stage pipeline whose stage 1 cuts
the backward (``nd_pipeline_cut``), plus runs whose layout records are written
the way the capture writes them (``tests.nd_fixtures.layout_record``): a 2-stage pipeline, a run
without any layout record, a mesh whose dimension name is markup, and a 1,024-rank
8 pp x 16 dp x 8 tp job with one rank that wrote no record.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.nd_fixtures import (  # noqa: F401  (nd_*_store: fixtures)
    RUN_FSDP_TP,
    RUN_PIPELINE_CUT,
    layout_record,
    nd_fsdp_tp_store,
    nd_pipeline_cut_store,
)
from tests.test_browser import page  # noqa: F401  (fixture: a page failing on console errors; Chromium from conftest)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

HOSTILE_DIM = "<img src=x onerror=alert(1)>"
BIG = (8, 16, 8)  # pp x dp x tp
BIG_SILENT = 77  # the big job's rank without a layout record: pp 0, dp 9, tp 5


def add_run(store: Path, name: str, world_size: int, records: dict[int, dict]) -> None:
    """A run with a ``ranks`` row per rank and each record as a ``graphdeck_parallel_layout`` compile
    event (the row the capture writes), through the store's own engine."""
    from graphdeck.store.db import open_engine, write_session
    from graphdeck.store.schema import CompileEvent, Rank, Run

    engine = open_engine(store)
    with write_session(engine) as s:
        run = Run(name=name, world_size=world_size)
        s.add(run)
        s.flush()
        s.add_all([Rank(run_id=run.id, rank=r, world_size=world_size, hostname=f"node{r // 8}", backend="gloo")
                   for r in range(world_size)])
        s.add_all([CompileEvent(run_id=run.id, rank=r, name="graphdeck_parallel_layout", compile_id=None,
                                payload=json.dumps(p)) for r, p in sorted(records.items())])
    engine.dispose()


@pytest.fixture(scope="module")
def base_url(nd_fsdp_tp_store, tmp_path_factory):  # noqa: F811
    store = tmp_path_factory.mktemp("map_browser") / "map.db"
    src, dst = sqlite3.connect(nd_fsdp_tp_store), sqlite3.connect(store)
    try:
        src.backup(dst)  # a private copy: this module adds runs
    finally:
        src.close()
        dst.close()
    add_run(store, "pipe2", 2, {r: layout_record(r, mesh_shape=None, world_size=2,
                                                 pipeline={"stage_index": r, "num_stages": 2}) for r in (0, 1)})
    add_run(store, "no_layout", 2, {})
    add_run(store, "hostile", 4, {r: layout_record(r, dim_names=(HOSTILE_DIM, "tp")) for r in range(4)})
    add_run(store, "big", 1024, {r: layout_record(r, mesh_shape=BIG, dim_names=("pp", "dp", "tp"))
                                 for r in range(1024) if r != BIG_SILENT})
    with LiveServer(store) as server:
        yield server.url


def open_map(pg, base_url: str, run: str, *, complete: bool = True) -> None:
    """Open the map page; wait until every check has answered (``complete``) or for the first
    picture (the layout and gradient-evidence checks), or the empty state."""
    pg.goto(f"{base_url}/#/runs/{run}/map")
    drawn = '[data-complete="true"] [data-testid="parallel-map"]' if complete else '[data-testid="parallel-map"]'
    pg.locator(f'{drawn}, [data-testid="map-empty"]').first.wait_for()


def grid(pg, stage: int = 0) -> list[list[str]]:
    """Each row of a stage's grid: its label, then each cell's data-ranks."""
    rows = pg.locator(f'[data-testid="map-stage"]:nth-child({stage + 1}) tbody tr')
    return [[r.locator("th").inner_text()] + [c.get_attribute("data-ranks") or "" for c in r.locator("td").all()]
            for r in rows.all()]


def test_fsdp_tp_job_is_a_2x2_grid_of_dp_replicas_and_tp_positions(page, base_url):  # noqa: F811
    page.goto(f"{base_url}/#/runs/{RUN_FSDP_TP}")
    page.get_by_test_id("parallel-map-link").click()
    page.wait_for_url(lambda url: url.endswith("/map"))
    page.locator('[data-complete="true"] [data-testid="parallel-map"]').wait_for()
    assert page.get_by_test_id("map-stage").count() == 1, "no pipeline: one block"
    assert page.get_by_test_id("map-cell").count() == 4
    assert page.locator('[data-testid="map-col"]').all_inner_texts() == ["tp 0", "tp 1"]
    assert grid(page) == [["dp 0", "0", "1"], ["dp 1", "2", "3"]], "the mesh tensor [[0, 1], [2, 3]]"
    assert "dp×tp (2×2)" in page.get_by_test_id("map-summary").inner_text()
    title = page.locator('[data-ranks="3"]').get_attribute("title")
    assert "rank 3" in title and "dp 1 · tp 1" in title and "layout record: ok" in title, title
    for check in ("diverged", "grad", "layout"):
        assert page.locator(f'.mbadge[data-check="{check}"]').count() == 0, f"the FSDP2 x TP job: no {check} badge"
    page.screenshot(path="/tmp/graphdeck-map-fsdp-tp.png", full_page=True)
    api = httpx.get(f"{base_url}/api/runs/{RUN_FSDP_TP}/parallel-map", timeout=60).json()
    assert api["dims"] == {"stage": None, "rows": ["dp"], "cols": ["tp"]}
    layout = next(c for c in api["checks"] if c["key"] == "layout")
    assert layout["counts"] == {"ok": 4}
    grad = next(c for c in api["checks"] if c["key"] == "grad")
    assert grad["ran"] and grad["counts"] == {"ok": 4} and grad["verdict"] == "PASS", grad  # FSDP2 evidence read
    card = page.locator('[data-testid="map-check"][data-check="grad"] .status')
    assert card.inner_text() == "checked" and "status-ok" in card.get_attribute("class")
    diverged = next(c for c in api["checks"] if c["key"] == "diverged")
    assert diverged["ran"] and diverged["counts"] == {"ok": 4}, diverged
    straggler = next(c for c in api["checks"] if c["key"] == "straggler")
    assert not straggler["ran"] and straggler["counts"] == {"unknown": 4}, "no traces: unknown, never ok"


def test_fsdp_tp_job_has_no_hang_badge(base_url):
    api = httpx.get(f"{base_url}/api/runs/{RUN_FSDP_TP}/parallel-map", params={"checks": "hang"}, timeout=60).json()
    hang = next(c for c in api["checks"] if c["key"] == "hang")
    assert hang["ran"] and hang["counts"] == {"ok": 4}, hang


def test_pipeline_run_draws_one_block_per_stage(page, base_url):  # noqa: F811
    open_map(page, base_url, "pipe2")
    stages = page.get_by_test_id("map-stage")
    assert stages.count() == 2
    assert [s.locator("h2").inner_text().split(" — ")[0] for s in stages.all()] == ["stage 0", "stage 1"]
    assert [s.get_by_test_id("map-cell").get_attribute("data-ranks") for s in stages.all()] == ["0", "1"]
    assert "2 pipeline stages" in page.get_by_test_id("map-summary").inner_text()


def test_run_without_layout_says_what_to_capture(page, base_url):  # noqa: F811
    open_map(page, base_url, "no_layout")
    empty = page.get_by_test_id("map-empty").inner_text()
    assert "no parallel layout record" in empty and "Agent" in empty and "DeviceMesh" in empty, empty
    assert page.get_by_test_id("map-cell").count() == 0
    body = httpx.get(f"{base_url}/api/runs/no_layout/parallel-map", timeout=30).json()
    assert body["has_layout"] is False and body["hint"]
    assert httpx.get(f"{base_url}/api/runs/nope/parallel-map", timeout=30).status_code == 404
    bad = httpx.get(f"{base_url}/api/runs/pipe2/parallel-map", params={"checks": "layout,<b>"}, timeout=30)
    assert bad.status_code == 400 and "'<b>'" in bad.json()["error"], bad.text


def test_mesh_dimension_names_are_text(page, base_url):  # noqa: F811
    open_map(page, base_url, "hostile")
    assert page.locator("img").count() == 0, "a dimension name never becomes markup"
    # Not a data-parallel name: a sharding dimension, so a column of its own beside tp.
    assert page.get_by_test_id("map-col").first.inner_text() == f"{HOSTILE_DIM} 0 · tp 0"


def test_1024_ranks_stay_one_picture(page, base_url):  # noqa: F811
    open_map(page, base_url, "big", complete=False)  # the first picture: every rank placed, layout badges
    stages = page.get_by_test_id("map-stage")
    assert stages.count() == 8
    # Identical replicas merge: 8 columns per stage, one row, except stage 0, where the rank
    # without a record splits the rows around dp 9.
    assert page.get_by_test_id("map-cell").count() == 7 * 8 + 3 * 8
    rows = grid(page, 0)
    assert [r[0] for r in rows] == ["dp 0 … dp 8 (9 rows)", "dp 9", "dp 10 … dp 15 (6 rows)"]
    silent = page.locator(f'[data-ranks="{BIG_SILENT}"]')
    assert silent.locator('.mbadge[data-check="layout"]').inner_text() == "no layout"
    assert "no layout record from this rank" in silent.get_attribute("title")
    merged = stages.nth(1).get_by_test_id("map-cell").first
    assert merged.get_attribute("data-ranks").split(",") == [str(128 + 8 * i) for i in range(16)]
    page.screenshot(path="/tmp/graphdeck-map-1024.png", full_page=True)
    page.get_by_test_id("map-expand").click()
    page.wait_for_function("document.querySelectorAll('[data-testid=map-cell]').length === 1024")
    assert len(grid(page, 3)) == 16, "every replica row once expanded"


@pytest.fixture(scope="module")
def cut_url(nd_pipeline_cut_store):  # noqa: F811
    with LiveServer(nd_pipeline_cut_store) as server:
        yield server.url


def test_pipeline_stage_cut_from_the_backward_has_a_missing_gradient_badge(page, cut_url):  # noqa: F811
    """The real job: stage 1 detaches its input, so stage 0 (rank 0) receives no gradient —
    check-grads' PP_BACKWARD_CUT on rank 0; the two stages are not diverged."""
    open_map(page, cut_url, RUN_PIPELINE_CUT)
    assert page.get_by_test_id("map-stage").count() == 2
    stage0 = page.locator('[data-ranks="0"]')
    assert stage0.locator('.mbadge[data-check="grad"]').inner_text() == "no grad"
    assert "PP_BACKWARD_CUT" in stage0.get_attribute("title")
    assert page.locator('[data-ranks="1"] .mbadge[data-check="grad"]').count() == 0
    assert page.locator('.mbadge[data-check="diverged"]').count() == 0, "stages run different programs by design"
    card = page.locator('[data-testid="map-check"][data-check="grad"] .status')  # green only when PASS
    assert card.inner_text() == "checked · FAIL" and "status-ok" not in card.get_attribute("class")
    page.screenshot(path="/tmp/graphdeck-map-pipeline-cut.png", full_page=True)
