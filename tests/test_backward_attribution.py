"""Issue 40 item 2: backward time of a profiler trace put on the forward modules it belongs to,
for eager and compiled training steps alike (NOTE: [Backward by forward module]).

Kineto's forward→backward flows (``cat: fwdbwd``) are kept at ingest (NOTE: [Forward-backward
flows]); each ``autograd::engine::evaluate_function`` range goes to the ``nn.Module`` range around
the forward op its flow starts at. Inputs: a real CPU job (torch.profiler with_stack=True over an
eager and a torch.compile(aot_eager) training step, one process) and the shared corpus's MI300
ResNet trace with activation checkpointing (``tracelens/mi300/resnet_act_checkpoint.json.gz``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from sqlalchemy.orm import Session

import graphdeck
from graphdeck.analysis.traces.backward import backward_by_module
from graphdeck.store.db import open_engine
from tests.conftest import LiveServer, shared_path
from tests.launch import run_python_job

JOB = r"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = torch.nn.Linear(64, 128); s.blk = torch.nn.Linear(128, 128); s.head = torch.nn.Linear(128, 8)
    def forward(s, x):
        return s.head(torch.relu(s.blk(torch.relu(s.emb(x)))))
for mode in ("eager", "compiled"):
    m = Net()
    f = torch.compile(m, backend="aot_eager") if mode == "compiled" else m
    x = torch.randn(16, 64)
    f(x).square().mean().backward()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        for _ in range(2):
            f(x).square().mean().backward()
    p.export_chrome_trace(f"{sys.argv[1]}/{mode}.json")
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One real CPU process profiling an eager and a compiled step; both traces ingested by the CLI."""
    out = tmp_path_factory.mktemp("bwd")
    proc = run_python_job(["-c", JOB, out], env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    store = out / "s.db"
    for mode in ("eager", "compiled"):
        ing = _cli("ingest-trace", str(out / f"{mode}.json"), "--store", str(store), "--run", mode)
        assert ing.returncode == 0 and "fwdbwd flows" in ing.stdout, ing.stdout + ing.stderr
    engine = open_engine(store)
    with Session(engine) as s:
        return store, {mode: backward_by_module(s, tid) for mode, tid in (("eager", 1), ("compiled", 2))}


@pytest.mark.slow
def test_eager_backward_time_per_forward_module(job, browser):
    store, got = job
    eager = got["eager"]
    assert eager.by == "module" and eager.note is None and eager.flows > 0
    rows = {r.module: r for r in eager.rows}
    for lin in ("Net_0/Linear_0", "Net_0/Linear_1", "Net_0/Linear_2"):
        assert rows[lin].ops.keys() >= {"AddmmBackward0"} and rows[lin].backward_ns > 0, (lin, rows.get(lin))
        assert rows[lin].backward_ops == 4, "AddmmBackward0 + TBackward0, 2 steps"
    assert rows["Net_0"].ops.keys() == {"ReluBackward0"}, "the relus run in Net.forward itself"
    assert set(eager.unattributed) == {"torch::autograd::AccumulateGrad"}, eager.unattributed
    assert eager.attributed_ns + sum(eager.unattributed.values()) == eager.backward_ns
    assert eager.gpu_ns == 0, "a CPU-only trace"

    compiled = got["compiled"]
    crow = {r.module: r for r in compiled.rows}["OptimizedModule_0/Net_0"]
    assert crow.ops.keys() == {"CompiledFunctionBackward"} and crow.forward_ops == {"CompiledFunction": 2}

    # the same numbers on the API, the notebook and the page's endpoint
    with LiveServer(store) as srv:
        api = httpx.get(f"{srv.url}/api/traces/1/backward", timeout=60).json()
        page = browser.new_page()
        page.goto(f"{srv.url}/#/traces/1")
        shown = page.wait_for_selector('#backward-table tbody tr', timeout=30000)
        table = page.inner_text("#backward-table")
        summary = page.inner_text("#backward-summary")
    assert api == json.loads(json.dumps(eager.to_dict())), "API = analysis"
    assert shown is not None and "Net_0/Linear_2" in table and "AddmmBackward0" in table, table
    assert "forward module" in summary and "flows" in summary, summary
    frame = graphdeck.open(str(store)).run("eager").trace(0).backward_frame()
    assert list(frame["module"]) == [r.module for r in eager.rows]
    assert list(frame["backward_ns"]) == [r.backward_ns for r in eager.rows]
    assert frame.attrs["attributed_ns"] == eager.attributed_ns


def test_corpus_trace_with_activation_checkpointing(tmp_path):
    """A real DDP ResNet step on MI300 (8 ranks, rank 0) with checkpointed blocks: its 213
    forward→backward flows put the backward ranges on the ResNet's modules."""
    path = shared_path("data", "traces", "tracelens", "mi300", "resnet_act_checkpoint.json.gz")
    ing = _cli("ingest-trace", str(path), "--store", str(tmp_path / "s.db"), "--run", "rs", "--json")
    assert ing.returncode == 0, ing.stderr
    assert "fwdbwd flows 426" in ing.stdout and "s 2,604" in ing.stdout, ing.stdout[:400]
    with Session(open_engine(tmp_path / "s.db")) as s:
        got = backward_by_module(s, 1)
    assert got.flows == 213 and got.by == "module"
    assert set(got.unattributed) == {"torch::autograd::AccumulateGrad"}
    mods = {r.module: r for r in got.rows}
    fc = mods["DistributedDataParallel_0/ResNet_0/Linear_0"]
    assert fc.ops.keys() == {"AddmmBackward0", "TBackward0"}
    convs = [m for m, r in mods.items() if "/CheckpointWrapper_" in m and m.rsplit("/", 1)[-1].startswith("Conv2d_")]
    assert len(convs) >= 8 and all(mods[m].ops.keys() == {"ConvolutionBackward0"} for m in convs), convs
    # GPU kernels launched from each backward range (by correlation): the convolutions' backward
    # kernels on their modules; DDP's all-reduces, launched from AccumulateGrad hooks, not linked
    assert all(mods[m].gpu_ns > 0 for m in convs) and got.attributed_gpu_ns == sum(r.gpu_ns for r in got.rows)
    assert got.gpu_ns == got.attributed_gpu_ns + sum(got.unattributed_gpu.values())
    assert set(got.unattributed_gpu) <= {"torch::autograd::AccumulateGrad"}
