"""Checks per mesh dimension (issue 20, item 3): check-ranks compares only ranks that must run
the same program, explains tensor-parallel shard shapes by the placements, compares collective
schedules per process group; check-grads speaks FSDP2 / TP / PP.

Two kinds of material: a store captured in one process (real ``torch.compile`` through the
agent, each "rank" a fresh Dynamo state with ``RANK`` set) to which the tests add parallel
layout records through the record format (the declared seam, built with
``tests.nd_fixtures.layout_record``); and the real torchrun jobs of ``tests/nd_fixtures.py``
(slow).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.mesh import Wrapping, pp_cut_findings, tp_partial_findings
from graphdeck.analysis.gradients.report import ParamRow, divergence_findings
from graphdeck.analysis.parallel.layout import build_layout
from graphdeck.analysis.ranks.core import Collective, RankReport, rank_report
from graphdeck.analysis.ranks.mesh import compare_schedules
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Run
from tests.conftest import REPO, free_port, run_python
from tests.launch import run_python_job
from tests.nd_fixtures import (  # noqa: F401
    RUN_FSDP_TP,
    RUN_PIPELINE,
    RUN_PIPELINE_CUT,
    layout_record,
    nd_fsdp_tp_store,
    nd_pipeline_cut_store,
    nd_pipeline_store,
)

# Each "rank" compiles in a fresh Dynamo state (compile ids restart at 0/0), captured as RANK=r.
#  run "stages": rank 0 compiles pipeline stage 0 (linear, relu), rank 1 stage 1 (linear, tanh).
#  run "tp": both ranks compile x @ w, w the rank's local piece of a [8, 5] weight sharded on
#  dim 1 over 2 tensor-parallel ranks: [8, 3] on rank 0, [8, 2] on rank 1.
CAPTURE = r"""
import os, sys, torch
from graphdeck.capture import Agent
store = sys.argv[1]
torch.manual_seed(0)

class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.lin(x))

class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 4)
    def forward(self, x):
        return torch.tanh(self.head(x)).sum()

class Row(torch.nn.Module):
    def __init__(self, cols):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, cols))
    def forward(self, x):
        return torch.tanh(x @ self.w).sum()

for run, make in (("stages", lambda r: Stage0() if r == 0 else Stage1()), ("tp", lambda r: Row(3 - r))):
    for rank in (0, 1):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        torch._dynamo.reset()
        agent = Agent(store=store, run=run)
        model = agent.watch(make(rank))
        out = torch.compile(model, backend=agent.backend("aot_eager"))(torch.randn(4, 8))
        out.sum().backward()
        agent.close()
"""

TP_PARAM = {"fqn": "w", "global_shape": [8, 5], "placements": ["Shard(1)"]}


@pytest.fixture(scope="module")
def mesh_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mesh") / "mesh.db"
    run_python(CAPTURE, str(path), env={"OMP_NUM_THREADS": "1"})
    return path


def with_layout(src: Path, dst: Path, run: str, records: dict[int, dict]) -> Path:
    """A copy of store ``src`` with ``graphdeck_parallel_layout`` records added to ``run`` (copied
    through SQLite's backup API: the store may be in WAL mode)."""
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    engine = open_engine(dst)
    with Session(engine) as s:
        run_id = s.scalars(select(Run.id).where(Run.name == run)).one()
        for rank, payload in records.items():
            s.add(CompileEvent(run_id=run_id, rank=rank, name="graphdeck_parallel_layout", compile_id=None,
                               metadata_json="{}", payload=json.dumps(payload)))
        s.commit()
    engine.dispose()
    return dst


def report_of(store: Path, run: str) -> RankReport:
    with Session(open_engine(store, read_only=True)) as s:
        return rank_report(s, s.scalars(select(Run).where(Run.name == run)).one())


def graphdeck(command: str, store: Path, run: str) -> subprocess.CompletedProcess:
    """``graphdeck COMMAND STORE --run RUN`` as a user runs it (the installed console script)."""
    exe = Path(sys.executable).with_name("graphdeck")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "graphdeck.cli"]
    return subprocess.run([*cmd, command, str(store), "--run", run], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def check_ranks_cli(store: Path, run: str) -> subprocess.CompletedProcess:
    return graphdeck("check-ranks", store, run)


def pipeline_records(ranks=(0, 1)) -> dict[int, dict]:
    return {r: layout_record(r, mesh_shape=None, world_size=2,
                             pipeline={"stage_index": r, "num_stages": 2, "stage_ranks": [0, 1]}) for r in ranks}


# ------------------------------------------------------------------------ check-ranks, captured graphs

@pytest.mark.slow
def test_pipeline_stages_are_not_a_divergence(mesh_store, tmp_path):
    """Without a layout every rank must run the same program: the two stages diverge (as before).
    With the pipeline recorded, they are compared with nobody: a note, and the ranks agree."""
    before = report_of(mesh_store, "stages")
    assert before.verdict == "FAIL" and before.divergences[0].what == "graph differs"

    store = with_layout(mesh_store, tmp_path / "pp.db", "stages", pipeline_records())
    rep = report_of(store, "stages")
    assert rep.verdict == "OK", [d.message for d in rep.divergences] + rep.missing_evidence
    from tests.verdict_surfaces import disagreements  # issue 34: the map, the API and the CLI say the same

    assert not disagreements(store, ["stages"])
    assert rep.groups == [[0], [1]] and not rep.divergences
    assert any("stages run different programs by design" in n for n in rep.notes), rep.notes
    assert any("stage 0: [0]; stage 1: [1]" in n for n in rep.notes), rep.notes
    proc = check_ranks_cli(store, "stages")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stages run different programs by design" in proc.stdout and "OK: all ranks agree" in proc.stdout

    # Rank 1's record is missing: its stage is unknown, it is compared with nobody, and the
    # verdict is INCOMPLETE (never "agree").
    store = with_layout(mesh_store, tmp_path / "pp1.db", "stages", pipeline_records((0,)))
    rep = report_of(store, "stages")
    assert rep.verdict == "INCOMPLETE" and not rep.divergences
    assert any("rank(s) [1]: no parallel layout record" in m for m in rep.missing_evidence), rep.missing_evidence
    proc = check_ranks_cli(store, "stages")
    assert proc.returncode == 3 and "compared with nobody" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_tp_shard_shapes_explained_by_placements_are_a_note(mesh_store, tmp_path):
    """x @ w with w [8, 3] on rank 0 and [8, 2] on rank 1: outside dim 0, so no uneven FSDP
    split — a divergence without a layout. Recorded as Shard(1) of [8, 5] on mesh dim "tp":
    tensor-parallel peers whose shapes the placements explain, a note. The same shapes on a
    data-parallel dim (replicas) or a record that does not give these shapes still diverge."""
    before = report_of(mesh_store, "tp")
    assert before.verdict == "FAIL" and before.divergences[0].what == "shapes differ"

    tp = {r: layout_record(r, mesh_shape=(2,), dim_names=("tp",), params=[TP_PARAM]) for r in (0, 1)}
    assert [p["local_shape"] for rec in tp.values() for p in rec["params"]] == [[8, 3], [8, 2]]
    rep = report_of(with_layout(mesh_store, tmp_path / "tp.db", "tp", tp), "tp")
    assert rep.verdict == "OK", [d.message for d in rep.divergences]
    assert rep.groups == [[0, 1]]
    (note,) = [n for n in rep.notes if "tensor-parallel peers holding" in n]
    assert "w [8, 3] vs [8, 2]" in note and "a note, not a divergence" in note and "(tp=1)" in note

    dp = {r: layout_record(r, mesh_shape=(2,), dim_names=("dp",), params=[TP_PARAM]) for r in (0, 1)}
    rep = report_of(with_layout(mesh_store, tmp_path / "dp.db", "tp", dp), "tp")
    (d,) = rep.divergences
    assert d.what == "shapes differ" and "replicas" in d.message and "must agree on shapes exactly" in d.message

    wrong = {r: layout_record(r, mesh_shape=(2,), dim_names=("tp",),
                              params=[dict(TP_PARAM, global_shape=[8, 6])]) for r in (0, 1)}  # [8, 3] both
    rep = report_of(with_layout(mesh_store, tmp_path / "wrong.db", "tp", wrong), "tp")
    assert rep.verdict == "FAIL" and rep.divergences[0].what == "shapes differ"


# ------------------------------------------------------------------------ collective schedules per group

def _coll(kind: str, group: str, size: int) -> Collective:
    return Collective(index=0, kind=kind, group=group, size_bytes=size, shape=None, dtype="float32", source="graph")


def test_collective_schedules_are_compared_per_process_group(tmp_path):
    """2 x 2 dp x tp: ranks 0, 1 all-reduce on their tp group, ranks 2, 3 on theirs. Compared as
    whole schedules the group names differ (a false hang); per process group they agree. A size
    that differs within one tp group is a mismatch naming that group and its members."""
    records = {r: layout_record(r) for r in range(4)}
    layout = build_layout(records)
    tp_of = {r: next(g["name"] for g in records[r]["meshes"][0]["dim_groups"] if g["dim"] == "tp") for r in range(4)}

    def report(sizes):
        schedules = {r: [_coll("all_reduce", tp_of[r], sizes[r]), _coll("all_gather", "fsdp_dp", 64)]
                     for r in range(4)}
        for r, sch in schedules.items():
            for i, c in enumerate(sch):
                c.index = i
        return RankReport(run_id=1, run="x", ranks=[0, 1, 2, 3], groups=[], sequences={}, divergences=[],
                          schedules=schedules, collective_mismatches=[])

    with Session(open_engine(tmp_path / "empty.db")) as s:
        flat, _notes, _gaps = compare_schedules(s, report([1024] * 4), None)
        assert len(flat) == 1, "whole schedules: the tp groups' names differ"
        mismatches, notes, gaps = compare_schedules(s, report([1024] * 4), layout)
        assert mismatches == [] and gaps == []
        assert f"{tp_of[0]} (1 group)" in notes[0] and f"{tp_of[2]} (1 group)" in notes[0]
        mismatches, _n, _g = compare_schedules(s, report([1024, 1024, 1024, 2048]), layout)
    (m,) = mismatches
    assert m.message.startswith(f"process group {tp_of[2]} (ranks [2, 3]): its collective #0 of the predicted step differs")
    assert "2048 bytes" in m.message and m.index == 0


# ------------------------------------------------------------------------ check-grads words

def test_fsdp2_divergence_speaks_fsdp2():
    rows = [ParamRow(rank=0, fqn="expert_b.weight", status="NOT_IN_GRAPH"),
            ParamRow(rank=1, fqn="expert_b.weight", status="OK", paths=1)]
    wrap = Wrapping(fsdp2=True, fsdp_groups=[{"module": "", "params": ["inp.weight", "expert_b.weight"]}])
    (f,) = divergence_findings(rows, ddp=False, compiled=True, fsdp=wrap)
    assert f.kind == "PREDICTED_HANG"
    assert "reduce-scatter then has a different input size on each rank" in f.message
    assert "the root fully_shard group (2 parameters)" in f.message and "silent gradient corruption on NCCL" in f.message
    assert "0 * p.sum()" in f.fix and "its own fully_shard group" in f.fix
    assert "find_unused" not in f.message + f.fix + rows[0].fix
    (ddp,) = divergence_findings(rows, ddp=True, compiled=True)
    assert "find_unused_parameters=True" in ddp.fix  # DDP keeps its own words


def test_tp_partial_placement_is_a_finding():
    params = [{"fqn": "mlp.w2.bias", "global_shape": [32], "placements": ["Replicate()", "Partial(sum)"]},
              {"fqn": "mlp.w1.weight", "global_shape": [64, 32], "placements": ["Shard(0)", "Shard(0)"]}]
    layout = build_layout({r: layout_record(r, params=params) for r in range(4)})
    (f,) = tp_partial_findings(layout)
    assert f.kind == "TP_PARTIAL_GRAD" and f.params == ["mlp.w2.bias"] and f.ranks == [0, 1, 2, 3]
    assert "Partial on mesh dim tp" in f.message and "nothing reduces it" in f.message
    assert "[[0, 1], [2, 3]]" in f.message and "Replicate()" in f.fix


def test_pipeline_stage_without_gradients_is_a_cut_boundary(tmp_path):
    layout = build_layout(pipeline_records())
    rows = [ParamRow(rank=0, fqn="lin.weight", status="NO_GRAD"), ParamRow(rank=0, fqn="lin.bias", status="NO_GRAD"),
            ParamRow(rank=1, fqn="head.weight", status="OK", paths=1)]
    with Session(open_engine(tmp_path / "empty.db")) as s:
        (f,) = pp_cut_findings(s, 1, rows, layout)
        assert f.kind == "PP_BACKWARD_CUT" and f.params == ["lin.bias", "lin.weight"]
        assert f.message.startswith("pipeline stage boundary 0 → 1 (rank(s) [0] → [1]): the backward path is cut")
        assert "stage 0 gets no gradient for any of its parameters while stage 1 (rank(s) [1]) gets its own" in f.message
        rows[0].status = rows[1].status = "OK"
        assert pp_cut_findings(s, 1, rows, layout) == []
        assert pp_cut_findings(s, 1, rows, None) == []


# ------------------------------------------------------------------------ the real N-D jobs (slow)

@pytest.mark.slow
def test_fsdp_tp_ranks_agree_per_mesh_dimension(nd_fsdp_tp_store):  # noqa: F811
    """FSDP2 x TP on a 2 x 2 (dp, tp) mesh: the tp groups' all-reduces name different process
    groups ("3" on ranks 0, 1; "4" on ranks 2, 3) in otherwise equal graphs — one program; the
    collective schedules agree within each group."""
    rep = report_of(nd_fsdp_tp_store, RUN_FSDP_TP)
    assert rep.divergences == [] and rep.collective_mismatches == [], [d.message for d in rep.divergences]
    assert rep.groups == [[0, 1, 2, 3]]
    assert any("every rank must run the same program: [0, 1, 2, 3]" in n for n in rep.notes), rep.notes
    assert any("same coordinate on tp) must agree exactly: [0, 2] | [1, 3]" in n for n in rep.notes), rep.notes
    (per_group,) = [n for n in rep.notes if n.startswith("collective schedules compared per process group")]
    assert "fsdp (2 groups)" in per_group, per_group
    assert not any("no parallel layout record" in m for m in rep.missing_evidence)


@pytest.mark.slow
def test_fsdp_tp_check_ranks_verdict_ok(nd_fsdp_tp_store):  # noqa: F811
    proc = check_ranks_cli(nd_fsdp_tp_store, RUN_FSDP_TP)
    assert proc.returncode == 0 and "OK: all ranks agree" in proc.stdout, proc.stdout[-3000:]
    # Predicted vs recorded compares a group's collectives among its members only (issue 20): no
    # "ranks [2, 3] skip all_reduce" for tp group 3, which ranks 2 and 3 are not members of.
    assert " skip " not in proc.stdout and "did not hold" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_fsdp_tp_predictions_per_group_members(nd_fsdp_tp_store):  # noqa: F811
    """Each tp group's all-reduces predicted among its 2 members and held; FSDP2's 3 all-gathers
    and 3 reduce-scatters a step on each rank's dp group (the mesh's dp dimension groups), not the
    default group; the recorded side counts the members' dumps only."""
    rep = report_of(nd_fsdp_tp_store, RUN_FSDP_TP)
    with Session(open_engine(nd_fsdp_tp_store, read_only=True)) as s:
        records = {r: json.loads(p) for r, p in s.execute(select(CompileEvent.rank, CompileEvent.payload).where(
            CompileEvent.name == "graphdeck_parallel_layout").order_by(CompileEvent.id))}
    groups = {(g["dim"], tuple(g["ranks"])): g["name"] for rec in records.values() for m in rec["meshes"]
              for g in m["dim_groups"]}
    tp = {groups[("tp", (0, 1))]: [0, 1], groups[("tp", (2, 3))]: [2, 3]}
    dp = {groups[("dp", (0, 2))]: [0, 2], groups[("dp", (1, 3))]: [1, 3]}
    by = {p.group: p for p in rep.predictions}
    assert set(by) == set(tp) | set(dp), [p.line() for p in rep.predictions]
    for g, members in {**tp, **dp}.items():
        p = by[g]
        assert p.outcome == "held" and not p.predicted_hang and p.predicted_skipping == [], p.line()
        assert p.members == members and sorted(p.predicted_segments) == members, p.line()
        assert sorted(p.recorded_completed) == members and p.recorded_no_dump == [], p.line()
        assert f"recorded: every member {members} completed" in p.line(), p.line()
    for g in dp:
        assert all(seg["source"] == "fsdp_group" and seg["count"] == 6 for segs in by[g].predicted_segments.values()
                   for seg in segs), by[g].predicted_segments
    for g in tp:
        assert {seg["source"] for segs in by[g].predicted_segments.values() for seg in segs} == {"graph"}
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(nd_fsdp_tp_store), "--run",
                           RUN_FSDP_TP, "--format", "json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    data = json.loads(proc.stdout)
    assert {p["group"]: p["outcome"] for p in data["predictions"]} == {g: "held" for g in by}
    assert data["flight"]["groups_incomplete"] == {} and data["flight"]["no_dump"] == []
    assert {g: data["flight"]["group_members"][g] for g in by} == {**tp, **dp}


@pytest.mark.slow
def test_fsdp_tp_gradient_paths_pass(nd_fsdp_tp_store):  # noqa: F811
    """Every parameter reaches a gradient on every rank; the tp all-reduces in the backward are no
    data-parallel reduction and FSDP2 reduce-scatters its groups after the backward, so no
    GRAD_NOT_REDUCED. Under FSDP2 the evidence is read at each optimizer step (NOTE: [FSDP2
    evidence]): every parameter got a gradient at every step on every rank, so PASS (exit 0), with
    the limit (zero-filled gradients cannot be told apart) said as a note."""
    res = graphdeck("check-grads", nd_fsdp_tp_store, RUN_FSDP_TP)
    head = res.stdout.splitlines()[0]
    assert res.returncode == 0, res.stdout
    assert head.endswith("PASS · OK 48 (of 12 parameters × 4 ranks)"), head
    assert "(error)" not in res.stdout and "GRAD_NOT_REDUCED" not in res.stdout and "INCOMPLETE" not in res.stdout
    assert "rank(s) [0, 1, 2, 3] (FSDP2): gradients were read at each optimizer step" in res.stdout
    assert "cannot be told from a real one there" in res.stdout
    with sqlite3.connect(nd_fsdp_tp_store) as db:  # one row per rank: steps 0-2, every trainable one ok
        rows = db.execute("SELECT rank, step_first, step_last, step_source, closed, state_json FROM grad_steps "
                          "ORDER BY rank").fetchall()
    assert [r[:5] for r in rows] == [(r, 0, 2, "optimizer", 1) for r in range(4)], rows
    for *_, state in rows:
        st = json.loads(state)
        assert st["fsdp2"] and st["trainable"] == 12 and st["none"] == [] and st["limits"] == ["zero", "multi"], st


@pytest.mark.slow
def test_fsdp2_parameter_without_gradient_is_seen_at_each_step(tmp_path):
    """One process, world size 1 (``tests/programs/fsdp2_one_rank.py``: no torchrun): FSDP2's
    sharded parameters get their ``.grad`` assigned after the reduce-scatter, so the evidence reads
    it at each optimizer step: the never-used layer is ``none`` at steps 0-2, the rest ok."""
    store = tmp_path / "one.db"
    proc = run_python_job([REPO / "tests" / "programs" / "fsdp2_one_rank.py", store, free_port()], timeout=300,
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with sqlite3.connect(store) as db:
        ((first, last, n, closed, state),) = db.execute(
            "SELECT step_first, step_last, n_backward, closed, state_json FROM grad_steps").fetchall()
    st = json.loads(state)
    assert (first, last, n, closed) == (0, 2, 3, 1) and st["fsdp2"] and st["trainable"] == 6
    assert st["none"] == ["unused.weight", "unused.bias"] and st["zero"] == []
    res = graphdeck("check-grads", store, "fsdp2_one")
    assert res.returncode == 1, res.stdout
    rows = [ln.split()[:4] for ln in res.stdout.splitlines() if ln.strip().startswith(("OK ", "NOT_IN_GRAPH "))]
    assert ["NOT_IN_GRAPH", "rank", "0", "unused.weight"] in rows and ["NOT_IN_GRAPH", "rank", "0", "unused.bias"] in rows
    assert "no gradient arrived at any observed step (0–2)" in res.stdout and "INCOMPLETE" not in res.stdout


@pytest.mark.slow
def test_pipeline_stages_are_not_reported_as_diverged(nd_pipeline_store):  # noqa: F811
    proc = check_ranks_cli(nd_pipeline_store, RUN_PIPELINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stage 0: [0]; stage 1: [1]" in proc.stdout
    assert "stages run different programs by design" in proc.stdout and "DIVERGED" not in proc.stdout
    assert "OK: all ranks agree" in proc.stdout
    res = graphdeck("check-grads", nd_pipeline_store, RUN_PIPELINE)
    assert "PP_BACKWARD_CUT" not in res.stdout, res.stdout


@pytest.mark.slow
def test_cut_pipeline_backward_is_reported_in_pp_words(nd_pipeline_cut_store):  # noqa: F811
    """Stage 1 detaches its input: its compiled backward returns no gradient for the stage input,
    so stage 0's parameters never train. check-grads names the boundary, the detach and the fix;
    check-ranks still does not call the stages diverged."""
    program = REPO / "tests" / "programs" / "nd_pipeline.py"
    line = next(i for i, t in enumerate(program.read_text().splitlines(), 1) if "x = x.detach()" in t)
    res = graphdeck("check-grads", nd_pipeline_cut_store, RUN_PIPELINE_CUT)
    assert res.returncode == 1, res.stdout
    (finding,) = [ln for ln in res.stdout.splitlines() if "PP_BACKWARD_CUT (error)" in ln]
    # The per-parameter rows agree with the finding: stage 0's parameters do not train (not "OK").
    rows = [ln.split()[:4] for ln in res.stdout.splitlines() if ln.strip().startswith(("OK ", "NO_GRAD "))]
    for fqn in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        assert ["NO_GRAD", "rank", "0", fqn] in rows and ["OK", "rank", "0", fqn] not in rows, rows
    assert "PP_BACKWARD_CUT: the backward path is cut at pipeline stage boundary 0 → 1" in res.stdout
    assert not any(r[0] == "NO_GRAD" and r[2] == "1" for r in rows), "stage 1 trains"
    assert "pipeline stage boundary 0 → 1 (rank(s) [0] → [1]): the backward path is cut" in finding
    assert "stage 1's compiled backward" in finding and "returns no gradient for its stage input" in finding
    assert "fc1.bias, fc1.weight, fc2.bias, fc2.weight" in finding
    assert "detach of the stage input l_x_" in finding and f"nd_pipeline.py:{line} in forward" in finding
    assert "do not detach the stage input of stage 1 or the output of stage 0" in res.stdout
    ranks = check_ranks_cli(nd_pipeline_cut_store, RUN_PIPELINE_CUT)
    assert "DIVERGED" not in ranks.stdout and "stages run different programs by design" in ranks.stdout
