"""Replica agreement (issue 35, items 1, 2, 5): DDP gradient accumulation whose last micro-batch
ran under ``no_sync()`` at some steps — the replicas silently train different models — is a
``REPLICA_DIVERGENCE`` FAIL from the first such step, naming those steps and the fix; the fixed job
PASSes. Eager and compiled (aot_eager) DDP, one 2-rank job (tests/grad_replica_job.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphdeck.cli import main as cli
from tests.launch import run_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CASES = ("nosync_eager", "fixed_eager", "nosync_compiled", "fixed_compiled")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas")
    db = out / "replicas.db"
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECK_GRAD_PRINTS="")  # the default cadence
    proc = run_ranks([REPO / "tests" / "grad_replica_job.py", db, *CASES], 2, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return db


def check(db, run, *extra):
    """The real CLI: (exit code, output)."""
    res = CliRunner().invoke(cli, ["check-grads", str(db), "--run", run, *extra])
    return res.exit_code, res.output


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_unsynchronised_last_micro_batch_is_a_replica_divergence(store, mode):
    rc, out = check(store, f"nosync_{mode}", "--format", "json")
    assert rc == 1, out
    rep = json.loads(out)
    found = [f for f in rep["findings"] if f["kind"] == "REPLICA_DIVERGENCE"]
    assert len(found) == 1, rep["findings"]
    f = found[0]
    assert f["severity"] == "error" and sorted(f["ranks"]) == [0, 1]
    assert set(f["params"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    msg = f["message"]
    assert "from step 3 (they agreed at step 2)" in msg, msg  # the first no_sync step (BAD = 3, 6)
    assert "no_sync() at step(s) 3, 6" in msg and "never all-reduced" in msg, msg
    assert "train different models from step 3" in msg and "loss still looks right" in msg
    assert "norm" in msg and "rank 0" in msg and "rank 1" in msg
    assert "non-final micro-batches" in f["fix"]
    assert rep["verdict"] == "FAIL" and rep["coverage"]["replicas"]["groups"] == [[0, 1]]
    rc_text, text = check(store, f"nosync_{mode}")
    assert rc_text == 1 and f"REPLICA_DIVERGENCE (error): {msg}" in text  # the same finding in the text report
    from fastapi.testclient import TestClient

    from graphdeck.server.app import create_app
    from graphdeck.server.settings import Settings

    api = TestClient(create_app(Settings(store=store))).get(f"/api/runs/nosync_{mode}/gradients").json()
    assert api["verdict"] == "FAIL" and [f for f in api["findings"] if f["kind"] == "REPLICA_DIVERGENCE"] == found


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_no_sync_on_non_final_micro_batches_only_passes(store, mode):
    rc, out = check(store, f"fixed_{mode}", "--format", "json")
    rep = json.loads(out)
    assert rc == 0 and rep["verdict"] == "PASS", out[-3000:]
    assert not [f for f in rep["findings"] if f["kind"] == "REPLICA_DIVERGENCE"]
    cov = rep["coverage"]["replicas"]
    # default cadence 5,100: steps 0-4 fingerprinted (8 steps, no change of the sync state after)
    assert cov["groups"] == [[0, 1]] and cov["fingerprinted_steps"] == "0–4" and not cov["unsynced_steps"]
    assert "replicas compared: [0, 1] (data parallel) at fingerprinted step(s) 0–4" in check(store, f"fixed_{mode}")[1]


def test_fingerprints_are_stored_per_step_and_rank(store):
    import sqlite3

    con = sqlite3.connect(store)
    rows = con.execute("SELECT c.rank, c.payload FROM compile_events c JOIN runs r ON r.id = c.run_id "
                       "WHERE r.name = 'nosync_eager' AND c.name = 'graphdeck_grad_prints' ORDER BY c.rank, c.id")
    by_rank: dict = {}
    for rank, payload in rows:
        by_rank.setdefault(rank, []).append(json.loads(payload))
    assert sorted(by_rank) == [0, 1]
    for rank, recs in by_rank.items():
        values = [r for r in recs if "grad" in r]
        # steps 0-4 by the cadence, 5 (sync state back to reduced: changed), 6 (no_sync again), 7 (changed)
        assert [r["first"] for r in values] == [0, 1, 2, 3, 4, 6, 7], recs
        assert "names" in values[0] and "names" not in values[1]  # the name list once, while it holds
        assert all(len(r["grad"]) == len(r["param"]) == 4 for r in values)
        plain = [r for r in recs if "grad" not in r]
        assert [(r["first"], r["last"], r["last_synced"]) for r in plain] == [(5, 5, True)], recs
        assert [r["synced"] for r in values[:1]] == [[False, False, False, True]]
        assert values[3]["last_synced"] is False and values[3]["synced"] == [False] * 4


@pytest.fixture(scope="module")
def tp_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas_tp")
    db = out / "tp.db"
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECK_GRAD_PRINTS="")
    proc = run_ranks([REPO / "tests" / "grad_tp_job.py", db, "tp_nograd", "tp_fixed"], 2, env=env, cwd=REPO,
                     timeout=600)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return db


def test_tp_replicate_parameter_without_grad_placements_diverges(tp_store):
    """A Replicate DTensor parameter used through to_local() without grad_placements: its TP peers
    get rank-local partial gradients marked Replicate (no all-reduce in the backward)."""
    rc, out = check(tp_store, "tp_nograd", "--format", "json")
    assert rc == 1, out
    rep = json.loads(out)
    found = [f for f in rep["findings"] if f["kind"] == "REPLICA_DIVERGENCE"]
    assert len(found) == 1 and found[0]["params"] == ["gain"] and found[0]["ranks"] == [0, 1], rep["findings"]
    msg = found[0]["message"]
    assert "mesh dimension 'tp'" in msg and "TP peers on ranks [0, 1]" in msg and "from step 0" in msg, msg
    assert "marked Replicate()" in msg and "all-reduce" in msg and "missing from the backward" in msg, msg
    assert "grad_placements=[Partial()]" in found[0]["fix"]
    assert rep["coverage"]["replicas"]["tp"] == [{"dim": "tp", "ranks": [0, 1], "params": ["gain"]}]
    assert rep["coverage"]["replicas"]["fingerprinted_steps"] == "0–3"


def test_tp_to_local_with_grad_placements_passes(tp_store):
    """The same block with to_local(grad_placements=[Partial()]): the local gradients are Partial
    (different per rank by design, not compared), the parameters after each step agree: PASS."""
    rc, out = check(tp_store, "tp_fixed", "--format", "json")
    rep = json.loads(out)
    assert rc == 0 and rep["verdict"] == "PASS", out[-3000:]
    assert rep["coverage"]["replicas"]["tp"] == [{"dim": "tp", "ranks": [0, 1], "params": ["gain"]}]
