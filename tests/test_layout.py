"""The parallel layout (issue 20 item 1): RunLayout on built records, then the real captures —
FSDP2 x TP on a 2 x 2 gloo mesh, a 2-stage pipeline, a job that dies — and the API route."""

from __future__ import annotations

import json

import httpx
import pytest

from graphdeck.analysis.parallel.layout import EVENT_NAME, build_layout, load_layout
from graphdeck.capture.writer import StoreWriter
from graphdeck.store.db import open_engine, session_factory
from tests.conftest import LiveServer
from tests.nd_fixtures import (  # noqa: F401 - fixtures
    RUN_FSDP_TP,
    RUN_PIPELINE,
    fsdp_tp_records,
    layout_record,
    nd_fsdp_tp_store,
    nd_pipeline_store,
    pairs,
    run_nd_job,
)


def _store(tmp_path, records: dict[int, dict], world_size: int, run: str = "r") -> tuple[str, int]:
    """Write each record through the capture's writer, as the capture does; (path, run id)."""
    path = str(tmp_path / "layout.db")
    run_id = None
    for rank, rec in records.items():
        w = StoreWriter(path, run, rank, world_size)
        w.write_compile_events([{"name": EVENT_NAME, "compile_id": None, "metadata": {}, "payload": json.dumps(rec)}])
        run_id = w.run_id
        w.engine.dispose()
    return path, run_id


def _load(path: str, run_id: int):
    engine = open_engine(path, read_only=True)
    try:
        with session_factory(engine)() as s:
            return load_layout(s, run_id)
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------- built records

def test_fsdp_tp_layout_peers_coords_and_shapes(tmp_path):
    recs = fsdp_tp_records()
    del recs[3]  # rank 3 wrote nothing (died before watch)
    path, run_id = _store(tmp_path, recs, world_size=4)
    lay = _load(path, run_id)
    assert lay.world_size == 4 and lay.ranks == [0, 1, 2] and lay.missing_ranks == [3]
    assert [m["dim_names"] for m in lay.meshes] == [["dp", "tp"]] and lay.meshes[0]["ranks"] == [[0, 1], [2, 3]]
    assert lay.coord(3) == {"dp": 1, "tp": 1}  # from the merged mesh: known without its record
    assert lay.coord(1) == {"dp": 0, "tp": 1}
    assert lay.stage_of(0) is None and lay.program_peers() == [[0, 1, 2, 3]]
    assert lay.sharding_dims() == ["tp"] and lay.dp_dims() == {"dp"}
    assert lay.replica_peers() == [[0, 2], [1, 3]]  # same tp coordinate: DP/FSDP replicas
    assert lay.dim_groups("tp") == [[0, 1], [2, 3]] and lay.dim_groups("dp") == [[0, 2], [1, 3]]
    assert lay.dim_groups("cp") == []
    assert lay.placements("mlp.w2.weight", 1) == ["Shard(0)", "Shard(1)"]
    assert lay.placements("mlp.w2.weight", 3) is None and lay.placements("nope", 0) is None
    assert lay.param("mlp.w1.weight", 1)["local_shape"] == [16, 32]
    assert lay.explains_shape("mlp.w1.weight", 0, 1) and lay.explains_shape("mlp.w2.weight", 0, 2)
    assert not lay.explains_shape("mlp.w1.weight", 0, 3)  # no record on 3: nothing explained
    d = lay.to_dict()
    assert d["coords"]["3"] == {"dp": 1, "tp": 1} and d["missing_ranks"] == [3]
    assert d["dim_groups"] == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
    assert set(d["records"]) == {"0", "1", "2"}
    json.dumps(d)


def test_shape_not_explained_by_placements(tmp_path):
    recs = fsdp_tp_records()
    recs[1]["params"][0]["local_shape"] = [15, 32]  # not what Shard(0) x Shard(0) gives rank 1
    lay = build_layout(recs)
    assert not lay.explains_shape("mlp.w1.weight", 0, 1)
    recs = fsdp_tp_records()
    recs[2]["params"][1]["placements"] = ["Replicate()", "Shard(1)"]  # placements disagree
    assert not build_layout(recs).explains_shape("mlp.w2.weight", 0, 2)


def test_uneven_shard_is_explained():
    params = [{"fqn": "w", "global_shape": [5, 3], "placements": ["Shard(0)"]}]
    recs = {r: layout_record(r, mesh_shape=(2,), dim_names=("dp",), params=params) for r in range(2)}
    assert [recs[r]["params"][0]["local_shape"] for r in range(2)] == [[3, 3], [2, 3]]
    lay = build_layout(recs)
    assert lay.explains_shape("w", 0, 1) and lay.expected_local_shape("w", 1) == [2, 3]


#: Rank 0's layout record, as the capture wrote it, of ``fully_shard(model)`` with no mesh (2 gloo
#: ranks, ``nn.Sequential(Linear(8, 16), ReLU, Linear(16, 4))``, compiled aot_eager through the agent):
#: torch's default 1-D mesh has no dimension names, so the capture names its dim ``dim0`` and the
#: FSDP2 group's and parameters' ``mesh_dims`` are ``[]``.
FULLY_SHARD_NO_MESH_RANK0 = """{"fsdp_groups": [{"mesh": "mesh0", "mesh_dims": [], "module": "", "params": ["0.weight",
"0.bias", "2.weight", "2.bias"], "reshard_after_forward": false}], "meshes": [{"coord": [0], "device_type": "cpu",
"dim_groups": [{"desc": "default_pg", "dim": "dim0", "name": "0", "ranks": [0, 1]}], "dim_names": ["dim0"],
"key": "mesh0", "ranks": [0, 1], "shape": [2]}], "params": [{"dtype": "float32", "fqn": "0.weight", "global_shape":
[16, 8], "local_shape": [8, 8], "mesh": "mesh0", "mesh_dims": [], "placements": ["Shard(0)"]}, {"dtype": "float32",
"fqn": "0.bias", "global_shape": [16], "local_shape": [8], "mesh": "mesh0", "mesh_dims": [], "placements":
["Shard(0)"]}, {"dtype": "float32", "fqn": "2.weight", "global_shape": [4, 16], "local_shape": [2, 16], "mesh":
"mesh0", "mesh_dims": [], "placements": ["Shard(0)"]}, {"dtype": "float32", "fqn": "2.bias", "global_shape": [4],
"local_shape": [2], "mesh": "mesh0", "mesh_dims": [], "placements": ["Shard(0)"]}], "pipeline": null, "rank": 0,
"regions": [], "tp": [], "version": 1, "world_size": 2}"""


def _fully_shard_no_mesh_records() -> dict[int, dict]:
    recs = {}
    for rank in range(2):  # rank 1's record differs only in its rank and coordinate (shards are even)
        rec = json.loads(FULLY_SHARD_NO_MESH_RANK0)
        rec["rank"], rec["meshes"][0]["coord"] = rank, [rank]
        recs[rank] = rec
    return recs


def test_fully_shard_default_mesh_is_data_parallel(tmp_path):
    # fully_shard(model) with no mesh: its unnamed dim "dim0" is what FSDP2 shards over — data
    # parallel, so both ranks are replicas (it was a sharding dim: replicas [0] | [1]).
    path, run_id = _store(tmp_path, _fully_shard_no_mesh_records(), world_size=2)
    lay = _load(path, run_id)
    assert lay.dim_names() == ["dim0"] and lay.dp_dims() == {"dim0"} and lay.sharding_dims() == []
    assert lay.program_peers() == [[0, 1]] and lay.replica_peers() == [[0, 1]]
    assert lay.mesh_dims_of(1, lay.records[1]["fsdp_groups"][0]) == ["dim0"]
    assert lay.expected_local_shape("2.weight", 1) == [2, 16] and lay.explains_shape("0.weight", 0, 1)
    assert lay.to_dict()["dp_dims"] == ["dim0"] and lay.to_dict()["sharding_dims"] == []
    # The same unnamed dim used by a TP style as well: not FSDP2's alone, so it shards programs.
    recs = _fully_shard_no_mesh_records()
    for rec in recs.values():
        rec["tp"] = [{"module": "0", "style": "ColwiseParallel", "mesh": "mesh0", "mesh_dim": None}]
    lay = build_layout(recs)
    assert lay.dp_dims() == set() and lay.sharding_dims() == ["dim0"] and lay.replica_peers() == [[0], [1]]
    # HSDP on dims named neither dp nor tp (fully_shard on a 2-D ("rep", "shd") sub-mesh) x TP on "t".
    params = [{"fqn": "w", "global_shape": [8, 8], "placements": ["Replicate()", "Shard(0)", "Shard(1)"]}]
    groups = [{"module": "", "params": ["w"], "mesh": "mesh0", "mesh_dims": ["rep", "shd"], "reshard_after_forward": True}]
    tp = [{"module": "", "style": "RowwiseParallel", "mesh": "mesh0", "mesh_dim": "t"}]
    recs = {r: layout_record(r, mesh_shape=(2, 2, 2), dim_names=("rep", "shd", "t"), params=params,
                             fsdp_groups=groups, tp=tp) for r in range(8)}
    lay = build_layout(recs)
    assert lay.dp_dims() == {"rep", "shd"} and lay.sharding_dims() == ["t"]
    assert lay.replica_peers() == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_pipeline_stages_are_program_peers():
    # 4 ranks: 2 stages x 2 dp, no mesh dim for pp: the stage comes from the pipeline record.
    recs = {}
    for r in range(4):
        stage = r // 2
        recs[r] = layout_record(r, world_size=4, mesh_ranks=[[0, 1]] if stage == 0 else [[2, 3]], mesh_shape=(1, 2),
                                dim_names=("pp_dummy", "dp"),
                                pipeline={"stage_index": stage, "num_stages": 2, "stage_ranks": [0, 2]})
    lay = build_layout(recs)
    assert [lay.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert lay.program_peers() == [[0, 1], [2, 3]]
    assert lay.coord(2)["pp"] == 1
    # pp_dummy is neither dp nor pp: a sharding dim of size 1 — replicas still pair by stage.
    assert lay.replica_peers() == [[0, 1], [2, 3]]


def test_pp_mesh_dim_and_missing_stage():
    recs = {r: layout_record(r, mesh_shape=(2, 2), dim_names=("pp", "tp")) for r in (0, 1, 2)}
    lay = build_layout(recs, world_size=4)
    assert lay.stage_of(3) == 1 and lay.program_peers() == [[0, 1], [2, 3]]
    assert lay.replica_peers() == [[0], [1], [2], [3]]  # tp shards: nobody's exact replica
    assert lay.dim_groups("pp") == [[0, 2], [1, 3]]
    # A pipeline recorded without a pp mesh dim, one rank without a record: alone, compared with nobody.
    recs = {0: layout_record(0, mesh_shape=None, world_size=2, pipeline={"stage_index": 0})}
    lay = build_layout(recs)
    assert lay.missing_ranks == [1] and lay.program_peers() == [[0], [1]]
    assert lay.dim_groups("pp") == [[0, 1]]


def test_last_record_wins_and_bad_records(tmp_path):
    path = str(tmp_path / "s.db")
    w = StoreWriter(path, "r", 0, 2)
    first = layout_record(0, mesh_shape=(2,), dim_names=("dp",))
    later = layout_record(0, mesh_shape=(2,), dim_names=("dp",), pipeline={"stage_index": 0})
    w.write_compile_events([{"name": EVENT_NAME, "payload": json.dumps(first)},
                            {"name": EVENT_NAME, "payload": json.dumps(later)}])
    w1 = StoreWriter(path, "r", 1, 2)
    w1.write_compile_events([{"name": EVENT_NAME, "payload": "{not json"}])
    lay = _load(path, w.run_id)
    assert lay.records[0]["pipeline"]["stage_index"] == 0 and lay.missing_ranks == [1]
    other = StoreWriter(path, "empty", 0, 1)
    assert _load(path, other.run_id) is None
    for x in (w, w1, other):
        x.engine.dispose()


# ---------------------------------------------------------------------------- real captures

def _run_layout(store, run_name: str):
    from sqlalchemy import select

    from graphdeck.store.schema import Run

    engine = open_engine(store, read_only=True)
    try:
        with session_factory(engine)() as s:
            run_id = s.scalar(select(Run.id).where(Run.name == run_name))
            assert run_id is not None, f"no run {run_name!r} in {store}"
            return run_id, load_layout(s, run_id)
    finally:
        engine.dispose()


def _event_ranks(store, run_id: int, name: str) -> list[int]:
    from sqlalchemy import text

    engine = open_engine(store, read_only=True)
    try:
        with engine.connect() as c:
            return sorted({r for (r,) in c.execute(text("SELECT rank FROM compile_events WHERE run_id = :r AND name = :n"),
                                                   {"r": run_id, "n": name})})
    finally:
        engine.dispose()


@pytest.mark.slow
def test_fsdp_tp_layout_is_captured(nd_fsdp_tp_store):  # noqa: F811
    run_id, lay = _run_layout(nd_fsdp_tp_store, RUN_FSDP_TP)
    assert lay.world_size == 4 and lay.ranks == [0, 1, 2, 3] and lay.missing_ranks == []
    assert [(m["shape"], m["dim_names"], m["ranks"]) for m in lay.meshes] == [([2, 2], ["dp", "tp"], [[0, 1], [2, 3]])]
    for r in range(4):
        rec = lay.records[r]
        assert rec["rank"] == r and rec["world_size"] == 4 and rec["pipeline"] is None
        assert lay.coord(r) == {"dp": r // 2, "tp": r % 2} and rec["meshes"][0]["coord"] == [r // 2, r % 2]
        groups = {g["dim"]: g for g in rec["meshes"][0]["dim_groups"]}
        assert groups["dp"]["ranks"] == [r % 2, r % 2 + 2] and groups["tp"]["ranks"] == [r - r % 2, r - r % 2 + 1]
        assert groups["dp"]["name"] and groups["tp"]["name"] and groups["dp"]["name"] != groups["tp"]["name"]
        # FSDP2 shards dim 0 over dp (strided, as FSDP2 does over a TP-sharded dim); TP: colwise Shard(0), rowwise Shard(1)
        for block in ("blocks.0.", "blocks.1._checkpoint_wrapped_module."):
            w1, w2 = lay.param(block + "w1.weight", r), lay.param(block + "w2.weight", r)
            assert w1["mesh_dims"] == ["dp", "tp"] and w1["global_shape"] == [64, 32] and w1["local_shape"] == [16, 32]
            assert w1["placements"][0] in ("Shard(0)", "_StridedShard(0, sf=2)") and w1["placements"][1] == "Shard(0)"
            assert w2["placements"] == ["Shard(0)", "Shard(1)"] and w2["local_shape"] == [16, 32]
            assert lay.placements(block + "w2.bias", r) == ["Shard(0)", "Replicate()"]
        assert lay.placements("embed.weight", r) == ["Shard(0)"] and lay.param("embed.weight", r)["mesh_dims"] == ["dp"]
        fsdp = {g["module"]: g for g in rec["fsdp_groups"]}
        assert set(fsdp) == {"", "blocks.0", "blocks.1"}
        assert all(g["mesh_dims"] == ["dp"] and g["mesh"] == "mesh0" for g in fsdp.values())
        assert fsdp["blocks.0"]["params"] == ["blocks.0.w1.weight", "blocks.0.w1.bias", "blocks.0.w2.weight",
                                              "blocks.0.w2.bias"]
        assert fsdp["blocks.0"]["reshard_after_forward"] is True and fsdp[""]["reshard_after_forward"] is False
        assert {(t["module"], t["style"], t["mesh_dim"]) for t in rec["tp"]} == {
            ("blocks.0.w1", "ColwiseParallel", "tp"), ("blocks.0.w2", "RowwiseParallel", "tp"),
            ("blocks.1._checkpoint_wrapped_module.w1", "ColwiseParallel", "tp"),
            ("blocks.1._checkpoint_wrapped_module.w2", "RowwiseParallel", "tp")}
        assert {"kind": "activation_checkpoint", "module": "blocks.1", "how": "checkpoint_wrapper"} in rec["regions"]
    assert lay.program_peers() == [[0, 1, 2, 3]] and lay.replica_peers() == [[0, 2], [1, 3]]
    assert lay.dim_groups("tp") == [[0, 1], [2, 3]] and lay.dim_groups("dp") == [[0, 2], [1, 3]]
    assert all(lay.explains_shape("blocks.0.w1.weight", a, b) for a, b in pairs(range(4)))
    # the FSDP2 groups record too, written at the first compile (not only at close)
    assert _event_ranks(nd_fsdp_tp_store, run_id, "graphdeck_comm_groups") == [0, 1, 2, 3]


@pytest.mark.slow
def test_pipeline_layout_is_captured(nd_pipeline_store):  # noqa: F811
    _run_id, lay = _run_layout(nd_pipeline_store, RUN_PIPELINE)
    assert lay.world_size == 2 and lay.ranks == [0, 1] and lay.meshes == []
    for r in (0, 1):
        pipe = lay.records[r]["pipeline"]
        assert (pipe["stage_index"], pipe["num_stages"], pipe["stage_ranks"]) == (r, 2, [0, 1])
        assert pipe["schedule"] == "ScheduleGPipe" and pipe["n_microbatches"] == 4 and pipe["group"]
        assert lay.stage_of(r) == r and lay.coord(r) == {"pp": r}
    assert lay.records[0]["pipeline"]["params"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert lay.records[1]["pipeline"]["params"] == ["fc3.weight", "fc3.bias", "head.weight", "head.bias"]
    assert lay.program_peers() == [[0], [1]] and lay.dim_groups("pp") == [[0, 1]]
    assert lay.to_dict()["stages"] == {"0": 0, "1": 1}
    # pipelining's backward metadata inference (torch.autograd.grad on the first step) is no backward
    # pass that left the stage's parameters without gradients (NOTE: [Backward passes that fill no .grad])
    from sqlalchemy import text

    engine = open_engine(nd_pipeline_store, read_only=True)
    with engine.connect() as c:
        rows = c.execute(text("SELECT rank, n_backward, state_json FROM grad_steps WHERE run_id = :r"),
                         {"r": _run_id}).all()
    engine.dispose()
    assert {r for r, _, _ in rows} == {0, 1} and all(not json.loads(s)["none"] for _, _, s in rows), rows
    assert all(sum(n for r, n, _ in rows if r == k) == 8 for k in (0, 1))  # 2 steps x 4 microbatches


@pytest.fixture(scope="module")
def died_store(tmp_path_factory):
    """One rank of nd_fsdp_tp.py (a 1 x 1 mesh) that ends with os._exit after its first step."""
    path = tmp_path_factory.mktemp("nd_died") / "died.db"
    proc = run_nd_job("nd_fsdp_tp.py", 1, path, "--run-name", "died", "--dp", "1", "--tp", "1", "--die")
    assert proc.returncode == 0
    return path


@pytest.mark.slow
def test_a_job_that_dies_keeps_its_layout(died_store):
    run_id, lay = _run_layout(died_store, "died")
    # close() never ran (it writes the process groups); the layout and FSDP2 groups were written before
    assert _event_ranks(died_store, run_id, "graphdeck_process_groups") == []
    assert lay is not None and lay.ranks == [0] and lay.meshes[0]["dim_names"] == ["dp", "tp"]
    rec = lay.records[0]
    assert {g["module"] for g in rec["fsdp_groups"]} == {"", "blocks.0", "blocks.1"}
    assert lay.placements("blocks.0.w2.weight", 0) == ["Shard(0)", "Shard(1)"]
    assert _event_ranks(died_store, run_id, "graphdeck_comm_groups") == [0]


@pytest.mark.slow
def test_layout_api(nd_fsdp_tp_store, died_store):  # noqa: F811
    with LiveServer(nd_fsdp_tp_store) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        resp = client.get(f"/api/runs/{RUN_FSDP_TP}/layout")
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["world_size"] == 4 and body["missing_ranks"] == [] and body["replica_peers"] == [[0, 2], [1, 3]]
        assert body["coords"]["3"] == {"dp": 1, "tp": 1} and body["dim_groups"]["tp"] == [[0, 1], [2, 3]]
        assert body["records"]["1"]["params"][0]["placements"] == ["Shard(0)"]
        missing = client.get("/api/runs/no-such-run/layout")
        assert missing.status_code == 404 and missing.json()["ok"] is False
    w = StoreWriter(died_store, "no-layout", 0, 1)  # a run whose ranks recorded no layout
    w.engine.dispose()
    with LiveServer(died_store) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        resp = client.get("/api/runs/no-layout/layout")
        body = resp.json()
        assert resp.status_code == 404 and body["ok"] is False and "no parallel layout" in body["error"]
        assert client.get("/api/runs/died/layout").json()["ranks"] == [0]


WATCH_PIPELINE_SCRIPT = r"""
import os, sys, datetime, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from graphdeck.capture import Agent
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
agent = Agent(store=sys.argv[1], run="explicit")
module = agent.watch(torch.nn.Linear(4, 4))   # no mesh, no DTensor yet: nothing to record
stage = PipelineStage(module, stage_index=0, num_stages=1, device=torch.device("cpu"))
schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda out, target: (out - target).square().mean())
assert agent.watch_pipeline(schedule) is schedule
os._exit(0)   # no compile, no close(): the explicit call alone wrote the layout
"""


def test_watch_pipeline_records_an_uncompiled_stage(tmp_path):
    from tests.conftest import free_port, run_python

    store = tmp_path / "explicit.db"
    run_python(WATCH_PIPELINE_SCRIPT, str(store), str(free_port()))
    run_id, lay = _run_layout(store, "explicit")
    pipe = lay.records[0]["pipeline"]
    assert (pipe["stage_index"], pipe["num_stages"], pipe["stage_ranks"]) == (0, 1, [0])
    assert pipe["schedule"] == "Schedule1F1B" and pipe["n_microbatches"] == 2 and pipe["params"] == ["weight", "bias"]
    assert lay.program_peers() == [[0]] and lay.stage_of(0) == 0
    assert _event_ranks(store, run_id, EVENT_NAME) == [0]
