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
        assert page.locator(f"#{tid} tbody tr").count() == 0, "a CPU-only trace has no GPU rows"
        why = page.get_by_test_id(f"{tid}-empty").inner_text()
        assert why.startswith("No rows: ") and len(why) > 30, why
        assert page.locator(f"#{tid} caption").inner_text().strip(), f"{tid} is captioned"
    assert "CPU-only" in page.get_by_test_id("gpu-table-empty").inner_text()
    assert page.locator("#steps-table caption").count() == 1
    page.goto(f"{server.url}/#/runs/tiny/timeline")
    page.wait_for_selector("#stragglers-table", timeout=30_000)
    for tid in ("offsets-table", "collectives-table", "step-times-table", "stragglers-table"):
        assert page.locator(f"#{tid} caption").inner_text().strip(), f"{tid} is captioned"
    assert "two or more ranks" in page.get_by_test_id("collectives-table-empty").inner_text()
    page.close()
