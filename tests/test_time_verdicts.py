"""Verdicts from time (issue 38 items 2, 3, 6) on one real 2-rank gloo job (tests/programs/time_cases.py,
each rank its own process): a compile skew past the gradient group's 2 s timeout that kills the
job is a FAIL naming both compile times and the step; a rank that recompiles alone before an
all-reduce is the straggler, and the finding names its recompile and the guard that failed as
the cause of its peer's wait — on check-ranks' text, exit code, ``--json``, the API and summary."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import rank_report
from graphdeck.analysis.ranks.time_verdicts import WARN_FRACTION, judge, stack_place, time_findings
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from tests.conftest import REPO
from tests.launch import start_python
from tests.verdict_surfaces import disagreements

PROGRAM = REPO / "tests" / "programs" / "time_cases.py"
sys.path.insert(0, str(PROGRAM.parent))
import time_cases  # noqa: E402  (TIMEOUT_S: what the job does; importing it runs nothing)

sys.path.remove(str(PROGRAM.parent))


@pytest.fixture(scope="module")
def time_store(tmp_path_factory) -> Path:
    """Both cases in one job; it ends by dying in case 2 (both ranks exit non-zero)."""
    root = tmp_path_factory.mktemp("time")
    store = root / "time.db"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    files = [tempfile.TemporaryFile("w+") for _ in (0, 1)]
    procs = [start_python([PROGRAM, store], env={**env, "RANK": str(r)}, stdout=f, stderr=f)
             for r, f in enumerate(files)]
    for p in procs:
        p.wait(timeout=900)  # a hang guard: at load 24 on 2 cores the job took over 500 s
    outs = []
    for f in files:
        f.seek(0)
        outs.append(f.read())
        f.close()
    for r, (p, out) in enumerate(zip(procs, outs)):  # the job died in case 2's all-reduce, on both ranks
        assert p.returncode != 0 and "all_reduce" in out, f"rank {r}:\n{out[-4000:]}"
    assert "Timed out waiting" in outs[1], outs[1][-3000:]
    return store


def _cli(store: Path, check: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", check, str(store), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_compile_skew_past_the_timeout_that_killed_the_job_fails_with_both_times_and_the_step(time_store):
    with Session(open_engine(time_store, read_only=True)) as s:
        rep = rank_report(s, s.scalar(select(Run).where(Run.name == "compile_timeout")))
    # The same frames compiled in the same order on both ranks: nothing diverges, only time.
    assert rep.diverged_ranks() == {} and not rep.collective_mismatches
    skew = [f for f in rep.time_findings if f.kind == "compile skew"]
    assert len(skew) == 1, rep.time_findings
    f = skew[0]
    # Cold rank 0 compiled the evaluation before the all-reduce; warm rank 1 waited there and died.
    assert (f.verdict, f.late_rank, f.waiting_ranks, f.died) == ("FAIL", 0, [1], True)
    assert f.timeout_s == time_cases.TIMEOUT_S and "process group" in f.timeout_source
    assert f.share >= 1 and f.wait_s >= time_cases.TIMEOUT_S
    assert f.collective == "gloo:all_reduce #1 of group grad_sync (flight recorder)"
    assert f.step == 0 and "gradient evidence" in f.step_source
    assert f.place.startswith("outside the compiled regions") and "time_cases.py" in f.place
    assert "in train_step" in f.place  # the line that issued the all-reduce
    # durations in human units (NOTE: [Human durations]): the warm rank's few hundred ms read "166.5 ms"
    times = {int(r): float(t) * (1e-3 if u == "ms" else 1.0)
             for r, t, u in re.findall(r"rank (\d) compiled (\d+\.\d) (s|ms)\b", f.message)}
    assert set(times) == {0, 1} and times[0] - times[1] == pytest.approx(f.wait_s, abs=0.11)
    assert "(compiles 0/0, 1/0)" in f.message  # the cold rank's evaluation and training frames
    assert f.message.startswith("FAIL: compile skew at step 0")
    assert f"of the {time_cases.TIMEOUT_S} s collective timeout" in f.message and "the job died in" in f.message
    assert rep.verdict == "FAIL"

    text = _cli(time_store, "check-ranks", "--run", "compile_timeout")
    assert text.returncode == 1 and f.message in text.stdout, text.stdout + text.stderr
    assert text.stdout.strip().splitlines()[-1] == "FAIL: a wait reaches the collective timeout"
    body = json.loads(_cli(time_store, "check-ranks", "--run", "compile_timeout", "--json").stdout)
    assert [x["verdict"] for x in body["time_findings"]] == ["FAIL"] and body["time_findings"][0]["step"] == 0
    summary = json.loads(_cli(time_store, "summary", "--run", "compile_timeout", "--json").stdout)
    ranks = next(c for c in summary["checks"] if c["key"] == "ranks")
    assert ranks["verdict"] == "FAIL" and ranks["headline"] == f.message


@pytest.mark.slow
def test_a_rank_that_recompiles_alone_is_named_as_the_cause_of_its_peers_wait(time_store):
    with Session(open_engine(time_store, read_only=True)) as s:
        rep = rank_report(s, s.scalar(select(Run).where(Run.name == "recompile_straggler")))
    strag = [f for f in rep.time_findings if f.kind == "straggler"]
    assert len(strag) == 1, rep.time_findings
    f = strag[0]
    assert (f.late_rank, f.waiting_ranks, f.step, f.step_source) == (1, [0], 2, "the profiler's step")
    assert "gloo:all_reduce" in f.collective and f.place == "outside the compiled regions"
    # A second of recompile against a 300 s timeout: told with its cause, no verdict of its own.
    assert f.verdict == "NOTE" and f.timeout_s == 300
    assert {g.verdict for g in rep.time_findings} == {"NOTE"}  # nothing near a timeout: no WARN, no FAIL
    assert [x["compile_id"] for x in f.recompiles] == ["0/1"]
    x = f.recompiles[0]
    assert "size mismatch at index 0. expected 4, actual 5" in x["reason"] and x["frame"]
    assert f.cause.startswith("rank 1 recompiled alone before it: compile 0/1 of frame")
    assert "guard failed" in f.cause and x["seconds"] > 0
    assert f.split_s["compile"] == pytest.approx(x["seconds"], abs=0.05)
    assert set(f.split_s) == {"compile", "data loading", "optimizer", "backward", "forward", "outside"}
    text = _cli(time_store, "check-ranks", "--run", "recompile_straggler").stdout
    assert "straggler explained: straggler at step 2" in text and "recompiled alone" in text, text
    with Session(open_engine(time_store, read_only=True)) as s:  # the same wait at a tighter share: WARN
        from graphdeck.analysis.ranks.compile_skew import compile_skew
        from graphdeck.analysis.ranks.heatmap import matched_run

        run = s.scalar(select(Run).where(Run.name == "recompile_straggler"))
        matched = matched_run(s, run.id)[1]
        tight = f.wait_s / f.timeout_s * 0.9
        got = time_findings(s, rep, compile_skew(s, run), matched, warn_fraction=tight)
        assert [g.verdict for g in got if g.kind == "straggler"] == ["WARN"]
        with pytest.raises(ValueError, match="warn_fraction"):
            time_findings(s, rep, compile_skew(s, run), matched, warn_fraction=0)


@pytest.mark.slow
def test_time_verdicts_agree_on_every_surface(time_store):
    assert not disagreements(time_store, ["compile_timeout", "recompile_straggler"])


def test_judge_and_stack_place():
    assert WARN_FRACTION == 0.5
    assert judge(20.0, 1800.0, False) == "NOTE"  # a first compile of 20 s is no skew worth a verdict
    assert judge(5.0, 10.0, False) == "WARN" and judge(10.0, 10.0, False) == "FAIL"
    assert judge(6.0, 10.0, True) == "FAIL" and judge(1.0, 10.0, True) == "NOTE"
    assert judge(3.0, None, True) == "NOTE"
    assert stack_place([]) is None
    assert stack_place(["/x/torch/distributed/distributed_c10d.py:3252 in all_reduce",
                        "/job/train.py:46 in train_step"]) == "outside the compiled regions (at /job/train.py:46 in train_step)"
    assert stack_place(["/x/torch/optim/sgd.py:10 in step", "/job/train.py:9 in main"]).startswith("in the optimizer")


def test_hang_steps_name_each_side_s_place_and_step(tmp_path):
    """A Flight Recorder mismatch (as analysis.ranks.flight builds it) in a real store whose ranks
    recorded gradient evidence up to different steps: the note names both places and both steps."""
    from graphdeck.analysis.ranks.flight import EntryRef, FlightReport, GroupMismatch
    from graphdeck.analysis.ranks.time_verdicts import hang_steps
    from graphdeck.store.schema import GradStep

    engine = open_engine(tmp_path / "h.db")
    with Session(engine) as s:
        run = Run(name="fsdp")
        s.add(run)
        s.flush()
        s.add_all([GradStep(run_id=run.id, rank=0, step_first=0, step_last=1, step_source="optimizer"),
                   GradStep(run_id=run.id, rank=1, step_first=0, step_last=2, step_source="optimizer")])
        s.commit()
        lib = "/x/torch/distributed/distributed_c10d.py:4000 in all_gather_into_tensor"
        gather = EntryRef(0, "0", 7, "gloo:all_gather", None, "scheduled", False, "train.py:40 in save",
                          False, [lib, "/job/train.py:40 in save"])
        nxt = EntryRef(1, "0", 7, "gloo:all_gather", None, "scheduled", False, None, True,
                       ["/x/torch/_inductor/output_code.py:600 in __call__", "/job/train.py:30 in step"])
        m = GroupMismatch("0", "default_pg", 7, "gloo:all_gather", None, [0, 1], [0], [1], [], "op",
                          issued={0: gather}, instead={1: None}, last_completed={}, doing={1: nxt})

        class Report:  # the two fields hang_steps reads from a RankReport
            run_id = run.id
            flight = FlightReport([0, 1], [0, 1], [], 2, [], [m], [])

        notes = hang_steps(s, Report())
    assert notes == ["hang step: group default_pg collective #7 gloo:all_gather: ranks [0] issued it outside the "
                     "compiled regions (at /job/train.py:40 in save); ranks [1] were instead in gloo:all_gather #7 of "
                     "group 0 inside a compiled region (at /job/train.py:30 in step); the last backward each rank "
                     "recorded: rank 0 step 1, rank 1 step 2 (gradient evidence)"]


def test_a_skew_not_placed_before_its_collective_is_told_not_judged(tmp_path):
    """First compiles summed (no trace, no dump: no record of when the collective ran) may hold an
    evaluation compiled long after it: never WARN or FAIL, however large; placed, the same is a FAIL."""
    from graphdeck.analysis.ranks.compile_skew import CompileSkew, RankCompile
    from graphdeck.analysis.ranks.time_verdicts import skew_finding

    with Session(open_engine(tmp_path / "s.db")) as s:
        run = Run(name="r")
        s.add(run)
        s.commit()
        ranks = {0: RankCompile(0, before_first_collective_s=4000.0), 1: RankCompile(1, before_first_collective_s=5.0)}
        skew = CompileSkew("r", ranks, slowest=0, fastest=1, skew_s=3995.0, finding="compile skew: ...")
        f = skew_finding(s, run, skew)
        assert (f.verdict, f.timeout_s) == ("NOTE", 1800.0) and "not judged" in f.message
        for v in ranks.values():
            v.basis = "trace"
        assert skew_finding(s, run, skew).verdict == "FAIL"


@pytest.mark.slow
@pytest.mark.browser
def test_ranks_page_shows_what_check_ranks_says(time_store, browser):
    """The rank-consistency page in Chromium over the real app, on both runs: the time verdict's
    FAIL line, the notes (the straggler explained) and the verdict are check-ranks' own text."""
    from tests.conftest import LiveServer

    with LiveServer(time_store) as srv:
        page = browser.new_page()
        for run in ("compile_timeout", "recompile_straggler"):
            text = _cli(time_store, "check-ranks", "--run", run).stdout.splitlines()
            page.goto(f"{srv.url}/#/runs/{run}/ranks")
            page.wait_for_selector("[data-testid=rank-verdict]")
            shown = [li.evaluate("e => e.lastChild.textContent") for li in page.get_by_test_id("time-finding").all()]
            assert shown == [ln for ln in text if ln.startswith(("FAIL: compile skew", "WARN: ", "FAIL: straggler"))]
            notes = [p.inner_text() for p in page.locator(".ranks-page > p.muted").all()]
            assert [f"note: {n}" for n in notes if f"note: {n}" in text] == [ln for ln in text if ln.startswith("note: ")]
            verdict = page.get_by_test_id("rank-verdict").locator("strong").inner_text()
            if run == "compile_timeout":
                assert len(shown) == 1 and shown[0].startswith("FAIL: compile skew at step 0"), shown
                assert text[-1] == "FAIL: a wait reaches the collective timeout" and verdict == text[-1][6:]
            else:
                assert shown == [] and any("straggler explained: straggler at step 2" in n for n in notes), notes
                # a harmless divergence is a warning: both say the schedules agree (the page puts it below)
                assert text[-1].startswith("OK: the collective schedules agree (") and \
                    verdict == "collective schedules agree (warnings below)"
        page.close()
