"""DDP predictions against what real torch 2.13 DDP did (issue 34 items 1-2): one 2-rank gloo job
(tests/verdict_ddp_job.py) runs each case captured by graphdeck's Agent and records what really
happened — steps completed, the error raised, how far the ranks' gradients differ — and eager
mode's findings on the same DDP model; every prediction is checked against that record.
NOTE: [READY_TWICE under DDP] and NOTE: [Predictions the run contradicts] (analysis/gradients/outcome.py)."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from graphdeck import validate_backward
from tests.launch import run_ranks

REPO = Path(__file__).resolve().parents[1]
TWICE_ERROR = "Expected to mark a variable ready only once"
LORA = ["block.lora_a.weight", "block.lora_b.weight"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verdict_ddp")
    store, out = tmp / "store.db", tmp / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_ranks([REPO / "tests" / "verdict_ddp_job.py", store, out], 2, env=env, cwd=tmp, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return store, json.loads(out.read_text())


def _kinds(findings) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in findings:
        f = f if isinstance(f, dict) else f.__dict__
        out.setdefault(f["kind"], []).append(f)
    return out


@pytest.mark.slow
def test_unused_parameter_under_static_graph_raises_nothing_and_no_prediction_says_it_does(job):
    store, res = job
    real = res["unused_static"]
    assert real["steps"] == 5 and real["error"] is None, real  # compiled DDP, static_graph=True: all 5 steps
    rep = validate_backward(store, "unused_static")
    kinds = _kinds(rep.findings)
    assert "DDP_UNUSED_ERROR" not in kinds, rep.to_text()
    [f] = kinds["DDP_UNUSED_STATIC"]
    assert f["severity"] == "warning" and "no step raises" in f["message"] and f["params"] == ["aux.bias", "aux.weight"]
    assert "DDP_UNUSED_ERROR" not in _kinds(real["eager"]), real["eager"]  # eager mode on the same wrapper
    assert "DDP_UNUSED_STATIC" in _kinds(real["eager"])


@pytest.mark.slow
def test_a_raise_the_run_went_past_is_no_fail(job, tmp_path):
    """The same run, its watch records stripped of ``static_graph`` (as a capture that does not record
    it): the evidence predicts "step 1 raises", but the run holds backward passes through step 4 on
    both ranks — the finding says so first and is a warning, never an error."""
    store, _ = job
    copy = _without(store, tmp_path / "no_static.db", "static_graph")
    rep = validate_backward(copy, "unused_static")
    [f] = _kinds(rep.findings)["DDP_UNUSED_ERROR"]
    assert f["severity"] == "warning" and f["raises_at"] == 1, rep.to_text()
    assert f["message"].startswith("not what this run did — the run went past step 1: rank(s) [0, 1] recorded "
                                   "backward passes through step 4"), f["message"]
    assert not rep.errors or all(e.kind != "DDP_UNUSED_ERROR" for e in rep.errors)
    # Records that say neither flag: what happens under each, asserting neither (a warning).
    rep = validate_backward(_without(store, tmp_path / "no_flags.db", "static_graph", "find_unused_parameters"),
                            "unused_static")
    kinds = _kinds(rep.findings)
    assert "DDP_UNUSED_ERROR" not in kinds and [f["severity"] for f in kinds["DDP_UNUSED_DEPENDS"]] == ["warning"]


def _without(store: Path, copy: Path, *keys: str) -> Path:
    """A copy of ``store`` whose watch and comm-group records lack ``keys`` (a capture that did not record them)."""
    with sqlite3.connect(store) as src, sqlite3.connect(copy) as db:
        src.backup(db)
        for name in ("graphdeck_watch", "graphdeck_comm_groups"):
            for rid, payload in db.execute("SELECT id, payload FROM compile_events WHERE name = ?", (name,)).fetchall():
                data = json.loads(payload)
                ddp = data.get("ddp")
                for d in [data, *(ddp if isinstance(ddp, list) else [])]:
                    for k in keys:
                        d.pop(k, None)
                db.execute("UPDATE compile_events SET payload = ? WHERE id = ?", (json.dumps(data), rid))
    return copy


@pytest.mark.slow
def test_reentrant_reuse_without_find_unused_runs_and_diverges_silently(job):
    store, res = job
    real = res["lora_silent"]
    assert real["steps"] == 3 and real["error"] is None, real
    assert all(real["max_diff"][p] > 0.01 for p in LORA) and real["max_diff"]["head.weight"] == 0.0, real
    [f] = _kinds(validate_backward(store, "lora_silent").findings)["READY_TWICE"]
    assert f["severity"] == "error" and f["raises_at"] is None
    assert f["message"].startswith(f"the replicas' gradients of {', '.join(LORA)} silently diverge (no error)"), f
    assert TWICE_ERROR not in f["message"]
    # the fingerprints measure that divergence: its size joins this finding, not a second one (issue 35)
    assert "is accumulated twice. Measured: block.lora_" in f["message"] and "from step 0 (norm" in f["message"], f
    assert "REPLICA_DIVERGENCE" not in _kinds(validate_backward(store, "lora_silent").findings)
    [e] = _kinds(real["eager"])["READY_TWICE"]  # eager mode reads the same from the order of accumulations
    head = e["message"].split(" — ")[0]
    assert "find_unused_parameters=False" in head and "no error" in head and "silently diverge" in head, e
    assert TWICE_ERROR not in head


@pytest.mark.slow
def test_reentrant_reuse_before_ddp_finishes_raises_and_both_modes_say_so(job):
    store, res = job
    real = res["lora_raises"]
    assert real["steps"] == 0 and real["error"].startswith(TWICE_ERROR), real
    [f] = _kinds(validate_backward(store, "lora_raises").findings)["READY_TWICE"]
    assert f["severity"] == "error" and f["message"].startswith(f"the backward at step 0 raises '{TWICE_ERROR}"), f
    [e] = _kinds(real["eager"])["READY_TWICE"]
    assert e["message"].startswith("under this DDP wrapper (find_unused_parameters=False, static_graph=False): "
                                   f"the first backward raises '{TWICE_ERROR}'"), e


@pytest.mark.slow
def test_a_parameter_used_twice_in_one_forward_is_no_finding(job):
    store, res = job
    real = res["twice"]
    assert real["steps"] == 3 and real["error"] is None and not any(real["max_diff"].values()), real
    assert not real["eager"], real["eager"]
    rep = validate_backward(store, "twice")
    assert rep.verdict == "PASS" and not rep.findings, rep.to_text()


@pytest.mark.slow
def test_every_surface_gives_the_ddp_runs_the_same_verdicts(job):
    from tests.verdict_surfaces import disagreements

    store, res = job
    assert not disagreements(store, sorted(res))
