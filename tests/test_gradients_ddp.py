"""The gradient cases that need 2 gloo ranks under DDP + torch.compile, in one 2-rank job
(tests/grad_ddp_job.py): G1 with aot_eager and with Inductor (step 2 really raises DDP's
"Expected to have finished reduction"; the report, from what step 1 captured, predicts it), G4
(rank-dependent branch: predicted hang, captured from the forward alone), and G2, G3, G5 under DDP."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from graphdeck import validate_backward
from tests import grad_cases as C
from tests.launch import run_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CASES = ("g2", "g3", "g4", "g5", "g1", "g1_inductor")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("grads_ddp")
    store, result = out / "ddp.db", out / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=str(out / "inductor-cache"))
    proc = run_ranks([REPO / "tests" / "grad_ddp_job.py", store, result, *CASES], 2, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return store, json.loads(result.read_text())


def rows(rep):
    return {(r.rank, r.fqn): r for r in rep}


@pytest.mark.parametrize("case", ["g1", "g1_inductor"])
def test_g1_unused_module_predicts_the_ddp_error(job, case):
    store, outcome = job
    for rank in (0, 1):
        errs = outcome[rank][case]["errors"]
        assert errs and errs[0]["step"] == 2 and "Expected to have finished reduction" in errs[0]["message"], \
            f"G1 really fails at step 2 on rank {rank}: {outcome[rank][case]}"
    if case == "g1":
        for rank in (0, 1):
            eager = outcome[rank][case]
            assert eager["eager"]["extra.weight"] == eager["eager"]["extra.bias"] == "NOT_IN_GRAPH", eager
            assert eager["eager_findings"] == ["DDP_UNUSED_ERROR"] and eager["steps_done"] == 1, \
                "eager mode on the DDP model predicts the error and leaves DDP able to run step 1"
    rep = validate_backward(store, case)
    status = {k: r.status for k, r in rows(rep).items()}
    for rank in (0, 1):
        assert status[(rank, "extra.weight")] == status[(rank, "extra.bias")] == "NOT_IN_GRAPH"
        assert all(status[(rank, f"{m}.{p}")] == "OK" for m in ("enc", "head") for p in ("weight", "bias"))
    ddp = [f for f in rep.findings if f.kind == "DDP_UNUSED_ERROR"]
    assert len(ddp) == 1 and ddp[0].params == ["extra.bias", "extra.weight"], rep.findings
    assert "Expected to have finished reduction" in ddp[0].message and "find_unused_parameters=True" in ddp[0].fix
    assert "freeze" in ddp[0].fix and not rep.ok


def test_g4_rank_dependent_branch_is_a_predicted_hang(job):
    store, _ = job
    rep = validate_backward(store, "g4")
    r = rows(rep)
    assert r[(0, "dn_embed.weight")].status == "NOT_IN_GRAPH" and r[(1, "dn_embed.weight")].status == "OK"
    hang = [f for f in rep.findings if f.kind == "PREDICTED_HANG"]
    assert len(hang) == 1 and hang[0].params == ["dn_embed.weight"] and hang[0].ranks == {0: "NOT_IN_GRAPH", 1: "OK"}
    assert hang[0].source == C.line_of("G4-branch") and "hang" in hang[0].message, hang[0]
    assert "find_unused_parameters=True" in hang[0].fix
    assert not [f for f in rep.findings if f.kind == "DDP_UNUSED_ERROR"], "rank 1 uses it: a hang, not 'unused everywhere'"


def test_g2_g3_g5_under_ddp(job):
    store, outcome = job
    assert outcome[0]["g5"]["steps_done"] == 2 and not outcome[0]["g5"]["errors"], "G5 trains silently"
    g2 = rows(validate_backward(store, "g2"))
    g3 = rows(validate_backward(store, "g3"))
    g5 = rows(validate_backward(store, "g5"))
    for rank in (0, 1):
        assert g2[(rank, "tgt_head.weight")].status == "DEAD_END" and g2[(rank, "trunk.0.weight")].paths == 1
        assert g2[(rank, "tgt_head.weight")].cut.source == C.line_of("G2-return")
        b = g3[(rank, "backbone.0.weight")]
        assert b.status == "NO_GRAD" and b.cut.kind == "no_grad" and b.cut.region == C.line_of("G3-region")
        assert g3[(rank, "head.weight")].status == "OK"
        assert {f for (rk, f), x in g5.items() if rk == rank and x.status != "OK"} == {"blk2.weight", "blk2.bias"}
        assert g5[(rank, "blk2.bias")].cut.source == C.line_of("G5-cut")
        buckets = {f: g5[(rank, f)].bucket for f in ("emb.weight", "blk1.weight", "blk2.weight", "head.weight")}
        assert buckets == {"emb.weight": 0, "blk1.weight": 1, "blk2.weight": 2, "head.weight": 2}, \
            f"1 MiB weights in 1 MiB buckets: DDPOptimizer split G5 into 3 buckets; {buckets}"
        assert g5[(rank, "blk2.weight")].cut.graph_id not in g5[(rank, "blk2.weight")].grad_graphs, \
            "the cut is found in the unsplit Dynamo graph, the gradient in the bucket's backward graph"
