"""Cross-rank consistency on real 2-rank gloo runs (tests/programs/rank_cases.py, ranks started as torchrun would):
a recompile on one rank only, a branch taken on one rank only (with a collective inside the
compiled graph), gradient case G4, compile cases C1 and C2, FSDP2's uneven shards in a compiled
optimizer step, shape-only differences feeding a collective or outside dim 0 — checked through
the analysis, the ``graphdeck check-ranks`` CLI, the HTTP API and the dashboard page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import collective_kind, rank_report, source_line
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Run
from tests.conftest import REPO, LiveServer
from tests.launch import run_ranks

pytestmark = pytest.mark.slow

PROGRAM = REPO / "tests" / "programs" / "rank_cases.py"


@pytest.fixture(scope="module")
def rank_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("ranks") / "ranks.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_ranks([PROGRAM, store], 2, env=env, timeout=600)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return store


def report_of(store: Path, run: str):
    with Session(open_engine(store, read_only=True)) as s:
        return rank_report(s, s.scalar(select(Run).where(Run.name == run)))


def test_recompile_on_one_rank_only(rank_store):
    rep = report_of(rank_store, "dynshape")
    assert rep.ok, "a recompile whose collectives agree is a warning (NOTE: [Recompiles that cannot hang])"
    assert rep.groups == [[0], [1]]
    assert [e.compile_id for e in rep.sequences[0]] == ["0/0"]
    assert [e.compile_id for e in rep.sequences[1]] == ["0/0", "0/1"]
    (d,) = rep.divergences
    assert d.what == "extra compile" and d.ranks == [1] and d.reference_ranks == [0]
    assert d.compile_id == "0/1"
    assert "size mismatch at index 0" in d.recompile_reason and "expected 4, actual 6" in d.recompile_reason
    assert d.harmless and "compile 0/1 on ranks [1]" in d.harmless and "no hang is expected" in d.harmless


def test_branch_by_rank_names_node_line_and_predicts_hang(rank_store):
    rep = report_of(rank_store, "branch")
    assert rep.groups == [[0], [1]]
    (d,) = rep.divergences
    assert d.what == "graph differs" and d.kind == "dynamo"
    assert d.reference_node is None  # the node exists only on rank 1
    assert d.node.target == "torch.tanh"
    line = next(i for i, t in enumerate(PROGRAM.read_text().splitlines(), 1) if "h = torch.tanh(h)" in t)
    assert d.node.source.endswith(f"rank_cases.py:{line} in forward")
    # Rank 0's graph issues one all_reduce, rank 1's two: the second is where the job would hang.
    assert [c.kind for c in rep.schedules[0]] == ["all_reduce"]
    assert [c.kind for c in rep.schedules[1]] == ["all_reduce", "all_reduce"]
    assert rep.schedules[0][0].size_bytes == 4 * 8 * 4  # float32 [4, 8]
    (m,) = rep.collective_mismatches
    assert m.index == 1
    assert {tuple(v["ranks"]) for v in m.variants} == {(0,), (1,)}
    assert "hang" in m.message


def test_g4_branch_on_local_batch_diverges_at_the_branch(rank_store):
    rep = report_of(rank_store, "g4")
    assert not rep.ok and rep.groups == [[0], [1]]
    (d,) = rep.divergences
    assert d.what == "graph differs"
    # Rank 1 (non-empty targets) reads `targets` and runs the embedding; rank 0 does not.
    line = next(i for i, t in enumerate(PROGRAM.read_text().splitlines(), 1) if "if targets.numel() > 0" in t)
    assert d.node is not None and d.reference_node is None
    assert d.node.source.endswith(f"rank_cases.py:{line} in forward")


def test_c1_recompile_on_requires_grad_is_not_a_break_and_ranks_agree(rank_store):
    rep = report_of(rank_store, "c1")
    assert rep.ok and rep.groups == [[0, 1]]
    for r in (0, 1):
        seq = rep.sequences[r]
        assert [e.compile_id for e in seq] == ["0/0", "0/1"]
        assert seq[0].recompile_reason is None
        assert "requires_grad" in seq[1].recompile_reason
    with Session(open_engine(rank_store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "c1"))
        breaks = s.scalars(select(CompileEvent).where(CompileEvent.run_id == run.id,
                                                      CompileEvent.name == "dynamo_graph_break_reason")).all()
    assert breaks == []


def test_c2_data_dependent_tolist_breaks_and_ranks_recompile_differently(rank_store):
    rep = report_of(rank_store, "c2")
    assert not rep.ok
    with Session(open_engine(rank_store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "c2"))
        breaks = s.scalars(select(CompileEvent.payload).where(
            CompileEvent.run_id == run.id, CompileEvent.rank == 0,
            CompileEvent.name == "dynamo_graph_break_reason")).all()
    assert any("tolist" in (b or "") for b in breaks)
    # Several frames (before and after the break); the token counts differ by rank, so the resumed
    # frame's graphs differ and the ranks do not group together.
    assert all(len(rep.sequences[r]) >= 3 for r in (0, 1))
    (d,) = rep.divergences
    assert d.ranks == [1] and d.reference_ranks == [0]
    assert d.what in {"graph differs", "compile sequence differs", "extra compile", "missing compile"}


def test_cli_exit_codes_and_formats(rank_store, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(rank_store), *args],
                              capture_output=True, text=True, timeout=120)

    ok = cli("--run", "c1")
    assert ok.returncode == 0 and "all ranks agree" in ok.stdout
    bad = cli("--run", "branch", "--format", "json")
    assert bad.returncode == 1
    body = json.loads(bad.stdout)
    assert body["ok"] is False and body["collective_mismatches"][0]["index"] == 1
    out = tmp_path / "ranks.xml"
    assert cli("--run", "branch", "--format", "junit", "-o", str(out)).returncode == 1
    from junitparser import JUnitXml

    cases = {c.name: c for suite in JUnitXml.fromfile(str(out)) for c in suite}
    assert cases["rank 0 compile sequence"].is_passed
    assert not cases["rank 1 compile sequence"].is_passed
    missing = cli("--run", "no-such-run")
    assert missing.returncode == 2 and "no-such-run" in missing.stderr


def test_api_and_counterparts(rank_store):
    import httpx

    with LiveServer(rank_store) as srv:
        rep = httpx.get(f"{srv.url}/api/runs/dynshape/rank-consistency").json()
        assert rep["ok"] is True and rep["groups"] == [[0], [1]]  # rank 1's recompile: a warning
        assert "no hang is expected" in rep["divergences"][0]["harmless"]
        seq1 = rep["sequences"]["1"]
        recompiled = next(e for e in seq1 if e["compile_id"] == "0/1")
        forward = next(gid for kind, _h, gid in recompiled["graphs"] if kind == "aot_forward")
        cp = httpx.get(f"{srv.url}/api/graphs/{forward}/counterparts").json()
        assert cp["previous"]["compile_id"] == "0/0" and cp["previous"]["graph_id"] is not None
        assert "size mismatch" in cp["previous"]["recompile_reason"]
        assert cp["ranks"] == [{"rank": 0, "graph_id": None, "same_hash": False}]  # rank 0 never recompiled
        missing = httpx.get(f"{srv.url}/api/runs/nope/rank-consistency")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]


@pytest.mark.browser
def test_dashboard_page_shows_divergence_and_predicted_hang(rank_store, browser):
    with LiveServer(rank_store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/branch")
        page.get_by_test_id("rank-consistency-link").click()
        page.wait_for_selector("[data-testid=rank-verdict]")
        assert "ranks diverge" in page.get_by_test_id("rank-verdict").inner_text()
        assert "torch.tanh" in page.get_by_test_id("divergence").inner_text()
        assert "collective #1" in page.get_by_test_id("predicted-hang").inner_text()
        assert page.locator("#collective-schedule tr.hang").count() == 1
        page.close()


def test_helpers():
    assert collective_kind("_c10d_functional.all_reduce.default") == "all_reduce"
    assert collective_kind("torch.ops._c10d_functional.all_gather_into_tensor.default") == "all_gather_into_tensor"
    assert collective_kind("_c10d_functional.wait_tensor.default") is None
    assert collective_kind("aten.mm.default") is None
    assert source_line('File "/a/b.py", line 3, in f\n    x\n  File "/a/c.py", line 9, in g\n    y') == "/a/c.py:9 in g"


def _imported(tmp_path, folder: str, run: str):
    from graphdeck.store.torch_trace import import_torch_trace
    from tests.conftest import shared_path

    logs = shared_path("data", "torch_trace", "tlparse_tests", "inputs", folder)
    store = tmp_path / f"{run}.db"
    import_torch_trace(open_engine(store), logs, run_name=run)
    return report_of(store, run)


def test_c4_imported_multi_rank_logs_group_by_rank(tmp_path):
    rep = _imported(tmp_path, "multi_rank_logs", "c4")
    assert rep.groups == [[0, 2], [1], [3]]
    for r in (0, 2):
        (only,) = rep.sequences[r]
        assert only.compile_id == "0/0" and "BackendCompilerFailed" in only.failed
    assert len(rep.sequences[1]) == 15 and len(rep.sequences[3]) == 7
    for r in (1, 3):
        assert all(e.failed is None for e in rep.sequences[r])
        assert all("size mismatch" in e.recompile_reason for e in rep.sequences[r][1:])
    assert {tuple(d.ranks) for d in rep.divergences} == {(1,), (3,)}
    assert all(d.what == "compile failed" and d.reference_ranks == [0, 2] for d in rep.divergences)


def test_imported_7_rank_runtime_logs_predict_the_collective_hang(tmp_path):
    rep = _imported(tmp_path, "multi_rank_runtime", "rt")
    assert rep.groups == [[0, 1, 2, 3, 4], [5, 6]]  # ranks 5/6 ran a shorter program
    (d,) = rep.divergences
    assert d.what == "missing compile" and d.ranks == [5, 6]
    # Frame 0 recompiled 3 times on ranks 0-4 and once on ranks 5/6: each runs its latest compile
    # (NOTE: [Recompiles replace graphs]), whose graphs issue the same collectives, so the
    # replaced graphs add none and no hang is predicted (the compile divergence above stays).
    kinds = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
    assert all([c.kind for c in rep.schedules[r]] == kinds for r in rep.ranks)
    assert {c.compile_id for c in rep.schedules[0]} == {"0/3"} and {c.compile_id for c in rep.schedules[5]} == {"0/1"}
    assert rep.collective_mismatches == []


def test_imported_inductor_collective_schedule_orders_the_collectives(tmp_path):
    rep = _imported(tmp_path, "collectives_parity", "cp")
    sched = rep.schedules[0]
    assert [c.source for c in sched] == ["inductor_collective_schedule"] * len(sched)
    # 4 compiles of one frame: the first issues one all_reduce, each recompile all_reduce,
    # all_gather, reduce_scatter; the latest (0/3) is the graph that runs (NOTE: [Recompiles
    # replace graphs]), in Inductor's order.
    assert [e.compile_id for e in rep.sequences[0]] == ["0/0", "0/1", "0/2", "0/3"]
    assert [c.kind for c in sched] == ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
    assert [c.compile_id for c in sched] == ["0/3"] * 3
    assert all(c.size_bytes and c.dtype == "float16" and c.group == "0" for c in sched)
    assert rep.ok  # one rank: nothing to disagree with


@pytest.mark.browser
def test_compare_page_shows_the_recompile_reason(rank_store, browser):
    import httpx

    with LiveServer(rank_store) as srv:
        rep = httpx.get(f"{srv.url}/api/runs/dynshape/rank-consistency").json()
        recompiled = next(e for e in rep["sequences"]["1"] if e["compile_id"] == "0/1")
        later = next(gid for kind, _h, gid in recompiled["graphs"] if kind == "aot_forward")
        earlier = httpx.get(f"{srv.url}/api/graphs/{later}/counterparts").json()["previous"]["graph_id"]
        page = browser.new_page()
        page.goto(f"{srv.url}/#/compare/{earlier}/{later}")
        page.wait_for_selector("[data-testid=recompile-reason]")
        text = page.get_by_test_id("recompile-reason").inner_text()
        assert "0/1 recompiled 0/0" in text and "size mismatch" in text
        page.close()


def test_rank_local_device_indices_are_not_a_divergence(rank_store, tmp_path):
    """On 2 GPUs rank r's graphs name ``cuda:r`` (factory kwargs, tensor metadata), so their
    structural hashes differ though the program is the same (seen on the 2 x H200 run of issue
    11). Made here from run c1 (the ranks agree): one node per graph of each rank gets its rank's
    device in its args and every graph a rank-specific hash, as such a capture writes them; the
    ranks must still agree. A real difference (a shape) on top must still diverge."""
    import shutil

    from sqlalchemy import text

    store = tmp_path / "gpu.db"
    shutil.copy(rank_store, store)
    engine = open_engine(store)
    with engine.begin() as c:
        run_id = c.execute(text("SELECT id FROM runs WHERE name = 'c1'")).scalar()
        for gid, rank in c.execute(text("SELECT id, rank FROM graphs WHERE run_id = :r"), {"r": run_id}).all():
            c.execute(text("UPDATE graphs SET structural_hash = :h WHERE id = :g"), {"h": f"rank{rank}-{gid}", "g": gid})
            c.execute(text("UPDATE nodes SET args_json = :a WHERE graph_id = :g AND idx = "
                           "(SELECT MIN(idx) FROM nodes WHERE graph_id = :g AND op = 'call_function')"),
                      {"a": json.dumps({"args": [], "kwargs": {"device": f"device(type='cuda', index={rank})",
                                                               "to": f"cuda:{rank}"}}), "g": gid})
    engine.dispose()
    rep = report_of(store, "c1")
    assert rep.ok and rep.groups == [[0, 1]], [d.message for d in rep.divergences]
    engine = open_engine(store)
    with engine.begin() as c:
        gid = c.execute(text("SELECT MIN(id) FROM graphs WHERE run_id = :r AND rank = 1"), {"r": run_id}).scalar()
        c.execute(text("UPDATE nodes SET shape_json = '[999]' WHERE graph_id = :g AND idx = 0"), {"g": gid})
    engine.dispose()
    rep = report_of(store, "c1")
    # Same program, one shape changed ([4, 8] -> [999]): a divergence that says so.
    assert not rep.ok and rep.divergences and rep.divergences[0].what == "shapes differ"
    assert "[999]" in rep.divergences[0].message and "same program, different shapes" in rep.divergences[0].message


def test_fsdp2_uneven_shards_are_a_note_not_a_divergence(rank_store, tmp_path):
    """FSDP2 over 2 ranks, a 37-row embedding, the AdamW step compiled (as the 2 x H200 GPT-2 run
    of issue 11, whose 50,257-row embedding is 25,129 rows on rank 0 and 25,128 on rank 1): the
    optimizer graph reads each rank's local shard, so its shapes differ by rank in dim 0 only.
    Same program: the ranks agree and the report names the shard."""
    rep = report_of(rank_store, "fsdp2_uneven")
    assert rep.ok and rep.groups == [[0, 1]], [d.message for d in rep.divergences]
    (sh,) = rep.shard_shapes
    assert sh.kind == "aot_inference" and sh.param == "embed.weight"  # param_groups[0] index 0, not head.weight
    assert (sh.rows, sh.shards) == (37, 2)
    assert [(v["ranks"], v["shape"]) for v in sh.variants] == [([0], "[19, 16]"), ([1], "[18, 16]")]
    assert sh.differing_nodes > 1  # the shard and everything the step computes from it
    assert any("uneven FSDP split" in n and "embed.weight" in n for n in rep.notes), rep.notes

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(rank_store),
                               "--run", "fsdp2_uneven", *args], capture_output=True, text=True, timeout=120)

    text = cli()
    assert text.returncode == 0, text.stdout + text.stderr
    assert "rank-dependent shard shapes (uneven FSDP split)" in text.stdout
    assert "embed.weight (arg0_1) is [19, 16] on rank 0, [18, 16] on rank 1" in text.stdout
    assert "OK: all ranks agree" in text.stdout
    body = json.loads(cli("--format", "json").stdout)
    assert body["ok"] is True and body["shard_shapes"][0]["param"] == "embed.weight"
    out = tmp_path / "ranks.xml"
    assert cli("--format", "junit", "-o", str(out)).returncode == 0
    from junitparser import JUnitXml

    cases = {c.name: c for suite in JUnitXml.fromfile(str(out)) for c in suite}
    assert all(c.is_passed for c in cases.values())
    assert "uneven FSDP split" in cases["rank 1 compile sequence"].system_out


def test_shape_difference_feeding_a_collective_diverges(rank_store):
    """5 rows on rank 0, 4 on rank 1 — what an uneven split of 9 rows gives — but all-reduced:
    a collective whose size differs by rank, so still a divergence (and a predicted hang)."""
    from graphdeck.analysis.ranks.shard_shapes import shard_split

    assert shard_split([5, 4]) == (9, 2)  # the sizes alone would pass as shards
    rep = report_of(rank_store, "collective_shape")
    assert not rep.ok and not rep.shard_shapes
    (d,) = rep.divergences
    assert d.what == "collective shapes differ"
    assert "all_reduce" in d.message and "corrupts data or hangs" in d.message
    assert (d.reference_node.shape, d.node.shape) == ("[5, 8]", "[4, 8]")
    (m,) = rep.collective_mismatches
    assert m.index == 0 and "hang" in m.message


def test_shape_difference_outside_dim0_is_same_program_different_shapes(rank_store):
    rep = report_of(rank_store, "shape_dim1")
    assert not rep.ok and not rep.shard_shapes and not rep.collective_mismatches
    (d,) = rep.divergences
    assert d.what == "shapes differ"
    assert "same program, different shapes" in d.message and "outside dim 0" in d.message
    assert (d.reference_node.shape, d.node.shape) == ("[4, 8]", "[4, 10]")
    line = next(i for i, t in enumerate(PROGRAM.read_text().splitlines(), 1) if "return torch.tanh(x) * 2" in t)
    assert d.node.source.endswith(f"rank_cases.py:{line} in f")


def test_shard_split_rule():
    from graphdeck.analysis.ranks.shard_shapes import ShapeDiff, chunk_sizes, classify, shard_split, tensor_shapes

    assert chunk_sizes(50257, 2) == [25129, 25128]
    assert chunk_sizes(9, 4) == [3, 3, 3, 0]  # torch.chunk gives 3 chunks; FSDP2 pads an empty one
    assert shard_split([25129, 25128]) == (50257, 2)
    assert shard_split([3, 3, 3, 0]) == (9, 4)
    assert shard_split([3, 2, 3, 2]) == (5, 2)  # HSDP: 2 replicas of a 2-way shard group
    assert shard_split([4, 5]) is None  # rank 0 would hold the larger shard
    assert shard_split([5, 3]) is None  # not ceil-then-remainder
    assert tensor_shapes("[[19, 16], [16]]") == [(19, 16), (16,)] and tensor_shapes(None) == []

    def diff(*shapes):
        return ShapeDiff(position=0, shapes=list(shapes), strides=[None] * len(shapes))

    assert classify([diff("[19, 16]", "[18, 16]"), diff("[[19], [8]]", "[[18], [8]]")]).shard
    assert "outside dim 0" in classify([diff("[4, 8]", "[4, 10]")]).reason
    assert "strides" in classify([ShapeDiff(0, ["[4, 8]", "[4, 8]"], ["[8, 1]", "[1, 4]"])]).reason
    assert "split over different numbers" in classify([diff("[3]", "[3]", "[3]", "[0]"),
                                                       diff("[3]", "[2]", "[3]", "[2]")]).reason


@pytest.mark.browser
def test_dashboard_page_shows_shard_shapes_as_a_note(rank_store, browser):
    with LiveServer(rank_store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/fsdp2_uneven/ranks")
        page.wait_for_selector("[data-testid=rank-verdict]")
        assert "all ranks agree" in page.get_by_test_id("rank-verdict").inner_text()
        item = page.get_by_test_id("shard-shapes").inner_text()
        assert "embed.weight" in item and "[19, 16] on rank 0" in item and "[18, 16] on rank 1" in item
        assert page.locator("[data-testid=shard-shapes] a[href^='#/graphs/']").count() == 2
        assert page.get_by_test_id("divergence").count() == 0
        page.close()
