"""The executor's pipeline on real processes: K=2 gloo workers give the same outputs as one worker
(AOT forward and backward graphs of the captured 1-layer GPT-2), and ``graphdeck replay``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from sqlalchemy.orm import Session

from graphdeck.errors import UsageError
from graphdeck.replay.pipeline import replay, run_pipeline
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Trace
from tests.test_executor import copy_store, graph_ids


@pytest.fixture(scope="module")
def store(captured_store, tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "tiny.db"
    copy_store(captured_store, path)
    return path


@pytest.mark.parametrize("kind, strategy", [("aot_forward", "layerwise"), ("aot_backward", "memory_aware")])
def test_two_gloo_workers_equal_one_worker(store, kind, strategy):
    engine = open_engine(store)
    gid = graph_ids(store)[kind]
    one = run_pipeline(engine, gid, workers=1, strategy=strategy, microbatches=2, ingest=False)
    two = run_pipeline(engine, gid, workers=2, strategy=strategy, microbatches=2)
    assert len(one.outputs) == len(two.outputs) == 2, "one output tuple per microbatch"
    for a, b in zip(one.outputs, two.outputs):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y), "split over 2 workers == single-worker run"
    first = next(i for i, x in enumerate(one.outputs[0]) if x is not None)
    assert not torch.equal(one.outputs[0][first], one.outputs[1][first]), "microbatches have their own inputs"
    assert len(two.busy_ns) == 2 and all(b > 0 for b in two.busy_ns)
    assert 0.0 <= two.bubble_fraction < 1.0 and two.makespan_ns >= max(two.busy_ns)
    assert len(two.plan.stages[0].send) > 0, "stage 0 sends boundary activations"
    with Session(engine) as s:
        names = [s.get(Trace, t).name for t in two.trace_ids]
    assert names == [f"executor graph {gid} worker 0/2", f"executor graph {gid} worker 1/2"]


def test_cli_replay(store):
    gid = graph_ids(store)["aot_backward"]
    cmd = [sys.executable, "-m", "graphdeck.cli", "replay", "tiny", str(gid), "--store", str(store)]
    proc = subprocess.run(cmd + ["--workers", "2", "--strategy", "auto", "--microbatches", "2", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["pipeline"]["backend"] == "gloo" and len(out["plan"]["stages"]) == 2
    assert out["plan"]["time_balance"] is not None, "auto balances measured node times"
    text = subprocess.run(cmd + ["--workers", "2", "--strategy", "layerwise", "--microbatches", "2"],
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr[-3000:]
    # Issue 24.14: "recorded trace None" and a bare "balance 1.2184" said nothing to a reader.
    assert "recorded trace None" not in text.stdout
    assert "= the largest stage's compute nodes / the mean stage's (1.00 is even)" in text.stdout, text.stdout
    with pytest.raises(UsageError, match=r"node 'view_2' \(aten.view.default\) fixes the batch size .* captured "
                                         "batch size 2 as a literal"):
        replay(open_engine(store), graph_ids(store)["aot_forward"], microbatch_size=5)
