"""One cost view per rank (issue 42 item 4; NOTE: [Rank cost view] in analysis/ranks/cost.py).

Inputs: the main job's own store (tests/data/demo_warm_bucket: ``graphdeck demo``, GPT-2, DDP on 2
gloo ranks, profiled steps 2 and 3), served by the real app and read in Chromium; and a 1,024-rank
run generated the way bench/scale_harness.py generates its runs — every row a copy of a captured
one: rank r gets the demo rank r % 2's trace row (with its collective index) and compile records, rank 5 a
memory-snapshot record —
to show the view's work does not grow with the ranks (its SQL statements are counted; the server
CPU of the request is printed, never asserted: bench/bench_cost_view.py measures it on the
harness's own 1,024-rank run).
"""

from __future__ import annotations

import gzip
import shutil
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from tests.conftest import LiveServer
from tests.test_browser import page  # noqa: F401  (fixture: a page failing on console errors)

WARM = Path(__file__).resolve().parent / "data" / "demo_warm_bucket" / "demo.db.gz"
#: The demo's DDP buckets (its graphdeck_comm_groups record), all-reduced once per step.
DDP_BYTES = 2701312
PEAK_5 = 123_456_789  # a memory-snapshot record's peak on rank 5 of the 1,024-rank run


def _copy(dst: Path) -> Path:
    with gzip.open(WARM, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return dst


def _add_big_run(store: Path, n: int) -> None:
    """Run ``big``: ``n`` ranks, rank r holding copies of the demo rank r % 2's trace row (its
    stats and collective index; no events) and compile records."""
    db = sqlite3.connect(store)
    try:
        from graphdeck.analysis.ranks.cost import rank_costs  # noqa: F401  (the index must be current)
        cur = db.cursor()
        cur.execute("INSERT INTO runs (name, world_size, created_at, meta_json) SELECT 'big', ?, created_at, meta_json "
                    "FROM runs WHERE name = 'demo'", (n,))
        big = cur.lastrowid
        demo = cur.execute("SELECT id FROM runs WHERE name = 'demo'").fetchone()[0]
        tcols = [c[1] for c in cur.execute("PRAGMA table_info(traces)") if c[1] not in ("id", "run_id", "rank")]
        ccols = [c[1] for c in cur.execute("PRAGMA table_info(compile_events)") if c[1] not in ("id", "run_id", "rank")]
        rcols = [c[1] for c in cur.execute("PRAGMA table_info(ranks)") if c[1] not in ("id", "run_id", "rank")]
        for r in range(n):
            src = r % 2
            cur.execute(f"INSERT INTO ranks (run_id, rank, {', '.join(rcols)}) SELECT ?, ?, {', '.join(rcols)} "
                        "FROM ranks WHERE run_id = ? AND rank = ?", (big, r, demo, src))
            cur.execute(f"INSERT INTO traces (run_id, rank, {', '.join(tcols)}) SELECT ?, ?, {', '.join(tcols)} "
                        "FROM traces WHERE run_id = ? AND rank = ?", (big, r, demo, src))
            cur.execute(f"INSERT INTO compile_events (run_id, rank, {', '.join(ccols)}) SELECT ?, ?, "
                        f"{', '.join(ccols)} FROM compile_events WHERE run_id = ? AND rank = ? AND name IN "
                        "('compilation_metrics', 'bwd_compilation_metrics')", (big, r, demo, src))
        cur.execute("INSERT INTO compile_events (run_id, rank, name, compile_id, payload, metadata_json) "
                    "VALUES (?, 5, 'graphdeck_memory_snapshot', NULL, ?, '{}')", (big, '{"peak_bytes": %d}' % PEAK_5))
        db.commit()
    finally:
        db.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from graphdeck.analysis.traces.collectives import store_index
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Trace

    path = _copy(tmp_path_factory.mktemp("cost") / "demo.db")
    engine = open_engine(path)  # migrated to the head; the traces' collective index made current
    with Session(engine) as s:
        for t in s.scalars(select(Trace)).all():
            store_index(s, t.id)
        s.commit()
    engine.dispose()
    _add_big_run(path, 1024)
    return path


@pytest.fixture(scope="module")
def server(store):
    with LiveServer(store) as srv:
        yield srv


def _costs(server, run: str, **params) -> dict:
    resp = httpx.get(f"{server.url}/api/runs/{run}/costs", params=params, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_demo_costs_per_rank_agree_with_the_pages_they_link(server, store):
    from graphdeck.analysis.ranks.compile_skew import compile_skew
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    doc = _costs(server, "demo")
    assert doc["world_size"] == 2 and doc["steps"] == [2, 3] and doc["step"] == 3
    assert [r["rank"] for r in doc["rows"]] == [0, 1] and all(r["traced"] for r in doc["rows"])
    for row in doc["rows"]:
        # the step's collectives: the 3 DDP buckets all-reduced by gloo, 2.6 MiB — the replica map's bytes
        assert row["comm_count"] == 3 and row["comm_bytes"] == DDP_BYTES, row
        assert row["step_time_ns"] > 0 and row["comm_ns"] > 0 and row["peak_memory_bytes"] is None
        assert row["links"]["step_time_ns"] == f"#/runs/{doc['run_id']}/rank/{row['rank']}?step=3"
        assert row["links"]["comm_bytes"] == f"#/traces/{row['trace_id']}"
        assert row["links"]["peak_memory_bytes"].endswith("/memory") and row["compile_source"] == "compile records"
    with Session(open_engine(store, read_only=True)) as s:
        skew = compile_skew(s, s.scalar(select(Run).where(Run.name == "demo")))
    by_rank = {r: c.compile_s for r, c in skew.ranks.items()}
    assert {r["rank"]: r["compile_s"] for r in doc["rows"]} == pytest.approx(by_rank), "compile skew's own seconds"
    assert any("no CUDA memory snapshot" in n for n in doc["notes"])
    step2 = _costs(server, "demo", step=2)
    assert step2["step"] == 2 and all(r["comm_count"] == 3 for r in step2["rows"])
    by_time = _costs(server, "demo", sort="comm_ns")["rows"]
    assert by_time[0]["comm_ns"] >= by_time[1]["comm_ns"]
    assert [r["rank"] for r in _costs(server, "demo", sort="comm_ns", desc="false")["rows"]] == \
        [r["rank"] for r in reversed(by_time)]
    bad = httpx.get(f"{server.url}/api/runs/demo/costs", params={"sort": "<b>"}, timeout=30)
    assert bad.status_code == 400 and "<b>" in bad.json()["error"]


def test_1024_ranks_cost_a_fixed_number_of_queries(server, store):
    from graphdeck.analysis.ranks.cost import rank_costs
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    engine = open_engine(store, read_only=True)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    with Session(engine) as s:
        run = s.scalar(select(Run).where(Run.name == "big"))
        statements.clear()
        cpu = time.process_time()
        doc = rank_costs(s, run, sort="step_time_ns")
        cpu = time.process_time() - cpu
    print(f"rank_costs, 1,024 ranks: {cpu:.3f} s CPU, {len(statements)} SQL statements")
    assert len(doc["rows"]) == 1024 and doc["step"] == 3 and all(r["comm_bytes"] == DDP_BYTES for r in doc["rows"])
    assert len(statements) <= 16, statements  # not per rank: 1,024 ranks read in a few batched queries
    peaks = {r["rank"]: r["peak_memory_bytes"] for r in doc["rows"] if r["peak_memory_bytes"] is not None}
    assert peaks == {5: PEAK_5}, "the snapshot's peak on its rank; no other rank's is invented"
    over_http = _costs(server, "big", sort="compile_s")
    assert _costs(server, "big", sort="peak_memory_bytes")["rows"][0]["rank"] == 5
    assert over_http["totals"]["compile_s"]["ranks"] == 1024


@pytest.mark.browser
def test_cost_page_sorts_and_links(page, server):  # noqa: F811
    page.goto(f"{server.url}/#/runs/demo")
    page.get_by_test_id("cost-link").first.click()
    page.get_by_test_id("cost-table").wait_for()
    assert page.locator('[data-testid="cost-table"] tbody tr').count() == 2
    assert "step 3" in page.get_by_test_id("cost-summary").inner_text()
    cell = page.locator('tr[data-rank="0"] td[data-metric="comm_bytes"]')
    assert cell.inner_text() == "2.6 MiB" and cell.locator("a").get_attribute("href").startswith("#/traces/")
    page.locator('a[data-sort="comm_ns"]').click()
    page.wait_for_url(lambda url: "sort=comm_ns" in url)
    page.locator('th[aria-sort="descending"]').wait_for()
    ranks = page.locator('[data-testid="cost-table"] tbody tr').evaluate_all("rs => rs.map(r => r.dataset.rank)")
    api = httpx.get(f"{page.url.split('#')[0]}api/runs/demo/costs", params={"sort": "comm_ns"}, timeout=30).json()
    assert ranks == [str(r["rank"]) for r in api["rows"]]
    page.locator('tr[data-rank="1"] td[data-metric="step_time_ns"] a').click()
    page.wait_for_url(lambda url: "/rank/1" in url and "step=3" in url)


@pytest.mark.browser
def test_cost_page_of_1024_ranks_draws_every_rank(page, server):  # noqa: F811
    page.goto(f"{server.url}/#/runs/big/cost?sort=step_time_ns")
    page.get_by_test_id("cost-table").wait_for()
    assert page.locator('[data-testid="cost-table"] tbody tr').count() == 1024
