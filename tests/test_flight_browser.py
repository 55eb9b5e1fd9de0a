"""The Flight Recorder section of a run's rank-consistency page (frontend/ranks.js) in real
Chromium over the real app: per process group the first mismatched collective — the group, its
sequence id, the ranks that reached it and the ranks that skipped it — and the explanation (the
branch that sent rank 1 another way), user strings (a group description, a source line) shown as
text, never markup.

Input: the real dumps of tests/flight_job.py (tests/data/flight/, see its README) imported with
``import_flight_dumps``; the ``loss_sync`` group's description made hostile and the stacks'
``flight_job.py`` frames pointed at a stand-in source file whose lines 66-68 are the job's branch
(so the explanation does not depend on that file's line numbers staying put)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from graphdeck.store.db import open_engine
from graphdeck.store.fr_import import import_flight_dumps
from tests.conftest import LiveServer

pytestmark = pytest.mark.browser

DATA = Path(__file__).resolve().parent / "data" / "flight"
HOSTILE = '<img src=x onerror="window.__pwned=1">'


@pytest.fixture(scope="module")
def fr_store(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("fr_browser")
    src = tmp / "train.py"
    lines = ["# stand-in for tests/flight_job.py: the branch at 66, the collectives at 67 and 68"] * 65
    lines += [f"if loss.item() > 0: # {HOSTILE}", "    dist.all_reduce(loss, group=loss_sync)",
              "dist.all_reduce(weight, group=grad_sync)"]
    src.write_text("\n".join(lines + ["pass"] * 40) + "\n")
    dumps = tmp / "dumps"
    dumps.mkdir()
    for r in (0, 1):
        d = pickle.loads((DATA / f"fr_dump_{r}").read_bytes())
        for e in d["entries"]:
            name, desc = e["process_group"]
            if desc == "loss_sync":
                e["process_group"] = (name, HOSTILE + desc)
            for f in e.get("frames") or []:
                if f["filename"].endswith("flight_job.py"):
                    f["filename"] = str(src)
        (dumps / f"rank{r}.pickle").write_bytes(pickle.dumps(d))
    db = tmp / "s.db"
    res = import_flight_dumps(open_engine(db), dumps, run_name="fr")
    assert res.ranks == [0, 1] and res.dropped == 0
    return db, src


def test_flight_recorder_section_shows_group_seq_ranks_and_why(fr_store, browser):
    db, src = fr_store
    with LiveServer(db) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/fr/ranks")
        page.wait_for_selector("[data-testid=recorded-hang]")
        assert "0 group(s) agree, 4 mismatched" in page.get_by_test_id("fr-summary").inner_text()
        hang = page.locator("[data-testid=recorded-hang][data-group='1']")
        assert hang.get_by_test_id("fr-group").inner_text() == f"group 1 ({HOSTILE}loss_sync)"
        assert hang.get_by_test_id("fr-seq").inner_text() == "collective #3"
        assert hang.get_by_test_id("fr-reached").inner_text() == "reached by ranks [0]"
        assert hang.get_by_test_id("fr-not-reached").inner_text() == "not by ranks [1]"
        rank1 = hang.locator("[data-testid=fr-rank][data-rank='1']")
        assert "(skipped it)" in rank1.inner_text() and "went on to gloo:all_reduce #3 of group 2" in rank1.inner_text()
        why = [w.inner_text() for w in rank1.get_by_test_id("fr-why").all()]
        assert any(w.startswith("no compile records for this run") for w in why), why
        assert f"the branch: {src}:66 in main: `if loss.item() > 0: # {HOSTILE}`" in why, why
        # the consequence: rank 0 waits in loss_sync #3, so it never reached grad_sync #3
        grad = page.locator("[data-testid=recorded-hang][data-group='2']")
        assert "consequence" in grad.inner_text() and "(waiting in an earlier collective)" in grad.inner_text()
        # user strings are text: no element made from them, no script run
        assert page.locator(".ranks-page img").count() == 0
        assert page.evaluate("window.__pwned") is None
        page.close()
