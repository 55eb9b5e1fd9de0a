"""FSDP2 + torch.compile on 2 gloo ranks: one compiled block graph serves every block.

Under FSDP2 the per-block hooks break the Dynamo graph at each block, so the block's frame is
compiled once (placeholders named relative to the block: ``ln.weight``) and called with each
block's unsharded parameters in turn. The capture binds parameters at run time (NOTE: [Run-time
parameter binding] in capture/agent.py); before that, every block but the first looked
NOT_IN_GRAPH and the relative names polluted the parameter list. The root ``forward`` falls back
to eager under FSDP2 (Dynamo cannot trace FSDP's ``disable``d pre-forward): its parameters are
OK because they held a gradient at the end of the first backward, while an unused parameter
stays NOT_IN_GRAPH.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from graphdeck import validate_backward
from graphdeck.store.db import open_engine
from tests.launch import run_ranks

REPO = Path(__file__).resolve().parents[1]
BLOCK_PARAMS = ("ln.weight", "ln.bias", "fc.weight", "fc.bias", "proj.weight", "proj.bias")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    path = out / "fsdp2.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_ranks([REPO / "tests" / "programs" / "fsdp2_blocks.py", path, "--unused"], 2, env=env, cwd=REPO,
                     timeout=600)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return path


def test_one_block_graph_binds_every_block(store):
    engine = open_engine(store, read_only=True)
    with engine.connect() as c:
        block_graphs = c.execute(text("SELECT id FROM graphs WHERE rank = 0 AND kind = 'dynamo'")).scalars().all()
        bound = set(c.execute(text(
            "SELECT DISTINCT param_fqn FROM graph_io io JOIN graphs g ON g.id = io.graph_id "
            "WHERE g.rank = 0 AND io.direction = 'grad' AND io.param_fqn IS NOT NULL")).scalars())
        names = set(c.execute(text("SELECT fqn FROM params WHERE rank = 0")).scalars())
    assert len(block_graphs) == 1  # compiled once, reused for three blocks
    assert {f"blocks.{b}.{p}" for b in range(3) for p in BLOCK_PARAMS} <= bound
    assert not any(n.startswith(("ln.", "fc.", "proj.")) for n in names), "relative names leaked into params"


def test_gradient_report_on_fsdp2(store):
    report = validate_backward(store, "fsdp2")
    by = {(r.rank, r.fqn): r for r in report.rows}
    for rank in (0, 1):
        for b in range(3):
            for p in BLOCK_PARAMS:
                assert by[(rank, f"blocks.{b}.{p}")].status == "OK", (rank, b, p, by[(rank, f"blocks.{b}.{p}")].reason)
        # Truly unused: read by no graph, and its block's forward compiled.
        assert by[(rank, "blocks.2.spare.weight")].status == "NOT_IN_GRAPH"
        # Read only by the root forward, which ran eagerly: FSDP2's gradient was read at every
        # optimizer step (NOTE: [FSDP2 evidence]).
        for p in ("embed.weight", "embed.bias", "head.weight", "head.bias"):
            row = by[(rank, p)]
            assert row.status == "OK" and "a gradient arrived at every observed step" in row.reason, (p, row.reason)
        spare = by[(rank, "blocks.2.spare.weight")]
        assert "no gradient arrived at any observed step" in spare.reason and not report.ok, spare.reason
    assert any("ran eagerly" in n for n in report.notes), report.notes


def test_h200_fsdp2_inductor_store(tmp_path):
    """The shipped H200 run (tests/data/fsdp2_h200): GPT-2 small, FSDP2 + Inductor, world size 1."""
    import gzip
    import shutil

    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.mapping import map_trace

    path = tmp_path / "fsdp2.db"
    with gzip.open(REPO / "tests" / "data" / "fsdp2_h200" / "fsdp2.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    report = validate_backward(path, "fsdp2")
    by = {r.fqn: r for r in report.rows}
    blocks = [r for r in report.rows if r.fqn.startswith("transformer.h.")]
    assert len(blocks) == 12 * 12 and all(r.status == "OK" for r in blocks)
    eager = [r.fqn for r in report.rows if r.status == "NOT_IN_GRAPH"]
    assert sorted(eager) == ["transformer.ln_f.bias", "transformer.ln_f.weight", "transformer.wpe.weight"]
    assert all("fell back to eager" in by[f].reason for f in eager)
    engine = open_engine(path)
    with Session(engine) as s:
        trace_id = s.connection().exec_driver_sql("SELECT id FROM traces").scalar()
        m = map_trace(s, trace_id)
    assert m.mapped_ns / m.kernel_ns > 0.93, m.mapped_ns / m.kernel_ns
    engine.dispose()


def test_fsdp2_groups_are_recorded_for_collectives(store):
    """The capture records each ``fully_shard`` unit's parameters and the element count of its
    all-gather / reduce-scatter (dim 0 padded to a multiple of the 2 shards), on every rank
    (NOTE: [Communication groups]); trace analysis ties NCCL kernels to graph nodes by it."""
    import json
    import math

    engine = open_engine(store, read_only=True)
    with engine.connect() as c:
        records = c.execute(text("SELECT rank, payload FROM compile_events WHERE name = 'graphdeck_comm_groups'")).all()
        shapes = {f: json.loads(s) for f, s in c.execute(text("SELECT fqn, shape_json FROM params WHERE rank = 0"))}
    assert sorted(r for r, _ in records) == [0, 1], "one record per rank (close() does not repeat it)"
    data = json.loads(records[-1][1])
    assert data["world_size"] == 2 and data["ddp"] == []
    groups = {g["module"]: g for g in data["fsdp"]}
    assert set(groups) == {"", "blocks.0", "blocks.1", "blocks.2"}
    assert sorted(groups[""]["params"]) == ["embed.bias", "embed.weight", "head.bias", "head.weight"]
    assert set(groups["blocks.2"]["params"]) == {f"blocks.2.{p}" for p in BLOCK_PARAMS} | {"blocks.2.spare.weight",
                                                                                          "blocks.2.spare.bias"}
    for g in groups.values():
        padded = sum(math.ceil(shapes[f][0] / 2) * 2 * math.prod(shapes[f][1:]) for f in g["params"])
        assert g["all_gather_numel"] == padded and g["all_gather_bytes"] == 4 * padded
        assert g["numel"] == sum(math.prod(shapes[f]) for f in g["params"])
