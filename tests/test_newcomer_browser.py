"""Issue 24 in Chromium: what a new user saw on the pages of a CPU-only captured run."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.conftest import LiveServer

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(captured_store: Path):
    pytest.importorskip("uvicorn")
    with LiveServer(captured_store) as srv:
        yield srv


def _trace_id(store: Path) -> int:
    con = sqlite3.connect(store)
    try:
        return con.execute("select id from traces order by id limit 1").fetchone()[0]
    finally:
        con.close()


def test_empty_tables_say_why_and_every_table_has_a_caption(browser, server, captured_store):
    """Item 11: GPU busy/idle, gaps and launch delays of a CPU trace were headers with no rows."""
    page = browser.new_page()
    page.goto(f"{server.url}/#/traces/{_trace_id(captured_store)}")
    page.wait_for_selector("#gpu-table", timeout=30_000)
    for tid in ("gpu-table", "gaps-table", "delays-table"):
        assert page.locator(f"#{tid} caption").inner_text().strip(), f"{tid} is captioned"
        if page.locator(f"#{tid} tbody tr").count() == 0:  # CPU gaps between a compiled region's ops may exist
            why = page.get_by_test_id(f"{tid}-empty").inner_text()
            assert why.startswith("No rows: ") and len(why) > 30, why
    assert page.locator("#gpu-table tbody tr").count() == 0, "a CPU-only trace has no GPU rows"
    # The newcomer re-run: raw int64 ns and a grid of ~30 zero counters on the trace page.
    import re

    meta = page.locator("#trace-meta").inner_text()
    assert not re.search(r"\d{16,}", meta) and " ms" in meta, meta
    stats = page.locator("#trace-stats").inner_text()
    assert "skipped_bad_ts" not in stats and "repaired_utf8" not in stats, stats
    assert "CPU-only" in page.get_by_test_id("gpu-table-empty").inner_text()
    assert page.locator("#steps-table caption").count() == 1
    page.goto(f"{server.url}/#/runs/tiny/timeline")
    page.wait_for_selector("#stragglers-table", timeout=30_000)
    for tid in ("offsets-table", "collectives-table", "step-times-table", "stragglers-table"):
        assert page.locator(f"#{tid} caption").inner_text().strip(), f"{tid} is captioned"
    assert "two or more ranks" in page.get_by_test_id("collectives-table-empty").inner_text()
    page.close()


def test_ddp_split_and_reducer_numberings_are_told_apart_and_bytes_are_readable(browser, tmp_path):
    """Item 14: two "bucket N" numberings (DDPOptimizer's split and the reducer's) without saying
    which is which, and raw bytes (``1055744 B``) on the ranks page."""
    import gzip

    data = Path(__file__).parent / "data" / "ddp_h200x2"
    store = tmp_path / "ddp.db"
    with gzip.open(data / "ddp.db.gz") as src, open(store, "wb") as dst:
        dst.write(src.read())
    with LiveServer(store) as srv:
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(f"{srv.url}/#/runs/ddp?details=open")
        page.wait_for_selector("#buckets-rank-0")
        assert "DDPOptimizer split" in page.locator("#graphs-rank-0").inner_text()
        note = page.get_by_test_id("buckets-note-0").inner_text()
        assert "reducer" in note and "need not match" in note
        page.goto(f"{srv.url}/#/runs/ddp/ranks")
        page.wait_for_selector("#collective-schedule")
        text = page.locator("#collective-schedule").inner_text()
        assert "DDP reducer bucket" in text or "DDPOptimizer split" in text, text[:500]
        import re

        assert not re.search(r"\d{4,} B\b", text), f"bytes in a readable unit: {re.findall(r'[0-9]{4,} B', text)[:3]}"
        page.close()
