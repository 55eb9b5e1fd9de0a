"""Hangs told at their training step (issue 38 items 5 and 2), on real 2-rank gloo jobs of
tests/step_hang_job.py, both started at once (one fixture):

* ``hang``: rank 1 gets zero tokens at step 2 (Dynamo recompiles ``route`` there without its
  all-reduce) and float64 tokens at step 3 (compiled again: an all-reduce of another group). The
  graphs carry the step they were compiled at (NOTE: [Compile steps]); the predicted schedule of
  the hung group compares the graphs live at the step of the hang, step 2 — rank 1's compile 0/1
  — not rank 1's latest compile 0/2, made at step 3 (NOTE: [Compiles live at a step]).
* ``sleep``: rank 0 sleeps 4 s in its data loader at step 2, without a trace: the heartbeats' time
  outside the compiled step makes a WARN (67 % of the 6 s collective timeout) naming the step,
  the ranks and the cause (NOTE: [Time outside the compiled step]).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import rank_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Run
from tests.launch import Ranks, wait_all

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "step_hang_job.py"


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("step_hang")
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECK_HEARTBEAT_S="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    paths = {mode: out / f"{mode}.db" for mode in ("hang", "sleep")}
    jobs = {mode: Ranks([JOB, paths[mode], mode], 2, env=env, cwd=REPO) for mode in paths}
    done = wait_all(jobs, timeout=240)
    assert done["hang"].returncode == 1, "the hang job ends by its collective timeout"
    assert "Timed out" in done["hang"].stderr, done["hang"].stderr[-3000:]
    assert done["sleep"].returncode == 0, f"{done['sleep'].stdout[-2000:]}\n{done['sleep'].stderr[-4000:]}"
    return paths


def _report(path: Path, run: str):
    with Session(open_engine(path, read_only=True)) as s:
        return rank_report(s, s.scalar(select(Run).where(Run.name == run)))


@pytest.mark.slow
def test_each_graph_records_the_step_it_was_compiled_at(stores):
    with Session(open_engine(stores["hang"], read_only=True)) as s:
        rows = s.execute(select(Graph.rank, Graph.compile_id, Graph.meta_json).where(Graph.kind == "dynamo")).all()
    steps = {(r, cid): json.loads(meta).get("step") for r, cid, meta in rows}
    assert steps == {(0, "0/0"): 0, (1, "0/0"): 0, (1, "0/1"): 2, (1, "0/2"): 3}, steps


@pytest.mark.slow
def test_the_hung_groups_prediction_compares_the_graphs_live_at_the_step_of_the_hang(stores):
    rep = _report(stores["hang"], "steps")
    checks = {c.desc: c for c in rep.predictions}
    tokens, evals = checks["tokens"], checks["eval"]
    # tokens hung at step 2 (rank 0 waits in its all-reduce #3, its heartbeat at step 2): rank 1 ran
    # compile 0/1 there (zero tokens, no all-reduce), not compile 0/2 it made at step 3
    assert tokens.step == 2 and "rank 0" in tokens.step_source and "heartbeat" in tokens.step_source
    assert tokens.predicted_skipping == [1], tokens.predicted
    assert "ranks [1] run compile 0/1 (compiled at step 2)" in tokens.predicted, tokens.predicted
    assert "0/2" not in tokens.predicted, tokens.predicted
    assert tokens.outcome == "held" and tokens.recorded_not_reached == [1]
    # eval hung at step 3 (rank 1 waits in its all-reduce #1): rank 1's compile 0/2 issues it
    assert evals.step == 3 and evals.predicted_skipping == [0], evals.predicted
    assert [s["compile_id"] for s in evals.predicted_segments[1]] == ["0/2"], evals.predicted_segments
    assert evals.outcome == "held"
    text = rep.to_text()
    assert "at step 2 (the step of the hang" in text and "at step 3 (the step of the hang" in text, text


@pytest.mark.slow
def test_time_outside_the_compiled_step_is_judged_against_the_collective_timeout(stores):
    rep = _report(stores["sleep"], "loader")
    found = [f for f in rep.time_findings if f.kind == "outside skew"]
    assert len(found) == 1, [f.message for f in rep.time_findings]
    f = found[0]
    assert (f.verdict, f.step, f.late_rank, f.waiting_ranks) == ("WARN", 2, 0, [1]), f.message
    assert 3.5 <= f.wait_s < 6 and f.timeout_s == 6.0, f.message  # SLEEP_S 4 s (a loaded host sleeps longer)
    assert f.cause == "outside the compiled step (data loader/eval)"
    assert "step 2" in f.message and "rank 0" in f.message and f.message.startswith("WARN")
    assert rep.verdict == "WARN" and f.message in rep.to_text()
    # the hang job's steps held no such wait (its ranks' loaders are instant): no finding there
    assert not [f for f in _report(stores["hang"], "steps").time_findings if f.kind == "outside skew"]


def _beats(tmp_path, outside: dict[int, dict], steps: dict[int, int], stalled: set[int] = frozenset()):
    """A real store holding two ranks' heartbeats as the agents write them (6 s timeout, one
    collective done), and ``outside_finding`` of it."""
    from graphdeck.analysis.ranks.time_verdicts import outside_finding
    from graphdeck.store.db import get_or_create_run, write_session
    from graphdeck.store.schema import CompileEvent

    tmp_path.mkdir(parents=True, exist_ok=True)
    engine = open_engine(tmp_path / "s.db")
    with write_session(engine) as s:
        run = get_or_create_run(s, "r")
        for r in sorted(outside):
            beat = {"t": 1.0, "step": steps[r], "groups": {"1": {"enqueued": 4, "completed": 4}},
                    "stalled": {"group": "1", "seq": 4} if r in stalled else None, "timeout_s": 6.0,
                    "outside": {str(k): v for k, v in outside[r].items()}}
            s.add(CompileEvent(run_id=run.id, rank=r, name="graphdeck_heartbeat", compile_id=None,
                               metadata_json="{}", payload=json.dumps(beat)))
        s.flush()
        run_id = run.id
    with Session(engine) as s:
        return outside_finding(s, s.get(Run, run_id))


def test_time_outside_the_step_past_the_timeout_fails_and_a_wait_with_a_collective_in_it_is_not_judged(tmp_path):
    f = _beats(tmp_path, {0: {1: 0.0, 2: 7.2}, 1: {1: 0.0, 2: 0.1}}, {0: 3, 1: 3})
    assert (f.verdict, f.step, f.late_rank, f.waiting_ranks, f.wait_s) == ("FAIL", 2, 0, [1], 7.1), f.message
    assert f.message.startswith("FAIL: time outside the compiled step at step 2") and "118% of the 6 s" in f.message
    # the waiting rank stalled in that step: the job died there, FAIL from the WARN share
    died = _beats(tmp_path / "d", {0: {2: 3.4}, 1: {2: 0.0}}, {0: 2, 1: 2}, stalled={1})
    assert (died.verdict, died.died) == ("FAIL", True), died.message
    # rank 1 received from rank 0 in between (a collective in its window: None): not comparable
    assert _beats(tmp_path / "c", {0: {2: 7.2}, 1: {2: None}}, {0: 3, 1: 3}) is None
    # a peer that went through the step, its figure not listed (it lists every step): 0 s there
    f = _beats(tmp_path / "u", {0: {2: 4.0}, 1: {1: 0.0}}, {0: 3, 1: 3})
    assert (f.verdict, f.waiting_ranks, f.wait_s) == ("WARN", [1], 4.0), f.message
    # under the WARN share (50 % of 6 s): nothing said; a peer that has not reached the step: none
    assert _beats(tmp_path / "n", {0: {2: 2.5}, 1: {2: 0.0}}, {0: 3, 1: 3}) is None
    assert _beats(tmp_path / "p", {0: {2: 9.0}, 1: {}}, {0: 3, 1: 1}) is None
