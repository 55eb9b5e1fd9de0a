"""Issue 35 item 4, overlap by construction: compiled DDP with ``optimize_ddp=False`` runs one
backward graph for every gradient bucket, so no all-reduce overlaps the backward — a WARN of
check-compile (and of the summary's compile line), with the cost measured from the trace; the same
job with Dynamo's default (DDPOptimizer's split) has no such finding. A performance finding: exit
0 everywhere. One real 2-rank gloo job (tests/ddp_overlap_job.py, aot_eager, 1 MiB buckets)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from graphdeck.cli import main as cli
from graphdeck.server.app import create_app
from graphdeck.server.settings import Settings
from tests.launch import run_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    db = tmp_path_factory.mktemp("ddp_overlap") / "ddp.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_ranks([REPO / "tests" / "ddp_overlap_job.py", db, "nosplit", "split"], 2, env=env, cwd=REPO,
                     timeout=600)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return db


def _bucket_count(db: Path, run: str, rank: int) -> int:
    import sqlite3

    with sqlite3.connect(db) as con:
        payload = con.execute("SELECT payload FROM compile_events e JOIN runs r ON r.id = e.run_id WHERE r.name = ? "
                              "AND e.rank = ? AND e.name = 'graphdeck_comm_groups' ORDER BY e.id DESC LIMIT 1",
                              (run, rank)).fetchone()[0]
    return sum(len(d["buckets"]) for d in json.loads(payload)["ddp"])


def test_one_backward_graph_for_every_bucket_is_a_warn_with_its_cost(store):
    buckets = _bucket_count(store, "nosplit", 0)
    assert buckets >= 2, "1 MiB buckets over four 1 MiB weights: several buckets"
    res = CliRunner().invoke(cli, ["check-compile", str(store), "--run", "nosplit", "--format", "json"])
    assert res.exit_code == 0, res.output  # a performance finding never fails the gate
    rep = json.loads(res.output)
    assert rep["verdict"] == "WARN"
    (f,) = rep["ddp_overlap"]
    assert f["ranks"] == [0, 1] and f["mode"] == "no_optimization"
    assert f["buckets"] == f["total_buckets"] == buckets and f["params"] == 8
    assert f["measured"]["where"] == "cpu" and f["measured"]["rank"] == 0
    assert f["measured"]["comm_busy_ns"] > 0 and f["measured"]["ratio"] is not None
    msg = f["message"]
    assert f"all {buckets} DDP buckets" in msg and "optimize_ddp=False" in msg
    assert "Fix: leave torch._dynamo.config.optimize_ddp on" in msg and "measured on rank 0" in msg
    assert rep["warnings"] == [msg] and rep["summary"]["ddp_no_overlap"] == 1

    text = CliRunner().invoke(cli, ["check-compile", str(store), "--run", "nosplit"])
    assert text.exit_code == 0 and f"WARN: {msg}" in text.output

    # the gate makes it a FAIL (exit 1), the same sentence, and a failed JUnit case
    junit = store.parent / "compile.xml"
    gated = CliRunner().invoke(cli, ["check-compile", str(store), "--run", "nosplit", "--fail-on-ddp-no-overlap",
                                     "--junit", str(junit), "--json"])
    assert gated.exit_code == 1, gated.output
    g = json.loads(gated.output)
    assert g["verdict"] == "FAIL" and g["findings"] == [f"--fail-on-ddp-no-overlap: {msg}"] and g["warnings"] == []
    assert 'name="DDP communication overlap"' in junit.read_text() and "<failure" in junit.read_text()

    # the summary's compile line: WARN with the same sentence, exit 0
    res = CliRunner().invoke(cli, ["summary", str(store), "--run", "nosplit", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    compile_line = next(c for c in s["checks"] if c["key"] == "compile")
    assert compile_line["verdict"] == "WARN" and f"WARN: {msg}" in compile_line["reasons"]
    assert "cannot overlap its gradient all-reduces" in compile_line["headline"]

    # the API (the run page's compile-health panel reads it) says the same
    with TestClient(create_app(Settings(store=store))) as client:
        api = client.get("/api/runs/nosplit/compile-health").json()
    assert api["verdict"] == "WARN" and api["warnings"] == [msg]


def test_ddp_optimizer_split_has_no_overlap_finding(store):
    res = CliRunner().invoke(cli, ["check-compile", str(store), "--run", "split", "--format", "json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["ddp_overlap"] == [] and rep["verdict"] == "PASS", rep["warnings"]
    gated = CliRunner().invoke(cli, ["check-compile", str(store), "--run", "split", "--fail-on-ddp-no-overlap"])
    assert gated.exit_code == 0, gated.output
    res = CliRunner().invoke(cli, ["summary", str(store), "--run", "split"])
    assert res.exit_code == 0 and "cannot overlap" not in res.output, res.output
