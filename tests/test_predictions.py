"""Predictions checked against the record (issue 19, item 3, and "Tried as a new user would",
second bullet) on a real 2-rank gloo DDP job (tests/programs/ddp_recompile.py) that recompiles on
rank 1 and finishes: the predicted schedule takes each frame's latest compile (the recompiled
graph replaces the first one; its collectives are not added), so no hang is predicted, and the
prediction is shown next to the ranks' Flight Recorder record, per process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import graphdeck.analysis.ranks as ranks_mod
from graphdeck.analysis.ranks import rank_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "programs" / "ddp_recompile.py"
LINE = next(i for i, t in enumerate(JOB.read_text().splitlines(), 1) if "# GRAPH_ALL_REDUCE" in t)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_recompile") / "s.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(JOB), str(out)], capture_output=True, text=True, env=env, timeout=180, cwd=REPO)
    assert proc.returncode == 0, f"the job must finish:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return out


def _report(store: Path):
    with Session(open_engine(store, read_only=True)) as s:
        return rank_report(s, s.scalar(select(Run).where(Run.name == "ddp_recompile")))


def test_a_recompile_on_one_rank_that_finished_is_no_predicted_hang(store):
    rep = _report(store)
    frames = {r: [e.compile_id for e in rep.sequences[r]] for r in (0, 1)}
    recompiled = sorted(set(frames[1]) - set(frames[0]))
    assert recompiled and all(not c.endswith("/0") for c in recompiled), frames  # rank 1 only recompiled
    assert rep.collective_mismatches == [], rep.to_text()
    assert "PREDICTED HANG" not in rep.to_text()
    s0, s1 = rep.schedules[0], rep.schedules[1]
    assert [c.signature() for c in s0] == [c.signature() for c in s1] and len(s0) == 5
    # one in-graph all_reduce from the frame's latest compile, then DDP's 4 reducer buckets
    g0, g1 = s0[0], s1[0]
    assert (g0.kind, g0.source, g0.size_bytes) == ("all_reduce", "graph", 512 * 4)
    frame = g0.compile_id.split("/")[0]
    assert g0.compile_id == f"{frame}/0" and g1.compile_id == max(c for c in frames[1] if c.startswith(f"{frame}/"))
    assert g1.compile_id != g0.compile_id, "rank 1 runs its recompiled graph"
    assert [c.source for c in s0[1:]] == ["ddp_bucket"] * 4
    assert f"5 collectives (1 from compile {g1.compile_id}, 4 from ddp_bucket)" in rep.to_text()


def test_prediction_is_checked_against_the_flight_recorder(store):
    rep = _report(store)
    (check,) = rep.predictions
    assert (check.group, check.desc, check.outcome) == ("0", "default_pg", "held")
    assert not check.predicted_hang and not check.recorded_hang
    assert set(check.recorded_completed) == {0, 1} and len(set(check.recorded_completed.values())) == 1
    n = check.recorded_completed[0]
    assert n >= 15  # 3 steps x (1 + 4 buckets), and DDP's own start-up collectives
    assert f"recorded: all ranks completed {n} collectives of group default_pg: held" in rep.to_text()
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(store), "--run", "ddp_recompile",
                           "--format", "json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    data = json.loads(proc.stdout)
    (p,) = data["predictions"]
    assert p["outcome"] == "held" and p["predicted_segments"]["1"][0]["compile_id"] == rep.schedules[1][0].compile_id


def test_the_old_prediction_would_not_have_held(store, monkeypatch):
    """Counting the replaced graph's collectives too (what main did) predicts a hang; the record
    shows every rank completed the group's collectives: the check says it did not hold."""
    monkeypatch.setattr(ranks_mod, "steady_state", lambda seq, scheduled=(): seq)
    rep = _report(store)
    assert len(rep.schedules[1]) == 6 and rep.collective_mismatches
    (check,) = rep.predictions
    assert check.predicted_hang and not check.recorded_hang and check.outcome == "did not hold"
    assert check.line().startswith("group 0 (default_pg): predicted: collective #1 of the step differs")
    assert "— recorded: all ranks completed" in check.line() and check.line().endswith(": did not hold")


@pytest.mark.browser
def test_page_shows_predicted_vs_recorded(store, browser):
    from tests.conftest import LiveServer

    with LiveServer(store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/ddp_recompile")
        page.get_by_test_id("rank-consistency-link").click()
        page.wait_for_selector("[data-testid=prediction]")
        row = page.get_by_test_id("prediction").inner_text()
        assert "default_pg" in row and "no hang" in row and "all ranks completed" in row and "held" in row
        assert page.locator("[data-testid=predicted-hang]").count() == 0
        assert "compile " in page.locator("#collective-schedule").inner_text()
        page.close()
