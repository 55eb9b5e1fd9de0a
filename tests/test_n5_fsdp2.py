"""Case N5 (``shared/cases/compile-and-ranks.md``; pytorch/pytorch#158719): FSDP2 parameters used
differently on each rank, answered in FSDP2's words.

One real torchrun job (``tests/programs/n5_fsdp2_experts.py``, 2 gloo ranks): ``inp``,
``expert_a``, ``expert_b``, ``out`` under one ``fully_shard`` group, compiled; rank 0 routes no
token to ``expert_b``, rank 1 does. The job dies in the first backward (the group's
reduce-scatter sizes differ). ``graphdeck check-grads`` and ``graphdeck check-ranks`` are run on
its store as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PROGRAM = REPO / "tests" / "programs" / "n5_fsdp2_experts.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def n5(tmp_path_factory) -> dict:
    store = tmp_path_factory.mktemp("n5") / "n5.db"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(PROGRAM), str(store)], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    dropped = drop_rank0_dump(store)
    return {"store": store, "job": job, "grads": graphdeck("check-grads", store), "ranks": graphdeck("check-ranks", store),
            "dropped": dropped}


def drop_rank0_dump(store: Path) -> int:
    """The case as reported: rank 0, stopped inside gloo's reduce-scatter, writes no Flight Recorder
    dump. Whether it gets to write one is a race with torchrun stopping it (its SIGTERM handler runs
    only if gloo's call returns first; under load it sometimes does), so a dump it did write is
    deleted here, to test what a missing dump makes of the verdicts; returns the records deleted."""
    import sqlite3

    with sqlite3.connect(store) as db:
        return db.execute("DELETE FROM compile_events WHERE name = 'flight_recorder' AND rank = 0").rowcount


def graphdeck(command: str, store: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("graphdeck")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "graphdeck.cli"]
    return subprocess.run([*cmd, command, str(store), "--run", "n5"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)


def branch_line() -> int:
    return next(i for i, t in enumerate(PROGRAM.read_text().splitlines(), 1) if "N5_BRANCH" in t)


def test_the_job_dies_in_the_first_backward(n5):
    job = n5["job"]
    assert job.returncode != 0, "the reduce-scatter sizes differ: the job must fail"
    out = job.stdout + job.stderr
    assert "Received data size doesn't match expected size" in out or "Connection reset" in out, out[-3000:]


def test_check_grads_speaks_fsdp2(n5):
    res = n5["grads"]
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("NOT_IN_GRAPH", "OK "))]
    assert ["NOT_IN_GRAPH", "rank", "0", "expert_b.weight"] in rows and ["NOT_IN_GRAPH", "rank", "0", "expert_b.bias"] in rows
    assert not any(r[2] == "1" for r in rows), "expert_b.* is OK on rank 1"
    # The consequence in FSDP2's words, with the branch's source line.
    finding = next(ln for ln in out.splitlines() if "PREDICTED_HANG" in ln and "expert_b.weight" in ln)
    assert "gradient on rank(s) [1] but not on rank(s) [0]" in finding
    assert "the root fully_shard group (8 parameters)" in finding
    assert "post-backward reduce-scatter then has a different input size on each rank" in finding
    assert "Received data size doesn't match expected size" in finding and "silent gradient corruption on NCCL" in finding
    assert f"n5_fsdp2_experts.py:{branch_line()}: if use_b:" in finding
    # The fixes FSDP2 has; DDP's words nowhere.
    assert "touch every parameter on every rank (add 0 * p.sum()" in out
    assert "put expert_b in its own fully_shard group(s) and make the routing rank-consistent" in out
    assert "find_unused_parameters" not in out and "all-reduce" not in out and "DDP" not in out
    # The job was captured: evidence is missing because it died in its first backward, not for want of agent.watch.
    assert "rank(s) [0, 1] never finished a backward: the job died in (or before) its first backward" in out
    assert "capture the job with graphdeck's Agent" not in out


def test_check_ranks_diverge_at_compile_0_0_on_expert_b(n5):
    res = n5["ranks"]
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    (diverged,) = [ln for ln in out.splitlines() if ln.startswith("DIVERGED")]
    assert diverged.startswith("DIVERGED ranks [1] vs [0]: compile 0/0: dynamo graph differs")
    assert "only the graph of ranks [1] reads expert_b.bias, expert_b.weight" in diverged
    assert f"the branch at n5_fsdp2_experts.py:{branch_line()}: if use_b:" in diverged
    assert "post-backward reduce-scatter then has a different input size on each rank" in diverged
    assert "rank(s) [0] lack their gradients" in diverged
    assert "find_unused_parameters" not in out
    assert "FAIL: ranks diverge" in out
    # One fact, one answer (issue 34): the prediction table beside that DIVERGED line never says
    # "no hang" — it names the divergence (NOTE: [No "no hang" beside a divergence]).
    (pred,) = [ln for ln in out.splitlines() if ln.strip().startswith("group 0 (default_pg): predicted")]
    assert "predicted: no hang" not in pred, pred
    assert "predicted: a possible mismatch" in pred and "ranks [1] vs [0] diverge (graph differs at compile 0/0" in pred


def test_a_rank_without_a_dump_makes_the_hang_check_incomplete(n5):
    """Issue 20: rank 0 aborted in the reduce-scatter and wrote no Flight Recorder dump, so group
    0's collectives cannot be told to match: check-ranks, its prediction table and the parallel
    map's hang badge say INCOMPLETE, never "match" / "held" / ok."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.server.routes.parallel_map import parallel_map
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    out = n5["ranks"].stdout
    assert "no Flight Recorder dump from ranks [0]" in out and "INCOMPLETE: rank 0: no Flight Recorder dump" in out
    assert "0 group(s) agree, 1 incomplete, 0 mismatched" in out, out
    assert "INCOMPLETE group 0 (default_pg): members [0] have no dump" in out
    # issue 38 item 4: what rank 1's dump shows, and that it alone does not explain the hang
    assert "what the dumps show: rank 1's latest collective of the group is gloo:all_reduce" in out, out
    assert "issued by backward" in out and "no condition on the rank in its stack keeps ranks [0] from it" in out
    (pred,) = [ln for ln in out.splitlines() if ln.strip().startswith("group 0 (default_pg): predicted")]
    assert pred.endswith(": incomplete") and "members [0] have no Flight Recorder dump" in pred, pred
    assert "— recorded: members [1] completed " in pred and "recorded: every member" not in pred
    with Session(open_engine(n5["store"], read_only=True)) as s:
        run = s.scalars(select(Run).where(Run.name == "n5")).one()
        hang = next(c for c in parallel_map(s, run, checks=["hang"])["checks"] if c["key"] == "hang")
    assert hang["ran"] and hang["verdict"] == "INCOMPLETE", hang
    assert "every group's collectives match" not in hang["message"]
    assert "INCOMPLETE: ranks 0 wrote no dump" in hang["message"], hang
    assert hang["counts"] == {"unknown": 2}, "rank 0: no dump; rank 1: its group cannot be compared — neither ok"


def test_every_surface_gives_n5_the_same_verdicts(n5):
    """Issue 34: CLI text and exit code, --json and the HTTP API agree on every check (tests/verdict_surfaces.py)."""
    from tests.verdict_surfaces import disagreements

    assert not disagreements(n5["store"], ["n5"])
