"""GPU truth (issue 22) on a real H200 run: tests/data/gpt2_h200_trace/ (README there).

A GPT-2 (6 layers, Inductor, bf16 autocast, fused AdamW) captured live on torch 2.11, whose
TORCH_TRACE log has an empty backward provenance mapping (``{"version": 2.0}``): the imported
log maps its backward kernels through the output code's source-node comments (NOTE: [Kernels by
output code]) as well as the live capture does; a low mapped share warns, naming the largest
unmapped kernels; the CUDA memory snapshot of the profiled steps replays to within 5% of
``torch.cuda.max_memory_allocated`` and its bytes land on graph nodes. All CPU work.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import sqlite3
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.measured import load_snapshot, measure, output_code_files
from graphdeck.analysis.memory.snapshots import is_snapshot
from graphdeck.analysis.traces.kernel_source_nodes import coverage_warning, output_code_table
from graphdeck.analysis.traces.mapping import map_trace
from graphdeck.cli import main as cli
from graphdeck.errors import UsageError
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run, Trace
from tests.conftest import LiveServer

DATA = Path(__file__).resolve().parent / "data" / "gpt2_h200_trace"
FILES = ("gpt2_rank0.torch_trace.log.gz", "gpt2_rank0.pt.trace.json.gz", "gpt2.db.gz", "snapshot.pickle.gz",
         "info.json")


@pytest.fixture(scope="module")
def data():
    missing = [f for f in FILES if not (DATA / f).exists()]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"corpus files missing: {missing}")
        pytest.skip(f"corpus files missing: {missing}")
    return DATA


@pytest.fixture(scope="module")
def imported(data, tmp_path_factory):
    """The TORCH_TRACE log and the Kineto trace imported as a user would (``graphdeck import``)."""
    tmp = tmp_path_factory.mktemp("gpu-truth")
    store = tmp / "imp.db"
    for f in ("gpt2_rank0.torch_trace.log.gz",):
        shutil.copy(data / f, tmp / f)
    res = CliRunner().invoke(cli, ["import", str(tmp / "gpt2_rank0.torch_trace.log.gz"), "--store", str(store),
                                   "--run", "gpt2", "--no-progress"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["ingest-trace", str(data / "gpt2_rank0.pt.trace.json.gz"), "--store", str(store),
                                   "--run", "gpt2", "--rank", "0"])
    assert res.exit_code == 0, res.output
    return store, res.output


@pytest.fixture(scope="module")
def live(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-truth-live") / "gpt2.db"
    with gzip.open(data / "gpt2.db.gz", "rb") as fin, open(path, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return path


def _mapping(path):
    engine = open_engine(path)
    with Session(engine) as s:
        return map_trace(s, s.scalars(select(Trace.id)).first())


def test_backward_output_code_gives_a_table_like_the_stack_traces(imported):
    store, _ = imported
    con = sqlite3.connect(store)
    rows = con.execute("SELECT name, payload FROM compile_events WHERE compile_id = '1/0_1' AND name IN "
                       "('inductor_output_code', 'inductor_provenance_tracking_node_mappings', "
                       "'inductor_provenance_tracking_kernel_stack_traces') ORDER BY id").fetchall()
    con.close()
    names = [n for n, _ in rows]
    # forward (code, mapping, stacks), then the lazily compiled backward (code, empty mapping, stacks)
    assert names == ["inductor_output_code", "inductor_provenance_tracking_node_mappings",
                     "inductor_provenance_tracking_kernel_stack_traces"] * 2
    assert json.loads(rows[4][1]) == {"version": 2.0}
    table = output_code_table(rows[3][1])
    stacks = json.loads(rows[5][1])
    # the same "<kernel>:<handle>" calls in the same order; the stack-trace artifact also repeats
    # the loss backward's one kernel, compiled just before in the same process
    assert list(table) == [k for k in stacks if k in table] and len(stacks) - len(table) == 1
    assert all(nodes for nodes in table.values())
    # torch versions without the debug-handle comments: the calls are counted from 1 (here the
    # handles start at 2, after the loss backward's kernel), same calls and nodes in the same order
    no_handles = "\n".join(ln for ln in rows[3][1].splitlines() if "[Provenance debug handles]" not in ln)
    counted = output_code_table(no_handles)
    assert [(k.rpartition(":")[0], v) for k, v in counted.items()] == \
        [(k.rpartition(":")[0], v) for k, v in table.items()]
    # the backward's comments name its AOT graph's nodes: the links land on real nodes
    con = sqlite3.connect(store)
    linked, known = con.execute(
        "SELECT count(*), sum(EXISTS(SELECT 1 FROM nodes n WHERE n.graph_id = k.graph_id AND n.name = k.node_name)) "
        "FROM kernel_nodes k WHERE k.source = 'inductor_provenance_v2_outcode'").fetchone()
    kinds = {r[0] for r in con.execute("SELECT DISTINCT g.kind FROM kernel_nodes k JOIN graphs g ON g.id = k.graph_id "
                                       "WHERE k.source = 'inductor_provenance_v2_outcode'")}
    con.close()
    assert kinds == {"aot_backward"} and linked > 1000 and known / linked > 0.95


def test_imported_log_maps_backward_kernels_as_well_as_live_capture(imported, live):
    store, out = imported
    imp, cap = _mapping(store), _mapping(live)
    assert imp.sources.get("inductor_provenance_v2_outcode", 0) > 400  # the backward's kernels
    # >= 95% with the eager fused AdamW step mapped to the optimizer step as a whole (NOTE:
    # [Optimizer step kernels]): 12 kernels (6 per profiled step), ~8% of the kernel time
    for m in (imp, cap):
        assert m.mapped_fraction > 0.99, m.mapped_fraction
        assert m.sources["optimizer step"] == 12 and list(m.optimizer_ns) == ["AdamW.step"]
        assert 0.07 < m.optimizer_ns["AdamW.step"] / m.kernel_ns < 0.10
        assert sum(m.node_ns.values()) + sum(m.optimizer_ns.values()) == m.mapped_ns
        assert not any("FusedAdamMathFunctor" in k for k in m.unmapped)
        compiled_unmapped = sum(ns for k, ns in m.unmapped.items() if k.startswith("triton_"))
        assert compiled_unmapped == 0
    assert abs(imp.mapped_fraction - cap.mapped_fraction) < 0.005
    # ingest-trace's headline says each number with what it covers (NOTE: [Trace coverage]): the
    # share of all kernel time on FX nodes (the optimizer's is not), the coverage of the compiled
    # graphs' kernel time, and the eager optimizer step apart, on the step and no node
    line = next(ln for ln in out.splitlines() if "maps to FX graph nodes" in ln)
    on_nodes = sum(imp.node_ns.values()) / imp.kernel_ns
    assert line.startswith(f"{on_nodes:.1%} of its GPU kernel time maps to FX graph nodes") and on_nodes < 0.93, line
    assert f"that is {imp.coverage.fraction:.1%} of the GPU kernel time of compiled graphs" in line, line
    assert imp.coverage.fraction > 0.99, imp.coverage
    assert "eager optimizer step (AdamW.step, on the step, no node) 8." in line, line


@pytest.fixture(scope="module")
def low_coverage(imported, tmp_path_factory):
    """The imported store with the backward's kernel table removed (as before NOTE: [Kernels by
    output code]): ~47% of the kernel time maps."""
    store, _ = imported
    path = tmp_path_factory.mktemp("gpu-truth-low") / "low.db"
    src, con = sqlite3.connect(store), sqlite3.connect(path)
    src.backup(con)  # the WAL's pages too
    src.close()
    con.execute("DELETE FROM kernel_nodes WHERE source = 'inductor_provenance_v2_outcode'")
    con.commit()
    con.close()
    return path


@pytest.mark.browser
def test_low_coverage_warns_with_largest_unmapped(imported, low_coverage, browser):
    store, out = imported
    m = _mapping(store)
    assert coverage_warning(m) is None  # 99.9% >= 90%
    assert "maps to FX graph nodes" in out and "warning:" not in out
    low = _mapping(low_coverage)
    assert 0.4 < low.mapped_fraction < 0.9
    msg = coverage_warning(low)
    assert msg.startswith("only ") and "below 90%" in msg and "largest unmapped: triton_" in msg
    # the API and the trace page say it too, naming the same kernels
    tid = sqlite3.connect(low_coverage).execute("SELECT max(id) FROM traces").fetchone()[0]
    with LiveServer(low_coverage) as srv:
        a = httpx.get(f"{srv.url}/api/traces/{tid}/analysis", timeout=120).json()
        assert a["mapping"]["warning"] == msg
        assert a["mapping"]["optimizer"] == [{"step": "AdamW.step", "kernel_ns": low.optimizer_ns["AdamW.step"]}]
        if browser is not None:
            page = browser.new_page()
            page.goto(f"{srv.url}/#/traces/{tid}")
            banner = page.wait_for_selector('[data-testid="mapping-warning"]', timeout=120_000)
            assert msg in banner.inner_text()
            assert "optimizer step AdamW.step" in page.inner_text("#mapping-summary")
            page.close()
    with LiveServer(store) as ok:
        tid = sqlite3.connect(store).execute("SELECT max(id) FROM traces").fetchone()[0]
        assert httpx.get(f"{ok.url}/api/traces/{tid}/analysis", timeout=120).json()["mapping"]["warning"] is None


def test_snapshot_peak_matches_max_memory_allocated(data, imported):
    store, _ = imported
    info = json.loads((data / "info.json").read_text())
    snap = load_snapshot(data / "snapshot.pickle.gz")
    engine = open_engine(store)
    with Session(engine) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "gpt2"))
    code = output_code_files(engine, run_id)
    assert len(code) == 4  # model fw/bw, loss fw/bw
    m = measure(snap, code)
    assert m.baseline_bytes == info["allocated_before_bytes"]
    assert abs(m.peak_bytes / info["max_memory_allocated_bytes"] - 1) < 0.05
    assert m.attributed / m.allocations > 0.95
    graph_bytes = m.by_category_bytes["graph"]
    assert graph_bytes / (m.peak_bytes - m.baseline_bytes) > 0.95
    named = sum(b for b, w in m.at_peak if w[0] == "graph" and w[2])
    assert named / graph_bytes > 0.9  # on named post-grad nodes, not only on a graph
    res = CliRunner().invoke(cli, ["memory-snapshot", str(data / "snapshot.pickle.gz"), "--store", str(store),
                                   "--run", "gpt2", "--top", "3"])
    assert res.exit_code == 0 and "measured peak 4,025.9 MiB" in res.output, res.output
    # beside it, the graph-derived step from the Inductor code (NOTE: [Inductor buffer model])
    assert "graph-derived (Inductor code): step peak 3,324.9 MiB with 312.5 MiB parameters" in res.output


def test_snapshot_bad_input(tmp_path, data):
    bad = tmp_path / "x.pickle"
    bad.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(UsageError, match="device_traces"):
        load_snapshot(bad)
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(Path("/")))
    with pytest.raises(UsageError, match="names"):
        load_snapshot(evil)
    with pytest.raises(UsageError, match="no allocation history"):
        measure({"segments": [], "device_traces": [[]]})
    res = CliRunner().invoke(cli, ["memory-snapshot", str(data / "info.json")])
    assert res.exit_code == 2 and "not a CUDA memory snapshot" in res.output


def _cpu_made_snapshot(code: dict) -> tuple[dict, int, list[str]]:
    """A snapshot with the structure ``torch.cuda.memory._snapshot()`` writes (NOTE: [Memory
    snapshot format]), made here: 1 MiB live before the history, then two buffers allocated by
    a backward's ``empty_strided`` lines (its output code file and line numbers, as CUDA frames
    would name them) and an eager one, one of them freed. Returns it, the peak bytes and the
    first buffer's nodes."""
    from graphdeck.analysis.memory.measured import _nodes_at

    path, (gid, _cid, lines) = next((p, v) for p, v in code.items() if any("empty_strided" in ln for ln in v[2]))
    cands = [i + 1 for i, ln in enumerate(lines) if "empty_strided" in ln and _nodes_at(lines, i + 1)]
    at = [cands[0], next(i for i in cands if _nodes_at(lines, i) != _nodes_at(lines, cands[0]))]
    mib = 2 ** 20

    def frame(line):
        return [{"filename": path, "line": line, "name": "call"}, {"filename": "train.py", "line": 9, "name": "step"}]

    trace = [
        {"action": "alloc", "addr": 0x1000, "size": 4 * mib, "stream": 0, "time_us": 1, "frames": frame(at[0])},
        {"action": "alloc", "addr": 0x2000, "size": 2 * mib, "stream": 0, "time_us": 2, "frames": frame(at[1])},
        {"action": "alloc", "addr": 0x3000, "size": 1 * mib, "stream": 0, "time_us": 3,
         "frames": [{"filename": "train.py", "line": 7, "name": "step"}]},
        {"action": "free_requested", "addr": 0x2000, "size": 2 * mib, "stream": 0, "time_us": 4, "frames": []},
        {"action": "free_completed", "addr": 0x2000, "size": 2 * mib, "stream": 0, "time_us": 5, "frames": []},
    ]
    blocks = [{"size": mib, "state": "active_allocated"}, {"size": 4 * mib, "state": "active_allocated"},
              {"size": 2 * mib, "state": "inactive"}, {"size": mib, "state": "active_allocated"}]
    snap = {"segments": [{"device": 0, "address": 0x0, "total_size": 8 * mib, "stream": 0, "segment_type": "large",
                          "allocated_size": 6 * mib, "active_size": 6 * mib, "blocks": blocks}],
            "device_traces": [trace], "allocator_settings": {}}
    return snap, 8 * mib, _nodes_at(lines, at[0])


def test_import_accepts_memory_snapshots(imported, data, tmp_path):
    """``graphdeck import`` takes snapshot pickles beside the logs (NOTE: [Snapshot import]): the
    H200's real one and one made here on the CPU; each is replayed, attributed to the run's
    nodes through its output code, and kept as a ``graphdeck_memory_snapshot`` record."""
    store, _ = imported
    engine = open_engine(store)
    with Session(engine) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "gpt2"))
    snap, peak, nodes = _cpu_made_snapshot(output_code_files(engine, run_id))
    made = tmp_path / "rank3_cpu_made.pickle"
    made.write_bytes(pickle.dumps(snap))
    assert is_snapshot(made) and is_snapshot(data / "snapshot.pickle.gz")
    fr = tmp_path / "fr.pickle"
    fr.write_bytes(pickle.dumps({"version": "2.4", "pg_config": {}, "entries": []}))
    assert not is_snapshot(fr) and not is_snapshot(data / "info.json")
    res = CliRunner().invoke(cli, ["import", str(made), str(data / "snapshot.pickle.gz"), "--store", str(store),
                                   "--run", "gpt2"])
    assert res.exit_code == 0, res.output
    assert "CUDA memory snapshot rank3_cpu_made.pickle: measured peak 8.0 MiB, 2 of 3 allocations" in res.output
    assert "snapshot.pickle.gz: measured peak 4,025.9 MiB, 810 of 816 allocations on graph nodes" in res.output
    con = sqlite3.connect(store)
    rows = con.execute("SELECT rank, payload FROM compile_events WHERE name = 'graphdeck_memory_snapshot' "
                       "ORDER BY id").fetchall()
    con.close()
    (rank, mine), (_, real) = [(r, json.loads(p)) for r, p in rows[-2:]]
    assert rank == 3 and mine["peak_bytes"] == peak and mine["baseline_bytes"] == 2 ** 20
    top = mine["at_peak"][0]
    assert top["bytes"] == 4 * 2 ** 20 and top["category"] == "graph" and top["nodes"] == nodes and nodes
    assert mine["by_category_bytes"]["eager"] == 2 ** 20
    assert real["peak_bytes"] == measure(load_snapshot(data / "snapshot.pickle.gz"),
                                         output_code_files(engine, run_id)).peak_bytes
    # a snapshot alone makes its run; a broken one is a usage error (exit 2) naming the file
    res = CliRunner().invoke(cli, ["import", str(made), "--store", str(tmp_path / "new.db"), "--run", "solo"])
    assert res.exit_code == 0 and "2 of 3" not in res.output and "0 of 3 allocations" in res.output, res.output
    bad = tmp_path / "cut.pickle"
    bad.write_bytes(made.read_bytes()[:200])
    res = CliRunner().invoke(cli, ["import", str(bad), "--store", str(tmp_path / "new.db"), "--run", "solo"])
    assert res.exit_code == 2 and "cut.pickle" in res.output, res.output


def test_inductor_code_gives_the_step_peak_within_10_percent(imported, data):
    """The graph-derived peak from the run's Inductor code (NOTE: [Inductor buffer model]) plus
    AdamW's state (two fp32 copies of the parameters: no graph holds it) is within 10% of the
    H200's measured ``max_memory_allocated`` (the ATen-graph model was 6.4% below only because
    it left out the loss graph's activations while over-counting the model's)."""
    from graphdeck.analysis.memory.inductor import inductor_step_memory

    info = json.loads((data / "info.json").read_text())
    engine = open_engine(imported[0])
    with Session(engine) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "gpt2"))
    plain = inductor_step_memory(engine, run_id)
    params = plain.parameter_bytes
    assert abs(params / 2 ** 20 - 312.47) < 0.01  # 81.9 M fp32 parameters
    step = inductor_step_memory(engine, run_id, extra_bytes=2 * params)
    assert [(c["graph_id"], c["backward"]) for c in step.calls] == [(9, False), (18, False), (19, True), (20, True)]
    assert all(c["unknown"] == 0 for c in step.calls) and sum(c["reuses"] for c in step.calls) > 150
    # parameters + gradients + AdamW state stay (to 32 KiB: the returned gradients' extents,
    # not investigated further)
    assert abs(step.calls[-1]["after_bytes"] - 4 * params) <= 32 * 1024
    assert step.peak_call == 3  # the model's backward, as the snapshot says
    assert abs(step.peak_bytes / info["max_memory_allocated_bytes"] - 1) < 0.10


def test_what_ifs_checked_against_the_changed_runs_snapshots(tmp_path):
    """The checkpoint and dtype what-ifs of the H200 GPT-2 run (bench/bench_gpu_whatif.py,
    whatif.json) beside real snapshots of the changed runs: the estimates recomputed here from the
    kept store and the peaks replayed from the kept snapshots are the ones the bench reported, and
    the checkpoint and dtype estimates are within 10% and 5% of the changed runs' measured steps."""
    need = ["whatif.json", "whatif.db.gz"] + [f"whatif_{w}.snapshot.pickle.gz" for w in ("base", "ckpt", "fp32")]
    missing = [f for f in need if not (DATA / f).exists()]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"corpus files missing: {missing}")
        pytest.skip(f"corpus files missing: {missing}")
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_whatif", Path(__file__).resolve().parents[1] / "bench"
                                                  / "bench_gpu_whatif.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    want = json.loads((DATA / "whatif.json").read_text())
    store = tmp_path / "whatif.db"
    with gzip.open(DATA / "whatif.db.gz", "rb") as fin, open(store, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    got = bench.derived(store, argparse.Namespace(ckpt_path=want["args"]["ckpt_path"]))
    # The dtype what-if drops autocast's cast copies since the bench ran (NOTE: [Casts in a dtype
    # what-if]): +14.8% then, within 5% of the fp32 run's snapshot now; the rest is as reported.
    assert {k: v for k, v in got.items() if not k.startswith("fp32_estimate")} == \
        {k: v for k, v in want["derived"].items() if not k.startswith("fp32_estimate")}
    assert want["derived"]["fp32_estimate_bytes"] / want["compare"]["fp32"]["measured"] > 1.14
    assert abs(got["fp32_estimate_bytes"] / want["compare"]["fp32"]["measured"] - 1) < 0.05
    for way in ("base", "ckpt", "fp32"):
        m = measure(load_snapshot(DATA / f"whatif_{way}.snapshot.pickle.gz"), {}, device=0)
        assert m.peak_bytes - m.baseline_bytes == want["measured"][way]["snapshot_peak_above_start_bytes"]
        assert abs(m.peak_bytes - m.baseline_bytes - want["measured"][way]["max_allocated_above_start_bytes"]) \
            < 0.01 * want["measured"][way]["max_allocated_above_start_bytes"]
    ck = want["compare"]["ckpt"]
    assert abs(ck["estimate"] / ck["measured"] - 1) < 0.10
