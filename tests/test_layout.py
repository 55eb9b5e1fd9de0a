"""The parallel layout (issue 20 item 1): RunLayout on built records, then the real captures —
FSDP2 x TP on a 2 x 2 gloo mesh, a 2-stage pipeline, a job that dies — and the API route."""

from __future__ import annotations

import json

from graphdeck.analysis.layout import EVENT_NAME, build_layout, load_layout
from graphdeck.capture.writer import StoreWriter
from graphdeck.store.db import open_engine, session_factory
from tests.nd_fixtures import fsdp_tp_records, layout_record


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
