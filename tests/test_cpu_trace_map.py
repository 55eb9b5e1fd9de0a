"""CPU traces on graph nodes (issue 23 item 1; NOTE: [CPU trace mapping] in analysis/traces/cpu_mapping.py).

Inputs are real jobs: the main job's training code (``graphdeck.demo``: GPT-2, DDP with
``bucket_cap_mb=1``, torch.compile through the capture agent, ``Agent.profile``) on 2 gloo ranks
(started as torchrun would: tests/launch.py), ``aot_eager``, 1 block (the cheapest job with DDP buckets and both ranks),
served by the real app over HTTP; one small Inductor model compiled with g++ (slow); the replay
page in Chromium.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.cpu_mapping import OVERHEAD_KINDS, WRAPPER_OP_HOW
from graphdeck.analysis.traces.mapping import map_trace
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Run, Trace
from tests.conftest import LiveServer
from tests.launch import run_python_job, run_ranks

RUN = "cpu"


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> Path:
    """2 gloo ranks of the demo's training code, aot_eager, 1 GPT-2 block (the demo's batch and
    sequence: with tinier tensors Python dispatch dominates and a busy host's preemptions move the
    wall-time share by several points), 3 steps (1 profiled) — on a loaded host: two busy-loop
    processes run beside the job the whole time (a 2-core machine: both cores busy), so every
    assertion on this run holds under load (issue 34 item 3)."""
    store = tmp_path_factory.mktemp("cpu_demo") / "demo.db"
    argv = ["-m", "graphdeck.demo", "--store", store, "--run-name", RUN, "--backend", "aot_eager",
            "--steps", "3", "--layers", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", KINETO_LOG_LEVEL="6")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        proc = run_ranks(argv, 2, env=env, timeout=900)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return store


@pytest.fixture(scope="module")
def server(demo_store):
    with LiveServer(demo_store) as srv:
        yield srv


def _traces(store: Path) -> dict[int, int]:
    with Session(open_engine(store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == RUN))
        return dict(s.execute(select(Trace.rank, Trace.id).where(Trace.run_id == run.id)).all())


@pytest.mark.slow
def test_each_ranks_compiled_region_cpu_time_maps_to_nodes_forward_and_backward(demo_store):
    traces = _traces(demo_store)
    assert sorted(traces) == [0, 1]
    with Session(open_engine(demo_store, read_only=True)) as s:
        for rank, tid in traces.items():
            m = map_trace(s, tid)
            assert m.device == "cpu", "no GPU kernel: the CPU ops of compiled regions are the units"
            assert m.kernel_ns == m.region_ns > 0
            # The must-show: >= 90% of each rank's compiled-region time (the ranges' wall time) on
            # nodes, forward and backward. The ops' own time is >= 95% of the ops'; the time around
            # them (dispatch, wrapper code, the runtime wrapper's epilogue and, on a loaded host,
            # descheduling) is given to nodes as labelled overhead (NOTE: [Overhead]).
            assert m.mapped_fraction >= 0.9, (rank, m.mapped_fraction, list(m.unmapped.items())[:5])
            assert set(m.directions) == {"forward", "backward"}
            for d, x in m.directions.items():
                assert x["mapped_ns"] >= 0.9 * x["region_ns"], (rank, d, x)
                assert x["mapped_units_ns"] >= 0.95 * x["units_ns"], (rank, d, x)
                assert x["mapped_ns"] == x["mapped_units_ns"] + sum(x.get(f"{k}_ns", 0) for k in OVERHEAD_KINDS)
                assert x["mapped_ns"] <= x["region_ns"], "nothing is counted twice"
            kinds_ns = sum(x.get(f"{k}_ns", 0) for x in m.directions.values() for k in (*OVERHEAD_KINDS, "wrapper_ops"))
            assert sum(m.overhead_ns.values()) == kinds_ns > 0, "overhead is labelled apart, never hidden in ops"
            assert all(0 < ns <= m.node_ns[key] for key, ns in m.overhead_ns.items())
            wrapper_ops = [u for u in m.cpu_units if m.how.get(u.ev.id) == WRAPPER_OP_HOW]
            assert wrapper_ops and {u.name for u in wrapper_ops} <= {"aten::detach", "aten::_unsafe_view"}
            assert all(u.direction == "forward" and m.by_kernel[u.ev.id][1] == ["output"] for u in wrapper_ops), \
                "AOT's runtime wrapper ops after the forward graph go to its output node"
            assert sum(m.node_ns.values()) == m.mapped_ns, "node times add up to the mapped time"
            kinds = {s.get(Graph, g).kind for g, _ in m.node_ns}
            assert kinds == {"aot_forward", "aot_backward"}, kinds
            graphs = {g for g, _ in m.node_ns}
            assert all(s.get(Graph, g).rank == rank for g in graphs), "a rank's ops map to its own graphs"
            assert len({g for g in graphs if s.get(Graph, g).kind == "aot_forward"}) >= 2, \
                "DDPOptimizer's buckets: each CompiledFunction of a region maps to its own bucket's graph"
            assert set(m.how.values()) <= {"aot_eager name+order", "aot_eager order", WRAPPER_OP_HOW,
                                           "materialized zero gradient -> tangent of the same shape"}
            assert list(m.how.values()).count("aot_eager name+order") >= 0.9 * len(m.how)


@pytest.mark.slow
def test_summary_of_the_demo_run_on_a_loaded_host_exits_0(demo_store):
    """The demo's run, made while two busy loops kept both cores busy: ``graphdeck summary`` exits 0,
    trace coverage PASS, its headline saying what the share covers and naming what is not counted
    (NOTE: [Trace coverage])."""
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "summary", RUN, "--store", str(demo_store)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.split()[1:2] == ["traces"])
    assert line.startswith("PASS"), line
    assert "of the ops' own CPU time in compiled regions mapped to graph nodes" in line, line
    assert "not counted" in line and "eager optimizer step" in line, line


@pytest.mark.slow
def test_time_overlay_and_analysis_over_http(demo_store, server):
    tid = _traces(demo_store)[0]
    with Session(open_engine(demo_store, read_only=True)) as s:
        fwd = s.scalars(select(Graph.id).join(Trace, Trace.run_id == Graph.run_id).where(
            Trace.id == tid, Graph.rank == 0, Graph.kind == "aot_forward").order_by(Graph.id)).first()
    ov = httpx.get(f"{server.url}/api/graphs/{fwd}/overlays/time", timeout=60).json()
    assert ov["unit"] == "ns" and len(ov["values"]) >= 10 and all(v > 0 for v in ov["values"].values()), ov
    with Session(open_engine(demo_store, read_only=True)) as s:
        run_id = s.scalar(select(Trace.run_id).where(Trace.id == tid))
        dyn = s.scalar(select(Graph.id).where(Graph.run_id == run_id, Graph.rank == 0, Graph.kind == "dynamo"))
        m = map_trace(s, tid)
        mapped, units = m.mapped_ns, sum(x["mapped_units_ns"] for x in m.directions.values())
    whole = httpx.get(f"{server.url}/api/graphs/{dyn}/overlays/time", timeout=60).json()
    assert len(whole["values"]) >= 20, "the Dynamo graph DDPOptimizer split gets its buckets' AOT times by source line"
    # Much of the ops' own time finds its source line (quiet host: 0.93 of it). Not measured against
    # mapped_ns: that includes the labelled overhead around the ops, which a loaded host's
    # descheduling inflates (CI: 34 ms mapped vs 18 ms quiet, the share fell to 0.599; 0.574 with
    # four jobs beside it). The bound is far below both: a time share on a loaded host moves.
    assert 0.3 * units <= sum(whole["values"].values()) <= mapped, "much of the AOT time finds its source line"
    a = httpx.get(f"{server.url}/api/traces/{tid}/analysis", timeout=120).json()
    assert a["mapping"]["device"] == "cpu" and a["mapping"]["mapped_fraction"] >= 0.9
    cov = a["mapping"]["coverage"]
    assert cov["covers"] == "the ops' own CPU time in compiled regions" and cov["fraction"] >= 0.95, cov
    assert cov["total_ns"] == units + sum(m.unmapped.values()) and cov["overhead_ns"] > 0
    assert all("epilogue_ns" in x and "dispatch_ns" in x for x in a["mapping"]["directions"].values())
    assert a["hotspots"]["gaps"] and all("CPU thread" in g["stream"] for g in a["hotspots"]["gaps"])
    assert a["hotspots"]["gaps"][0]["gap_ns"] >= a["hotspots"]["gaps"][-1]["gap_ns"] > 0
    assert not a["hotspots"]["launch_delays"] and "CPU trace" in a["hotspots"]["launch_delays_reason"]


@pytest.mark.slow
def test_replay_over_http_has_cpu_frames_with_nodes_and_says_how_highlights_matched(demo_store, server):
    tid = _traces(demo_store)[1]
    rp = httpx.get(f"{server.url}/api/traces/{tid}/replay", params={"highlight": "matmul"}, timeout=120).json()
    assert rp["source"] == "cpu" and len(rp["frames"]) >= 50
    with_node = [f for f in rp["frames"] if f["node_idx"] is not None]
    assert len(with_node) >= 0.9 * len(rp["frames"]) and all(f["graph_id"] and f["how"] for f in with_node)
    assert [f["t_ms"] for f in rp["frames"]] == sorted(f["t_ms"] for f in rp["frames"])
    lit = [f for f in rp["frames"] if f["highlight"]]
    assert {f["kernel"] for f in lit} >= {"aten::mm", "aten::addmm"}, {f["kernel"] for f in lit}
    (hl,) = rp["highlights"]
    assert hl["frames"] == len(lit) and "op family 'matmul'" in hl["how"] and "addmm" in hl["how"], hl
    assert not rp["warnings"]
    other = httpx.get(f"{server.url}/api/traces/{tid}/replay", params={"highlight": ["MatMul", "no_such_op"]},
                      timeout=120).json()
    assert sum(f["highlight"] for f in other["frames"]) == len(lit), "MatMul is matmul"
    assert len(other["warnings"]) == 1 and "'no_such_op' matches no op" in other["warnings"][0]
    bad = httpx.get(f"{server.url}/api/traces/{tid}/replay", params={"highlight": "mm("}, timeout=60)
    assert bad.status_code == 400 and "not a regular expression" in bad.text


@pytest.mark.slow
@pytest.mark.browser
def test_replay_page_lights_nodes_frame_by_frame_on_the_cpu_trace(demo_store, server, browser):
    problems: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tid = _traces(demo_store)[0]
    page.goto(f"{server.url}/#/traces/{tid}/replay?step_interval_ms=20&highlight=matmul&highlight=nosuchop")
    page.wait_for_selector("#replay-graph svg g.replay-active", state="attached")
    summary = page.locator("#replay-summary").text_content()
    assert "CPU ops/kernels of compiled regions" in summary and "op family" in summary, summary
    assert "nosuchop" in page.locator(".replay-warning").text_content()
    status, seen = page.locator("#replay-status"), []
    for frame in range(0, 12):
        page.locator("#replay-slider").fill(str(frame))
        page.wait_for_function("(f) => document.getElementById('replay-status').dataset.frame === String(f)", arg=frame)
        want = status.get_attribute("data-node-idx")
        if not want:
            continue
        page.wait_for_function(
            "(idx) => document.querySelector('#replay-graph svg g.replay-active')?.id === 'node-' + idx", arg=want)
        assert page.locator("#replay-graph svg g.replay-active").count() == 1
        assert page.locator("#replay-graph svg g.replay-active").get_attribute("data-name") == \
            page.locator("#replay-node").text_content()
        seen.append(want)
    assert len(set(seen)) >= 8, f"frame by frame, different nodes light up: {seen}"
    # The trace page: gloo's all-reduces (CPU-side collectives) fill the overlap section
    page.goto(f"{server.url}/#/traces/{tid}")
    cpu = page.wait_for_selector("[data-testid=overlap-cpu]").text_content()
    assert "CPU collectives" in cpu and "overlap" in cpu and "%" in cpu, cpu
    assert page.locator("#overlap-cpu-table tbody tr").count() >= 1
    page.close()
    assert not problems, problems


INDUCTOR_SCRIPT = r"""
import sys, torch
from graphdeck.capture import Agent
store = sys.argv[1]
torch.manual_seed(0)
agent = Agent(store=store, run="ind")
class Net(torch.nn.Module):  # user code: its lines are the nodes' stack traces
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        h = self.ln(h)
        return self.fc2(h)

model = agent.watch(Net())
compiled = torch.compile(model, backend=agent.backend("inductor"))
with agent.profile(wait_steps=1, warmup_steps=0, active_steps=3) as prof:  # 3 steps: diff-runs' noise floor
    for step in range(4):
        compiled(torch.randn(8, 16)).square().mean().backward()
        prof.step()
agent.close()
"""


def _run_file(script: Path, store: Path, cache: Path) -> None:
    """Run ``script`` as a file (``python -c`` code has no stack traces for the nodes)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    proc = run_python_job([script, store], env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.mark.slow
def test_inductor_cpp_kernels_map_to_nodes(tmp_path):
    script = tmp_path / "net.py"
    script.write_text(INDUCTOR_SCRIPT)
    store = tmp_path / "ind.db"
    _run_file(script, store, tmp_path / "cache")
    with Session(open_engine(store, read_only=True)) as s:
        (tid,) = s.scalars(select(Trace.id)).all()
        m = map_trace(s, tid)
        assert m.device == "cpu"
        kernels = [u for u in m.cpu_units if u.name.startswith("cpp_")]
        assert kernels and all(u.ev.name.startswith("graph_") for u in kernels), \
            "cpp.enable_kernel_profile was turned on by the agent: C++ kernels are profiler events"
        assert all(u.ev.id in m.by_kernel for u in kernels), [u.ev.name for u in kernels if u.ev.id not in m.by_kernel]
        assert {u.direction for u in kernels} == {"forward", "backward"}
        assert any(u.name in ("aten::mm", "aten::addmm") and u.ev.id in m.by_kernel for u in m.cpu_units), \
            "extern matmul calls map too"
        assert all(h.startswith(("inductor provenance", "materialized zero")) or h == WRAPPER_OP_HOW
                   for h in m.how.values())
        for d, x in m.directions.items():
            assert x["mapped_units_ns"] >= 0.9 * x["units_ns"], (d, x)
            assert x["mapped_ns"] >= 0.9 * x["region_ns"], (d, x)
        kinds = {s.get(Graph, g).kind for g, _ in m.node_ns}
        assert kinds == {"aot_forward", "aot_backward"}
    # The live capture keeps Inductor's wrapper code, whole: a snapshot is attributed through it and
    # the graph-derived step learns Inductor's buffers (NOTE: [Inductor buffer model]).
    from graphdeck.analysis.memory.inductor import inductor_step_memory
    from graphdeck.analysis.memory.measured import output_code_files

    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        run_id = s.scalar(select(Trace.run_id))
    files = output_code_files(engine, run_id)
    assert len(files) >= 2 and all(any("def call(" in x for x in lines) for _, _, lines in files.values()), list(files)
    model = inductor_step_memory(engine, run_id)
    assert model is not None and model.peak_bytes > 0
    # The same job again on the warm FX graph cache: Inductor generates nothing, the backward's
    # node table is empty, and its kernels map through their stack traces (NOTE: [Kernels by stack
    # trace]; the model is user code so that its nodes have stack traces).
    warm = tmp_path / "warm.db"
    _run_file(script, warm, tmp_path / "cache")
    with Session(open_engine(warm, read_only=True)) as s:
        (tid,) = s.scalars(select(Trace.id)).all()
        m = map_trace(s, tid)
        kernels = [u for u in m.cpu_units if u.name.startswith("cpp_")]
        assert kernels and all(u.ev.id in m.by_kernel for u in kernels), \
            [u.ev.name for u in kernels if u.ev.id not in m.by_kernel]
        assert any("by stack trace" in m.how[u.ev.id] for u in kernels if u.direction == "backward")
        # An extern matmul shares its source line with the permutes/views around it: it maps to its
        # own op's nodes, never to a permute (found by a newcomer on the demo's backward)
        mms = [u for u in m.cpu_units if u.name in ("aten::mm", "aten::addmm") and u.ev.id in m.by_kernel]
        assert mms and all(all(re.fullmatch(r"(add)?mm(_\d+)?", n) for n in m.by_kernel[u.ev.id][1]) for u in mms), \
            [(u.name, m.by_kernel[u.ev.id][1]) for u in mms]
        assert {s.get(Graph, g).kind for g, _ in m.node_ns} == {"aot_forward", "aot_backward"}
    # diff-runs times the units this mapping places (issue 36 item 2: it had a CPU mapper of its
    # own that knew only aot_eager, so two Inductor CPU runs had no node times and a
    # --max-node-regression-pct gate always exited 3). Whether a node is slower between the two
    # runs depends on the host; that the gate is decided (0 or 1, not 3) does not.
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "diff-runs", str(store), "ind", "ind",
                           "--store-b", str(warm), "--max-node-regression-pct", "50", "--format", "json"],
                          capture_output=True, text=True, timeout=300)
    rep = json.loads(proc.stdout)
    assert proc.returncode in (0, 1) and rep["verdict"] in ("PASS", "WARN", "FAIL"), proc.stdout[-3000:]
    assert rep["sections"]["timing"]["status"] == "compared", rep["sections"]["timing"]
    row = rep["timing"]["0"]
    assert row["source_a"] == row["source_b"] == "cpu ops of compiled functions", row
    with Session(open_engine(store, read_only=True)) as s:
        mapped = {n for g, n in map_trace(s, s.scalar(select(Trace.id))).node_ns
                  if s.get(Graph, g).kind in ("aot_forward", "aot_backward")}
    timed = {n["a_node"] for n in row["nodes"]}
    assert timed and timed <= mapped, (sorted(timed), sorted(mapped))
    modules = {m["module"] for m in row["modules"]}
    assert {"", "fc1", "ln", "fc2"} <= modules, "every module's nodes are timed (the Linears' extern matmuls too)"
