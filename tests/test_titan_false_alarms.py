"""The false alarms torchtitan's healthy runs raised (issue 34), each on a small hand-built job or
store of the same kind — not torchtitan (tests/test_torchtitan.py runs the real thing):

* a per-rank constant that differs by design (a vocab-parallel loss's vocab offset) read as a
  divergence, printed as two identical lines (NOTE: [Per-rank constants]);
* a one-dimensional "world" mesh the data/tensor-parallel meshes are cut from, read as a sharding
  dimension (NOTE: [Dimensions nothing is placed on]), and the capture giving a flattened mesh its
  root's key;
* steps counted twice by an optimizer that steps another (NOTE: [Nested optimizer steps]);
* a buffer a graph reads listed as a FROZEN parameter (NOTE: [Buffers read by graphs]).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.parallel.layout import EVENT_NAME, build_layout, load_layout
from graphdeck.analysis.ranks.core import rank_report
from graphdeck.capture.writer import StoreWriter
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Run
from tests.conftest import run_python

# Each "rank" compiles in a fresh Dynamo state, captured as RANK=r (as tests/test_mesh_checks.py).
#  run "vocab": a vocab-parallel loss over a [8, 8] output weight sharded on dim 0 over 2 ranks:
#    each rank holds 4 rows and compares the labels with its vocab offset rank * 4, a Python int
#    Dynamo bakes into the graph (0 / 4 and 4 / 8).
#  run "steps": 4 training steps through an optimizer whose step steps an inner one (torchtitan's
#    OptimizersContainer is such an Optimizer).
#  run "buffer": a model with a RoPE-like buffer, compiled through the agent's backend unwatched.
CAPTURE = r"""
import os, sys, torch
from graphdeck.capture import Agent
store = sys.argv[1]

class VocabShard(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.output = torch.nn.Linear(8, 4, bias=False)  # rows rank*4 .. rank*4+3 of the [8, 8] weight
        self.start = rank * 4
    def forward(self, x, labels):
        logits = self.output(x)
        inside = (labels >= self.start) & (labels < self.start + 4)
        local = torch.where(inside, labels - self.start, 0)
        return (logits.gather(1, local[:, None]).squeeze(1) * inside).sum()

for rank in (0, 1):
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
    torch._dynamo.reset()
    agent = Agent(store=store, run="vocab")
    model = agent.watch(VocabShard(rank))
    out = torch.compile(model, backend=agent.backend("aot_eager"))(torch.randn(6, 8), torch.arange(6))
    out.backward()
    agent.close()

class Seeded(torch.nn.Module):  # the rank's own coordinate baked in (a per-rank seed offset)
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.rank = rank
    def forward(self, x):
        return (self.lin(x) + self.rank).sum()

for rank in (0, 1):
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
    torch._dynamo.reset()
    agent = Agent(store=store, run="coord")
    model = agent.watch(Seeded(rank))
    torch.compile(model, backend=agent.backend("aot_eager"))(torch.randn(6, 8)).backward()
    agent.close()

os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"

class Container(torch.optim.Optimizer):
    def __init__(self, params):
        params = list(params)
        self.inner = torch.optim.SGD(params, lr=0.1)
        super().__init__(params, {})
    def step(self, closure=None):
        self.inner.step()
    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)

torch._dynamo.reset()
agent = Agent(store=store, run="steps")
model = agent.watch(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = Container(model.parameters())
step = torch.compile(model, backend=agent.backend("aot_eager"))
for _ in range(4):
    step(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
agent.close()

class Rope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("freqs_cis", torch.randn(8), persistent=False)
    def forward(self, x):
        return (self.lin(x) * self.freqs_cis).sum()

torch._dynamo.reset()
agent = Agent(store=store, run="buffer")
rope = Rope()
f = torch.compile(rope, backend=agent.backend("aot_eager"))
for _ in range(2):
    f(torch.randn(2, 8)).backward()
agent.close()
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("titan_kinds") / "kinds.db"
    run_python(CAPTURE, str(path), env={"OMP_NUM_THREADS": "1"})
    return path


def _with_layout(src: Path, dst: Path, run: str, records: dict[int, dict]) -> Path:
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    engine = open_engine(dst)
    with Session(engine) as s:
        run_id = s.scalars(select(Run.id).where(Run.name == run)).one()
        for rank, payload in records.items():
            s.add(CompileEvent(run_id=run_id, rank=rank, name=EVENT_NAME, compile_id=None, metadata_json="{}",
                               payload=json.dumps(payload)))
        s.commit()
    engine.dispose()
    return dst


def _report(path: Path, run: str):
    with Session(open_engine(path, read_only=True)) as s:
        return rank_report(s, s.scalars(select(Run).where(Run.name == run)).one())


def _mesh(key: str, dims: list[str], ranks, coord, flattened_from: str | None = None) -> dict:
    import numpy as np

    arr = np.asarray(ranks)
    out = {"key": key, "device_type": "cpu", "shape": list(arr.shape), "dim_names": dims, "ranks": arr.tolist(),
           "coord": coord, "dim_groups": []}
    if flattened_from:
        out["flattened_from"] = flattened_from
    return out


def _titan_tp_records(global_rows: int = 8) -> dict[int, dict]:
    """torchtitan's TP=2 layout: its "world" root mesh, and the ("fsdp", "tp") mesh cut from it,
    the output weight Shard(0) on "tp" (vocab-parallel)."""
    return {r: {"version": 1, "rank": r, "world_size": 2,
                "meshes": [_mesh("mesh0", ["world"], [0, 1], [r]),
                           _mesh("mesh1", ["fsdp", "tp"], [[0, 1]], [0, r], "mesh0")],
                "params": [{"fqn": "output.weight", "mesh": "mesh1", "mesh_dims": ["fsdp", "tp"],
                            "placements": ["Replicate()", "Shard(0)"], "local_shape": [global_rows // 2, 8],
                            "global_shape": [global_rows, 8], "dtype": "float32"}],
                "fsdp_groups": [], "tp": [], "pipeline": None, "regions": []} for r in (0, 1)}


def _titan_fsdp_records() -> dict[int, dict]:
    """torchtitan's FSDP2 layout: "world", and "fsdp" flattened from it, the groups sharding on it."""
    return {r: {"version": 1, "rank": r, "world_size": 2,
                "meshes": [_mesh("mesh0", ["world"], [0, 1], [r]), _mesh("mesh1", ["fsdp"], [0, 1], [r], "mesh0")],
                "params": [{"fqn": "w", "mesh": "mesh1", "mesh_dims": ["fsdp"], "placements": ["Shard(0)"],
                            "local_shape": [4, 8], "global_shape": [8, 8], "dtype": "float32"}],
                "fsdp_groups": [{"module": "", "params": ["w"], "mesh": "mesh1", "mesh_dims": ["fsdp"],
                                 "reshard_after_forward": True}],
                "tp": [], "pipeline": None, "regions": []} for r in (0, 1)}


# ------------------------------------------------------------------ per-rank constants

def test_vocab_offset_is_a_note_naming_the_placement(store, tmp_path):
    """Before: FAIL "first differing node: ge ..." with identical reference/diverging lines."""
    bare = _report(store, "vocab")  # no layout: nothing explains it, a divergence that shows the constants
    assert bare.verdict == "FAIL"
    (d,) = bare.divergences
    assert "only a constant differs" in d.message and "0 vs 4" in d.message, d.message
    text = bare.to_text()
    ref_line = next(x for x in text.splitlines() if x.strip().startswith("reference:"))
    div_line = next(x for x in text.splitlines() if x.strip().startswith("diverging:"))
    assert ref_line.split(":", 1)[1] != div_line.split(":", 1)[1], text  # the constant shows on each line

    rep = _report(_with_layout(store, tmp_path / "tp.db", "vocab", _titan_tp_records()), "vocab")
    assert rep.verdict == "OK", rep.to_text()
    assert rep.groups == [[0, 1]] and not rep.divergences
    (note,) = [n for n in rep.notes if "per-rank constants" in n]
    assert "output.weight is Shard(0) of [8, 8] over tp" in note and "(tp 1 - tp 0) × 4" in note, note
    assert "0 vs 4" in note and "4 vs 8" in note and "a note, not a divergence" in note

    # The same constants where the placements give another shard size (rows 6: 3 a rank) are not
    # explained, nor between replicas (the weight sharded on a data-parallel dim): still FAIL.
    rep = _report(_with_layout(store, tmp_path / "other.db", "vocab", _titan_tp_records(6)), "vocab")
    assert rep.verdict == "FAIL" and "only a constant differs" in rep.divergences[0].message
    dp = _titan_tp_records()
    for rec in dp.values():
        rec["meshes"][1]["dim_names"] = ["fsdp", "dp"]
        rec["params"][0]["mesh_dims"] = ["fsdp", "dp"]
    rep = _report(_with_layout(store, tmp_path / "dp.db", "vocab", dp), "vocab")
    assert rep.verdict == "FAIL"

    # The coordinate itself baked in (lin(x) + tp_rank): explained by the tp coordinate; between
    # replicas it stays a divergence.
    assert _report(store, "coord").verdict == "FAIL"
    rep = _report(_with_layout(store, tmp_path / "coord.db", "coord", _titan_tp_records()), "coord")
    assert rep.verdict == "OK", rep.to_text()
    (note,) = [n for n in rep.notes if "per-rank constants" in n]
    assert "the tp coordinate itself (0 vs 1)" in note, note
    assert _report(_with_layout(store, tmp_path / "coord_dp.db", "coord", dp), "coord").verdict == "FAIL"


# ------------------------------------------------------------------ the world mesh

def test_world_mesh_is_no_sharding_dimension(tmp_path):
    """Before: "world" was a sharding dim — FSDP2 ranks TP peers (replicas [0] | [1]) and a 2×2
    map with the ranks on its diagonal."""
    from graphdeck.server.routes.parallel_map import parallel_map

    fsdp = build_layout(_titan_fsdp_records())
    assert fsdp.container_dims() == {"world"} and fsdp.sharding_dims() == []
    assert fsdp.replica_peers() == [[0, 1]] and fsdp.to_dict()["container_dims"] == ["world"]
    tp = build_layout(_titan_tp_records())
    assert tp.sharding_dims() == ["tp"] and tp.replica_peers() == [[0], [1]]
    # A dim nothing is placed on stays a sharding one when named like one, or when no record places
    # anything anywhere (no evidence either way: as before).
    named = _titan_tp_records()
    for rec in named.values():
        rec["meshes"][0]["dim_names"] = ["cp"]
    assert build_layout(named).sharding_dims() == ["cp", "tp"]
    bare = _titan_fsdp_records()
    for rec in bare.values():
        rec["params"], rec["fsdp_groups"] = [], []
    assert "world" in build_layout(bare).sharding_dims()

    maps = {}
    for name, recs in (("fsdp", _titan_fsdp_records()), ("tp", _titan_tp_records())):
        path = str(tmp_path / f"{name}.db")
        for rank, rec in recs.items():
            w = StoreWriter(path, name, rank, 2)
            w.write_compile_events([{"name": EVENT_NAME, "compile_id": None, "metadata": {},
                                     "payload": json.dumps(rec)}])
            w.engine.dispose()
        engine = open_engine(path, read_only=True)
        with Session(engine) as s:
            run = s.scalars(select(Run).where(Run.name == name)).one()
            assert load_layout(s, run.id) is not None
            maps[name] = parallel_map(s, run, checks=["layout"])
        engine.dispose()
    m = maps["fsdp"]  # one dimension: the FSDP2 shards, one cell each, no holes
    assert m["dims"] == {"stage": None, "rows": ["fsdp"], "cols": []}
    (stage,) = m["stages"]
    assert [[c["ranks"] for c in row["cells"]] for row in stage["rows"]] == [[[0]], [[1]]]
    m = maps["tp"]  # a 1×2 grid: one row, the two tensor-parallel ranks side by side
    assert m["dims"]["cols"] == ["tp"] and "world" not in m["dims"]["rows"]
    (stage,) = m["stages"]
    assert stage["cols"] == ["tp 0", "tp 1"]
    assert [[c["ranks"] for c in row["cells"]] for row in stage["rows"]] == [[[0], [1]]]


def test_flattened_mesh_seen_first_gets_its_own_key():
    """torchtitan hands FSDP2 a mesh flattened from its "world" mesh: the capture recorded both
    as "mesh0" (the root's key taken after the flattened mesh's)."""
    code = r"""
import json, os
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from graphdeck.capture.layout import _Meshes
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
m = _Meshes()
keys = [m.key_of(world._flatten("fsdp")), m.key_of(world._unflatten(0, (1, 1), ("fsdp", "tp")))]
print(json.dumps([keys, [(e["key"], e["dim_names"], e.get("flattened_from")) for e in m.records()]]))
dist.destroy_process_group()
"""
    from tests.conftest import free_port

    out = run_python(code, env={"PORT": str(free_port())}).stdout.strip().splitlines()[-1]
    keys, entries = json.loads(out)
    assert keys == ["mesh1", "mesh2"]
    assert entries == [["mesh0", ["world"], None], ["mesh1", ["fsdp"], "mesh0"], ["mesh2", ["fsdp", "tp"], "mesh0"]]


# ------------------------------------------------------------------ steps and parameters

def _grads(path: Path, run: str) -> dict:
    from graphdeck.analysis.gradients import gradient_report

    with Session(open_engine(path, read_only=True)) as s:
        return gradient_report(s, s.scalars(select(Run).where(Run.name == run)).one()).to_dict()


def test_steps_are_counted_as_the_trainer_counts_them(store):
    """Before: "steps 0–6 (8 backward)" for 4 steps (the container's step and its member's each
    counted)."""
    rep = _grads(store, "steps")
    (steps,) = rep["coverage"]["steps"].values()
    assert (steps["first"], steps["last"], steps["backward_passes"]) == (0, 3, 4), steps
    assert rep["verdict"] == "PASS"


def test_buffer_read_by_a_graph_is_no_parameter(store):
    """Before: freqs_cis listed as a FROZEN parameter (3 "parameters" for a model of 2)."""
    rep = _grads(store, "buffer")
    assert sorted((p["fqn"], p["status"]) for p in rep["params"]) == [("lin.bias", "OK"), ("lin.weight", "OK")]
