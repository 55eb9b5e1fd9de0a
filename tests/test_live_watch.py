"""The live watch (issue 38 item 1; NOTE: [Live watch] in capture/heartbeat.py).

One real 2-rank gloo job (tests/live_hang_job.py: rank 1 sleeps 40 s inside step 2 before the
gradient all-reduce, 15 s collective timeout, 1 s heartbeat, 4 s threshold) runs under
``graphdeck watch``: the agents write the hang report while the job still hangs — before rank 0's
collective timeout fires, by the job's own clock — naming the step, the group, the collective and
the sleeping frame; the watch prints it and exits 1; the job still ends by gloo's timeout (rank 0)
and torchrun's SIGTERM (rank 1), as it would without graphdeck. A healthy in-process run ends the
watch with exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "live_hang_job.py"
_LINES = JOB.read_text().splitlines()
SLEEP_LINE = next(i for i, t in enumerate(_LINES, 1) if "# SLEEPING_FRAME" in t)
REDUCE_LINE = next(i for i, t in enumerate(_LINES, 1) if "# GRAD_ALL_REDUCE" in t)


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    out = tmp_path_factory.mktemp("live")
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECK_HEARTBEAT_S="1", GRAPHDECK_WATCH_THRESHOLD_S="4")
    env.pop("TORCH_FR_BUFFER_SIZE", None)  # the agent turns the recorder on
    store = out / "s.db"
    watch = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "watch", str(store), "--run", "live",
                              "--wait-s", "90", "--poll-s", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env=env)
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(JOB), str(store), str(out / "out")], capture_output=True, text=True, env=env,
                         timeout=150, cwd=REPO)
    w_out, w_err = watch.communicate(timeout=60)
    ranks = {r: json.loads((out / "out" / f"rank{r}.json").read_text()) for r in (0, 1)}
    with Session(open_engine(store, read_only=True)) as s:
        rows = s.execute(select(CompileEvent.rank, CompileEvent.name, CompileEvent.metadata_json, CompileEvent.payload)
                         .where(CompileEvent.name.in_(["graphdeck_hang_report", "graphdeck_heartbeat",
                                                       "graphdeck_stacks", "flight_recorder"]))).all()
        from graphdeck.analysis.ranks.live import live_hang
        from graphdeck.store.schema import Run

        again = live_hang(s, s.scalar(select(Run.id).where(Run.name == "live")))  # after the job, from the store
    return job, (watch.returncode, w_out, w_err), ranks, rows, again


@pytest.mark.slow
def test_hang_report_written_while_the_job_hangs(hung):
    job, _watch, ranks, rows, again = hung
    reports = [json.loads(p) for _r, n, _m, p in rows if n == "graphdeck_hang_report"]
    assert len(reports) == 1, job.stderr[-3000:]
    rep = reports[0]
    # the job's own clock: issued step 2's all-reduce, then the report, then the collective timeout
    assert ranks[0]["issued"]["2"] < rep["written_at"] < ranks[0]["timeout_at"], (ranks, rep["written_at"])
    assert (rep["timeout_s"], rep["threshold_s"]) == (15, 4), "the process group's timeout, read in the job"
    assert rep["step"] == 2 and {r["step"] for r in rep["ranks"].values()} == {2}
    (g,) = rep["groups"]
    assert (g["desc"], g["op"], g["issued_by"], g["not_issued_by"]) == ("grads", "gloo:all_reduce", [0], [1])
    assert g["seq"] == 9, "the first all-reduce of step 2 (1 barrier on the default group; 4 per step on grads)"
    r0, r1 = rep["ranks"]["0"], rep["ranks"]["1"]
    assert r1["frame"].endswith(f"live_hang_job.py:{SLEEP_LINE} in train_step") and "time.sleep(40)" in r1["source"]
    assert r0["frame"].endswith(f"live_hang_job.py:{REDUCE_LINE} in train_step")
    assert r0["waiting"]["seq"] == 9 and r1["waiting"] is None, "gloo's lagging completed count is no stall"
    assert [(g.group, g.seq, g.op, g.issued_by, g.not_issued_by) for g in again.groups] == \
        [(g["group"], g["seq"], g["op"], g["issued_by"], g["not_issued_by"]) for g in rep["groups"]], \
        "the stored report is what the stored evidence gives (the watch computes the same one itself)"
    text = "\n".join(rep["lines"])
    assert "at step 2" in text and "group 1 (grads): collective #9 gloo:all_reduce" in text and "time.sleep(40)" in text


@pytest.mark.slow
def test_each_rank_dumped_live_and_the_job_ended_by_its_own_timeout(hung):
    job, _watch, ranks, rows, again = hung
    stall_dumps = {r for r, n, m, _p in rows if n == "flight_recorder" and json.loads(m)["reason"] == "stall"}
    assert stall_dumps == {0, 1}, "each live rank's watcher thread dumped its recorder"
    assert {r for r, n, _m, _p in rows if n == "graphdeck_stacks"} == {0, 1}
    beats = [r for r, n, _m, _p in rows if n == "graphdeck_heartbeat"]
    assert sorted(beats) == [0, 1], "one heartbeat row a rank, updated in place"
    # not stopped by graphdeck: rank 0 waited out the whole 15 s timeout; rank 1 was ended by torchrun
    assert job.returncode != 0 and "Timed out waiting 15000ms" in ranks[0]["error"]
    assert ranks[0]["timeout_at"] - ranks[0]["issued"]["2"] >= 15
    assert "timeout_at" not in ranks[1] and "exitcode  : -15" in job.stderr


@pytest.mark.slow
def test_watch_prints_the_report_and_exits_1(hung):
    _job, (rc, out, err), _ranks, _rows, _again = hung
    assert rc == 1, (out[-2000:], err[-2000:])
    assert "HANG (live: the job is still running) at step 2" in out
    assert f"live_hang_job.py:{SLEEP_LINE} in train_step: time.sleep(40)" in out
    assert "rank 0: step" in out, "progress per rank before the hang"


@pytest.mark.parametrize("evidence", ["1", "0"])
def test_watch_exits_0_on_a_healthy_run(tmp_path, monkeypatch, evidence):
    import torch
    from click.testing import CliRunner

    from graphdeck.capture import Agent
    from graphdeck.cli import main as cli

    monkeypatch.setenv("GRAPHDECK_HEARTBEAT_S", "0.2")
    monkeypatch.setenv("GRAPHDECK_GRAD_EVIDENCE", evidence)  # off: the heartbeat counts the steps itself
    agent = Agent(store=tmp_path / "h.db", run="ok")
    net = agent.watch(torch.nn.Linear(4, 1))
    model = torch.compile(net, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    res = CliRunner().invoke(cli, ["watch", str(tmp_path / "h.db"), "--run", "ok", "--poll-s", "0.1"])
    assert res.exit_code == 0, res.output
    assert "rank 0: step 3" in res.output and "run ended healthy" in res.output
    from graphdeck.analysis.ranks import live
    from graphdeck.capture import heartbeat

    assert (heartbeat.HEARTBEAT, heartbeat.STACKS, heartbeat.REQUEST) == (live.HEARTBEAT, live.STACKS, live.REQUEST)
