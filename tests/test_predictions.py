"""Predictions checked against the record (issue 19, item 3, and "Tried as a new user would",
second bullet) on a real 2-rank gloo DDP job (tests/programs/ddp_recompile.py) that recompiles on
rank 1 and finishes: the predicted schedule takes each frame's latest compile (the recompiled
graph replaces the first one; its collectives are not added), so no hang is predicted, and the
prediction is shown next to the ranks' Flight Recorder record, per process group. The compile
divergence itself is then a warning, not a FAIL (NOTE: [Recompiles that cannot hang]).

Live compiles (NOTE: [Live compiles]) on tests/live_compiles_job.py: a static recompile that
*adds* a cache entry whose older graph still runs (both counted, by the profiler trace), the same
without a trace (uncertain: INCOMPLETE, not guessed), and one that *replaces* the older graph (a
dtype switch, the trace shows only the new graph)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import graphdeck.analysis.ranks.predicted as predicted_mod
from graphdeck.analysis.ranks.core import rank_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from tests.launch import run_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "programs" / "ddp_recompile.py"
LINE = next(i for i, t in enumerate(JOB.read_text().splitlines(), 1) if "# GRAPH_ALL_REDUCE" in t)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_recompile") / "s.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    proc = run_ranks([JOB, out], 2, env=env, cwd=REPO, timeout=180)
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


def test_a_recompile_whose_collectives_agree_is_a_warning_not_a_fail(store):
    """Issue 19 item 1: rank 1 recompiled (frames inner and forward, size guards) and the job
    finished; the predicted and the recorded collective schedules agree, so check-ranks warns
    (naming the recompiles and their guards) and does not fail."""
    rep = _report(store)
    (d,) = rep.divergences
    assert d.ranks == [1] and d.harmless, rep.to_text()
    fwd = rep.schedules[1][0].compile_id
    assert f"compile {fwd} on ranks [1] (guard: {fwd.split('/')[0]}/0: tensor 'x' size mismatch at index 0. " \
           "expected 4, actual 6)" in d.harmless
    assert "The collective schedules agree — predicted: every rank issues the same 5 collective(s) a step; " \
           "recorded: the Flight Recorder dumps of ranks [0, 1] hold no mismatched collective" in d.harmless
    assert d.harmless.endswith("so no hang is expected from these recompiles")
    assert rep.verdict == "OK" and rep.missing_evidence == []
    text = rep.to_text()
    assert "DIVERGED" not in text and "WARN ranks [1] vs [0]" in text
    assert text.splitlines()[-1] == "OK: the collective schedules agree (1 warning(s) above)"
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(store), "--run", "ddp_recompile"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout
    # the replaced graph: rank 1's forward recompiled with symbolic sizes (automatic dynamic)
    with Session(open_engine(store, read_only=True)) as s:
        _entries, frames = predicted_mod.live_compiles(s, rep.run_id, 1, rep.sequences[1])
    (fc,) = [f for f in frames if f.counted == [fwd]]
    assert "automatic dynamic shapes" in fc.replaced[f"{fwd.split('/')[0]}/0"] and not fc.uncertain


def test_prediction_is_checked_against_the_flight_recorder(store):
    rep = _report(store)
    (check,) = rep.predictions
    assert (check.group, check.desc, check.outcome) == ("0", "default_pg", "held")
    assert not check.predicted_hang and not check.recorded_hang
    assert set(check.recorded_completed) == {0, 1}
    counts = sorted(set(check.recorded_completed.values()))
    # each rank dumps at close(), the other's last all-reduce may still be in flight then
    assert counts[-1] - counts[0] <= 1 and counts[0] >= 15  # 3 steps x (1 + 4 buckets), DDP's start-up ones
    n = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    assert f"recorded: every member [0, 1] completed {n} collectives of group default_pg: held" in rep.to_text()
    assert check.members == [0, 1] and check.recorded_no_dump == []
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(store), "--run", "ddp_recompile",
                           "--format", "json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    data = json.loads(proc.stdout)
    (p,) = data["predictions"]
    assert p["outcome"] == "held" and p["predicted_segments"]["1"][0]["compile_id"] == rep.schedules[1][0].compile_id


def test_the_old_prediction_would_not_have_held(store, monkeypatch):
    """Counting the replaced graph's collectives too (what main did) predicts a hang; the record
    shows every rank completed the group's collectives: the check says it did not hold."""
    monkeypatch.setattr(predicted_mod, "live_compiles", lambda s, run, rank, seq, scheduled=(): (seq, []))
    rep = _report(store)
    assert len(rep.schedules[1]) == 6 and rep.collective_mismatches
    assert rep.verdict == "FAIL" and not rep.divergences[0].harmless, "a predicted hang: no warning-only verdict"
    (check,) = rep.predictions
    assert check.predicted_hang and not check.recorded_hang and check.outcome == "did not hold"
    assert check.line().startswith("group 0 (default_pg): predicted: collective #1 of the step differs")
    assert "— recorded: every member [0, 1] completed" in check.line() and check.line().endswith(": did not hold")


def test_no_dump_hint_says_what_is_missing(store):
    """Issue 20: the Agent turns the Flight Recorder on itself, so for a run it captured the
    parallel map's no-dump hint must not tell the user to set TORCH_FR_BUFFER_SIZE and import;
    for a run it did not capture, it says how to record and import the dumps."""
    from graphdeck.server.routes.parallel_map import _no_dump_hint

    with Session(open_engine(store, read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "ddp_recompile"))
        agent = _no_dump_hint(s, run_id)
        other = _no_dump_hint(s, run_id + 1000)  # a run id with no Agent record
    assert agent.startswith("graphdeck's Agent turns the Flight Recorder on") and "graphdeck import" not in agent
    assert "no rank recorded a collective after the Agent was made" in agent and "TORCH_FR_BUFFER_SIZE=0" in agent
    assert "not captured by graphdeck's Agent" in other and "`graphdeck import` the dumps" in other


@pytest.mark.browser
def test_page_shows_predicted_vs_recorded(store, browser):
    from tests.conftest import LiveServer

    with LiveServer(store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/ddp_recompile")
        page.get_by_test_id("rank-consistency-link").click()
        page.wait_for_selector("[data-testid=prediction]")
        row = page.get_by_test_id("prediction").inner_text()
        assert "default_pg" in row and "no hang" in row and "every member [0, 1] completed" in row and "held" in row
        assert page.locator("[data-testid=predicted-hang]").count() == 0
        assert "compile " in page.locator("#collective-schedule").inner_text()
        page.close()


LIVE_JOB = REPO / "tests" / "live_compiles_job.py"


@pytest.fixture(scope="module")
def live_store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("live") / "s.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_ranks([LIVE_JOB, out], 2, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, f"the job must finish:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return out


def _live(store: Path, run: str):
    with Session(open_engine(store, read_only=True)) as s:
        rep = rank_report(s, s.scalar(select(Run).where(Run.name == run)))
        frames = {r: predicted_mod.live_compiles(s, rep.run_id, r, rep.sequences[r])[1] for r in rep.ranks}
    return rep, frames


def test_a_recompile_that_adds_a_cache_entry_counts_both_graphs(live_store):
    """Batches of 4 and 6 rows alternate under static shapes: 0/0 and 0/1 both run; the profiler
    window shows both. Counting only the latest compile (main before) predicted one all_reduce of
    6 rows; both graphs' all_reduces are counted."""
    rep, frames = _live(live_store, "alternate")
    for r in (0, 1):
        sched = rep.schedules[r]
        assert [(c.kind, c.compile_id, c.size_bytes) for c in sched] == [("all_reduce", "0/0", 4 * 8 * 4),
                                                                        ("all_reduce", "0/1", 6 * 8 * 4)]
        (fc,) = frames[r]
        assert fc.counted == ["0/0", "0/1"] and "profiler trace shows it running" in fc.live["0/0"]
    assert rep.verdict == "OK" and not rep.missing_evidence, rep.to_text()
    (check,) = rep.predictions
    assert "a frame with several live graphs counts each once" in check.predicted and check.outcome == "held"


def test_without_a_trace_it_cannot_be_told_and_says_so(live_store):
    rep, frames = _live(live_store, "alternate_untraced")
    assert rep.verdict == "INCOMPLETE", rep.to_text()
    for r in (0, 1):
        (fc,) = frames[r]
        why = fc.uncertain["0/0"]
        assert "size mismatch at index 0. expected 4, actual 6" in why and "added a cache entry beside it" in why
        assert "it issues all_reduce 128 bytes, compile 0/1 all_reduce 192 bytes" in why
        assert fc.missing() in rep.missing_evidence
    assert "INCOMPLETE: 2 piece(s) of evidence missing" in rep.to_text()


def test_a_recompile_that_replaces_the_graph_adds_no_collectives(live_store):
    """float32 then float64 for good: the dtype guard's recompile takes over; the trace (steps
    3-4) shows only 0/1, so 0/0's all_reduce is not counted and nothing is uncertain."""
    rep, frames = _live(live_store, "switch")
    for r in (0, 1):
        assert [(c.compile_id, c.dtype) for c in rep.schedules[r]] == [("0/1", "float64")]
        (fc,) = frames[r]
        assert fc.counted == ["0/1"] and "shows compile 0/1 running and not it" in fc.replaced["0/0"]
    assert rep.verdict == "OK" and not rep.missing_evidence, rep.to_text()


def test_every_surface_gives_the_recompile_the_same_verdicts(store):
    """Issue 34: a harmless recompile (WARN, check-ranks OK) is OK on every surface (tests/verdict_surfaces.py)."""
    from tests.verdict_surfaces import disagreements

    assert not disagreements(store, ["ddp_recompile"])


def test_a_harmless_recompile_is_no_diverged_rank_on_the_map(store, tmp_path):
    """Issue 34: the parallel map's "diverged" badge counted every divergence, a harmless one (a
    recompile whose collective schedules agree, WARN in check-ranks) too: rank 1 was "diverged" on
    the map while check-ranks said OK. Both now read RankReport.diverged_ranks (NOTE: [One rank
    verdict]). The run gets a 1-D data-parallel layout record (as a DDP job over a DeviceMesh)."""
    from graphdeck.server.routes.parallel_map import parallel_map
    from tests.nd_fixtures import layout_record
    from tests.test_mesh_checks import with_layout

    mapped = with_layout(store, tmp_path / "dp.db", "ddp_recompile",
                         {r: layout_record(r, mesh_shape=(2,), dim_names=("dp",), world_size=2) for r in (0, 1)})
    with Session(open_engine(mapped, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "ddp_recompile"))
        rep = rank_report(s, run)
        badge = next(c for c in parallel_map(s, run, checks=["diverged"])["checks"] if c["key"] == "diverged")
    assert rep.verdict == "OK" and any(d.harmless for d in rep.divergences) and rep.diverged_ranks() == {}
    assert badge["ran"] and badge["verdict"] == "OK" and badge["counts"] == {"ok": 2}, badge
