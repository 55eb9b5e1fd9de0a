"""``graphdeck replay RUN GRAPH --config executor.json`` (issue 20, item 5) on a captured MLP:
each partition strategy with a microbatch size other than the captured batch, flags over the
file, a static shape that fixes the batch named, config errors naming the key, the CPU/GPU
segments of ``enable_heterogeneous_fusion``, nccl without CUDA, and a GPU-captured graph
(tests/data/fsdp2_h200) refused on the CPU naming its CUDA-only op."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3

import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.cli import main
from graphdeck.errors import UsageError
from graphdeck.replay.config import merge, parse_config
from graphdeck.replay.executor import execute_graph, load_stored_graph, rebuild
from graphdeck.replay.rebatch import rebatch
from graphdeck.replay.synth import synth_inputs
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph
from tests.conftest import REPO, run_python

CAPTURE = r"""
import sys, torch
from graphdeck.capture import Agent
torch.manual_seed(0)
agent = Agent(store=sys.argv[1], run="mlp")
mlp = agent.watch(torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24),
                                      torch.nn.GELU(), torch.nn.Linear(24, 5)))
class Flat(torch.nn.Module):  # x.view(x.size(0), -1): Dynamo bakes the batch size 6 into the view
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 5)
    def forward(self, x):
        return self.proj(x.view(x.size(0), -1))
flat = agent.watch(Flat())
c_mlp = torch.compile(mlp, backend=agent.backend("aot_eager"))
c_flat = torch.compile(flat, backend=agent.backend("aot_eager"))
for step in range(2):
    x = torch.randn(6, 12)
    c_mlp(x).pow(2).mean().backward()
    c_flat(x.view(6, 3, 4)).sum().backward()
agent.close()
"""
CAPTURED_BATCH = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLP capture (aot_eager, batch 6) for the module; the tests write executor traces into it."""
    path = tmp_path_factory.mktemp("executor_config") / "mlp.db"
    run_python(CAPTURE, str(path))
    return path


def gid(store, kind: str, which: int = 0) -> int:
    """Graph id of ``kind`` of the MLP (``which=0``) or of Flat (``which=1``)."""
    engine = open_engine(store, read_only=True)
    try:
        with Session(engine) as s:
            return s.execute(select(Graph.id).where(Graph.kind == kind,
                                                    Graph.name.like(f"graph {which}/0%"))).scalar_one()
    finally:
        engine.dispose()


def replay_cli(store, graph_id, config: dict | str | None, *flags, tmp_path=None):
    args = ["replay", "mlp", str(graph_id), "--store", str(store), "--iters", "1", *flags]
    if config is not None:
        cfg = tmp_path / "executor.json"
        cfg.write_text(config if isinstance(config, str) else json.dumps(config))
        args += ["--config", str(cfg)]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def summary(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{"):])


@pytest.mark.slow
def test_each_strategy_with_another_microbatch_size(store, tmp_path):
    """2 gloo workers per strategy, microbatches of 4 rows on an MLP captured at 6; the pipeline's
    boundaries carry the rebatched shapes."""
    graph = gid(store, "aot_forward")
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        stored = load_stored_graph(s, graph)
    engine.dispose()
    # What each node is at 4 rows: activations carry the new batch; a weight's transpose (``t``, [12, 24])
    # does not, and a measured-time cut (auto) may send one across.
    expected = {n.name: n.shape for n in rebatch(stored, 4).nodes}
    assert any(shape and shape[0] == 4 for shape in expected.values())
    for strategy in ("auto", "layerwise", "memory_aware"):
        cfg = {"executor": {"num_workers": 2, "graph_partition_strategy": strategy, "pipeline_microbatch_size": 4,
                            "communication_backend": "gloo", "enable_heterogeneous_fusion": False}}
        out = summary(replay_cli(store, graph, cfg, "--microbatches", "2", "--json", tmp_path=tmp_path))
        assert out["batch"] == {"captured": CAPTURED_BATCH, "replayed": 4}
        assert out["plan"]["strategy"] == strategy and len(out["plan"]["stages"]) == 2
        assert out["pipeline"]["backend"] == "gloo" and out["pipeline"]["workers"] == 2
        assert len(out["pipeline"]["trace_ids"]) == 2 and all(b > 0 for b in out["pipeline"]["busy_ns"])
        sent = out["plan"]["boundaries"]
        assert sent and all(b["shape"] == list(expected[b["name"]]) for b in sent), \
            f"{strategy}: boundaries at the rebatched shapes: {sent}"
        if strategy == "auto":
            assert out["plan"]["time_balance"] is not None, "auto balanced measured node times"
        segs = out["heterogeneous_fusion"]["segments"]
        assert [(g["device_type"], g["stages"]) for g in segs] == [("cpu", [0, 1])], \
            "false on a graph recorded on one device: one segment, cut by the strategy alone"


def test_rebatched_graphs_run_and_match_a_direct_call(store):
    fw, bw_id = gid(store, "aot_forward"), gid(store, "aot_backward")
    engine = open_engine(store)
    res = execute_graph(engine, fw, iters=1, seed=3, microbatch_size=4)
    with Session(engine) as s:
        stored = load_stored_graph(s, fw)
        bw = load_stored_graph(s, bw_id)
    small = rebatch(stored, 4)
    direct = rebuild(small, seed=3).gm(*synth_inputs(small, seed=3))
    assert res.outputs[0].shape == (4, 5) and torch.equal(res.outputs[0], direct[0])
    assert res.ratio == {} and res.recorded_trace_id is None, "no ratio against a trace of another batch size"
    grads = rebuild(rebatch(bw, 3)).gm(*synth_inputs(rebatch(bw, 3)))
    assert [tuple(g.shape) for g in grads if g is not None] == [(24, 12), (24,), (24, 24), (24,), (5, 24), (5,)], \
        "the backward graph takes 3 rows too; parameter gradients keep their shapes"
    assert rebatch(stored, CAPTURED_BATCH) is stored


def test_flags_override_the_file(store, tmp_path):
    cfg = {"executor": {"num_workers": 2, "graph_partition_strategy": "memory_aware", "pipeline_microbatch_size": 4}}
    out = summary(replay_cli(store, gid(store, "dynamo"), cfg, "--workers", "1", "--json", tmp_path=tmp_path))
    assert out["workers"] == 1 and "pipeline" not in out, "--workers on the command line beats num_workers"
    assert out["batch"]["replayed"] == 4, "the file still sets what no flag gave"
    assert merge({"workers": 2, "backend": "gloo"}, {"workers": 1, "backend": None, "strategy": "layerwise"},
                 {"workers"}) == {"workers": 1, "backend": "gloo", "strategy": "layerwise"}


@pytest.mark.parametrize("kind", ["dynamo", "aot_forward"])
def test_a_static_batch_is_named(store, tmp_path, kind):
    r = replay_cli(store, gid(store, kind, which=1), {"executor": {"pipeline_microbatch_size": 4}}, tmp_path=tmp_path)
    assert r.exit_code == 2, r.output
    assert "node 'view'" in r.output and "fixes the batch size" in r.output and "captured batch size 6" in r.output


@pytest.mark.parametrize("config, message", [
    ({"executor": {"num_workers": 2, "typo_key": 1}}, "unknown key 'executor.typo_key'"),
    ({"executor": {}, "extra": 1}, "unknown key 'extra'"),
    ({"executors": {"num_workers": 2}}, 'missing the "executor" object'),
    ({"executor": {"num_workers": "8"}}, "executor.num_workers: Input should be a valid integer (got '8')"),
    ({"executor": {"num_workers": 0}}, "executor.num_workers: Input should be greater than or equal to 1"),
    ({"executor": {"graph_partition_strategy": "random"}}, "executor.graph_partition_strategy: Input should be 'auto'"),
    ({"executor": {"communication_backend": "mpi"}}, "executor.communication_backend"),
    ({"executor": {"enable_heterogeneous_fusion": 1}}, "executor.enable_heterogeneous_fusion: Input should be a valid boolean"),
    ("{not json", "not JSON"),
])
def test_bad_config_exits_2_naming_the_problem(store, tmp_path, config, message):
    r = replay_cli(store, 1, config, tmp_path=tmp_path)
    assert r.exit_code == 2 and message in r.output, r.output


def test_parse_config_keeps_only_given_keys():
    assert parse_config('{"executor": {"num_workers": 8, "graph_partition_strategy": "auto", '
                        '"pipeline_microbatch_size": 4, "communication_backend": "gloo", '
                        '"enable_heterogeneous_fusion": true}}') == {
        "workers": 8, "strategy": "auto", "microbatch_size": 4, "backend": "gloo", "heterogeneous_fusion": True}
    assert parse_config('{"executor": {}}') == {}
    with pytest.raises(UsageError, match="unknown key 'executor.nproc'"):
        parse_config('{"executor": {"nproc": 2}}')


def test_heterogeneous_fusion(store, tmp_path):
    """True on a graph recorded on one device type is refused with the reason; on a graph with
    CPU- and GPU-placed segments (the MLP's middle layer re-labelled cuda:0, as a mixed capture
    records it) the segments run fused on the replay device and are listed; false refuses it."""
    graph = gid(store, "aot_forward")
    r = replay_cli(store, graph, {"executor": {"enable_heterogeneous_fusion": True}}, tmp_path=tmp_path)
    assert r.exit_code == 2 and "no CPU- and GPU-placed segments to fuse" in r.output, r.output
    mixed = tmp_path / "mixed.db"
    with sqlite3.connect(store) as a, sqlite3.connect(mixed) as b:
        a.backup(b)
    with open_engine(mixed).begin() as conn:
        conn.execute(text("UPDATE nodes SET device = 'cuda:0' WHERE graph_id = :g AND name IN ('t_1', 'addmm_1', "
                          "'gelu')"), {"g": graph})
    out = summary(replay_cli(mixed, graph, {"executor": {"enable_heterogeneous_fusion": True}}, "--json",
                             tmp_path=tmp_path))
    segs = [(s["device_type"], s["first"], s["last"], s["stages"]) for s in out["heterogeneous_fusion"]["segments"]]
    assert segs == [("cpu", "t", "relu", [0]), ("cuda", "t_1", "gelu", [0]), ("cpu", "t_2", "addmm_2", [0])]
    assert out["executor"]["node_cpu_ns"], "the fused graph ran on the CPU"
    r = replay_cli(mixed, graph, None, "--no-heterogeneous-fusion", tmp_path=tmp_path)
    assert r.exit_code == 2 and "mixes cpu and cuda-placed segments" in r.output and "'t_1'" in r.output, r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_nccl_without_cuda_is_refused(store, tmp_path):
    for workers in ("1", "2"):
        r = replay_cli(store, gid(store, "aot_forward"), {"executor": {"communication_backend": "nccl"}},
                       "--workers", workers, tmp_path=tmp_path)
        assert r.exit_code == 2 and "nccl needs CUDA devices and this machine has none" in r.output, r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_gpu_captured_graph_on_cpu_names_the_cuda_only_op(tmp_path):
    """tests/data/fsdp2_h200: the GPT-2 block graph captured on an H200 calls the CUDA-only
    memory-efficient SDPA kernel."""
    path = tmp_path / "fsdp2.db"
    with gzip.open(REPO / "tests" / "data" / "fsdp2_h200" / "fsdp2.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    with sqlite3.connect(path) as conn:
        graph = conn.execute("SELECT id FROM graphs WHERE kind = 'aot_forward' AND name LIKE 'graph 9/0%'").fetchone()[0]
    r = CliRunner().invoke(main, ["replay", "fsdp2", str(graph), "--store", str(path), "--config", str(_cfg(tmp_path))],
                           catch_exceptions=False)
    assert r.exit_code == 2, r.output
    assert ("node '_scaled_dot_product_efficient_attention' calls aten._scaled_dot_product_efficient_attention.default"
            in r.output and "no CPU kernel" in r.output and "recorded on cuda:0" in r.output), r.output
    assert "Traceback" not in r.output


def _cfg(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"executor": {"num_workers": 1, "communication_backend": "gloo"}}))
    return path
