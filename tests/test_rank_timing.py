"""Rank timing on a real 2-rank gloo job (tests/programs/skew_cases.py, ranks started as torchrun would, one job for
both cases): a DDP straggler seen through the CPU-side collectives of the Kineto traces
(``gloo:all_reduce``), and a warm-vs-cold Inductor cache compile skew — through the analyses,
``graphdeck check-ranks`` and the trace overlap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.compile_skew import DEFAULT_TIMEOUT_S, compile_skew
from graphdeck.analysis.ranks.cpu_collectives import cpu_collective_events, normalise_kind, rank_timing
from graphdeck.analysis.traces.analyze import TraceData, overlap
from graphdeck.analysis.traces.collectives import align_and_match, run_traces
from graphdeck.errors import NotFoundError
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from tests.conftest import REPO, LiveServer
from tests.launch import run_ranks

PROGRAM = REPO / "tests" / "programs" / "skew_cases.py"
sys.path.insert(0, str(PROGRAM.parent))
import skew_cases  # noqa: E402  (SLOW_S, TIMEOUT_S: what the job does; importing it runs nothing)

sys.path.remove(str(PROGRAM.parent))


@pytest.fixture(scope="module")
def timing_store(tmp_path_factory) -> Path:
    """Prewarm rank 0's Inductor cache in one process while the job's first case runs, then the
    job's second case (cold cache on rank 1)."""
    root = tmp_path_factory.mktemp("timing")
    store, warm, cold = root / "timing.db", root / "warm", root / "cold"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    # niced (its compiler too), so that it takes spare CPU from the straggler case, not the ranks' time
    pre = subprocess.Popen([sys.executable, str(PROGRAM), "prewarm", str(warm), str(root / "prewarm.db")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           preexec_fn=lambda: os.nice(15))
    try:
        proc = run_ranks([PROGRAM, "job", store, warm, cold, str(warm) + ".done"], 2, env=env, timeout=400)
    finally:
        out = pre.communicate(timeout=400)[0]
    assert pre.returncode == 0, f"prewarm failed:\n{out[-4000:]}"
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return store


def _run(s: Session, name: str) -> Run:
    return s.scalar(select(Run).where(Run.name == name))


def _cli(store: Path, run: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(store), "--run", run, *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_gloo_ddp_straggler_is_the_slowed_rank_and_the_other_waits_in_all_reduce(timing_store):
    with Session(open_engine(timing_store, read_only=True)) as s:
        run = _run(s, "gloo_straggler")
        res = align_and_match(s, run.id)
        reduces = [c for c in res["collectives"] if c["kind"] == "all_reduce"]
        assert len(res["collectives"]) == 3  # nothing else in the window (DDP rebuilt its buckets at step 1)
        # DDP's one bucket, one all-reduce per profiled step (3), run on gloo's worker threads.
        assert len(reduces) == 3 and all(c["suspect"] is None for c in reduces)
        assert all(v["kernel"] == "gloo:all_reduce" for c in reduces for v in c["ranks"].values())
        assert sorted(c["step"] for c in reduces) == [2, 3, 4]
        assert all(c["last_rank"] == 1 for c in reduces)
        for c in reduces:  # rank 0 waits out rank 1's sleep inside the all-reduce; rank 1 does not wait
            assert c["ranks"][0]["wait_ns"] >= 0.7 * skew_cases.SLOW_S * 1e9, c
            assert c["ranks"][1]["wait_ns"] == 0
        assert [(x["step"], x["straggler"]) for x in res["stragglers"]] == [(2, 1), (3, 1), (4, 1)]
        assert res["unmatched"] == {0: 0, 1: 0}

        timing = rank_timing(res)
        # align_and_match carries it (the API's aligned view), with the matching's verdict beside it
        assert {k: v for k, v in res["timing"].items() if k in timing} == timing
        assert (res["timing"]["verdict"], res["timing"]["divergent"], res["timing"]["missing_ranks"]) == ("OK", [], [])
        assert timing["straggler"] == 1
        r0, r1 = timing["ranks"][0], timing["ranks"][1]
        assert r0["wait_by_op_ns"]["gloo:all_reduce"] >= 3 * 0.7 * skew_cases.SLOW_S * 1e9
        assert r0["wait_ns"] > 0.5 * r0["step_ns"] and r1["wait_ns"] == 0
        assert r1["compute_ns"] > 3 * skew_cases.SLOW_S * 1e9  # its sleep is on its own time, not in a collective
        msg = timing["message"]
        assert msg.startswith("straggler: rank 1 arrived last") and "rank 0 waited" in msg
        assert "inside gloo:all_reduce (3x)" in msg

        tid = run_traces(s, run.id)[0]
        data = TraceData(s, tid)
        # Without gloo's worker ranges (another CPU backend, an older profiler) the dispatcher
        # calls stand in: DDP's c10d::allreduce_, one per step; never beside communication kernels.
        calls = [e for e in data.events if not e.name.startswith("gloo:")]
        assert [(src, kind) for _e, src, kind in cpu_collective_events(calls)] == [("c10d", "all_reduce")] * 3
        assert cpu_collective_events(calls, has_comm_kernels=True) == []
        ov = overlap(data)
        assert ov["trace"]["reason"] == "no communication kernels"  # no GPU: the kernel view is empty
        cpu = ov["cpu"]
        assert cpu["trace"]["comm_ops"] == 3 and cpu["trace"]["comm_busy_ns"] >= 3 * 0.7 * skew_cases.SLOW_S * 1e9
        assert 0 <= cpu["trace"]["overlap_ns"] <= cpu["trace"]["comm_busy_ns"]
        assert [x["step"] for x in cpu["steps"]] == [2, 3, 4]

    text = _cli(timing_store, "gloo_straggler")
    assert "note: straggler: rank 1" in text.stdout, text.stdout + text.stderr
    body = json.loads(_cli(timing_store, "gloo_straggler", "--format", "json").stdout)
    assert any(n.startswith("straggler: rank 1") for n in body["notes"])


@pytest.mark.slow
def test_warm_vs_cold_cache_compile_skew_names_both_times_and_the_timeout(timing_store):
    with Session(open_engine(timing_store, read_only=True)) as s:
        skew = compile_skew(s, _run(s, "cache_skew"))
    warm, cold = skew.ranks[0], skew.ranks[1]
    # Rank 0's forward and backward come from its warm FX graph and AOTAutograd caches; rank 1
    # compiles both (the backward lazily, at the first backward: bwd_compilation_metrics).
    assert warm.cache["inductor_fx_graph"] == {"hit": 2, "miss": 0}
    assert warm.cache["aot_autograd"]["hit"] >= 1 and warm.cache["aot_autograd"]["miss"] == 0
    assert cold.cache["inductor_fx_graph"] == {"hit": 0, "miss": 2}
    assert cold.cache["aot_autograd"] == {"hit": 0, "miss": 1}
    assert cold.records == 2 and warm.records == 1 and warm.recompiles == cold.recompiles == 0
    assert (skew.slowest, skew.fastest) == (1, 0)
    assert cold.before_first_collective_s > warm.before_first_collective_s + 2
    assert skew.skew_s == pytest.approx(cold.before_first_collective_s - warm.before_first_collective_s)
    # The trace shows the wait: rank 0's first all-reduce lasts about as long as the skew.
    assert warm.basis == cold.basis == "trace"
    assert "gloo:all_reduce #0" in warm.first_collective
    assert warm.first_collective_wait_s == pytest.approx(skew.skew_s, rel=0.35)
    # The timeout the job set (init_process_group(timeout=...)), as the capture recorded it.
    assert skew.timeout_s == skew_cases.TIMEOUT_S and "recorded" in skew.timeout_source
    f = skew.finding
    assert f.startswith("compile skew: rank 1 compiled")
    assert f"{cold.before_first_collective_s:.1f} s" in f and f"{warm.before_first_collective_s:.1f} s" in f
    assert "FX graph cache 0 hit(s) / 2 miss(es)" in f and "FX graph cache 2 hit(s) / 0 miss(es)" in f
    assert f"{skew_cases.TIMEOUT_S} s collective timeout" in f and "rank 0 waited" in f
    text = _cli(timing_store, "cache_skew")
    assert "note: compile skew: rank 1" in text.stdout, text.stdout + text.stderr
    import httpx

    with LiveServer(timing_store) as srv:  # the run page's rank-consistency view shows the notes
        body = httpx.get(f"{srv.url}/api/runs/cache_skew/rank-consistency").json()
        assert any(n.startswith("compile skew: rank 1") for n in body["notes"]), body["notes"]

    with Session(open_engine(timing_store, read_only=True)) as s:  # DDP job of tiny aot_eager compiles: no skew
        assert compile_skew(s, _run(s, "gloo_straggler")).finding is None
        with pytest.raises(ValueError, match="ratio"):
            compile_skew(s, _run(s, "cache_skew"), ratio=0.5)
        with pytest.raises(NotFoundError, match="no such run"):
            compile_skew(s, _run(s, "no-such-run"))


def test_helpers():
    assert [normalise_kind(k) for k in ("allreduce_", "allgather_", "_reduce_scatter_base_", "barrier")] == \
        ["all_reduce", "all_gather", "reduce_scatter_tensor", "barrier"]
    assert DEFAULT_TIMEOUT_S["nccl"] == 600.0 and DEFAULT_TIMEOUT_S[None] == 1800.0
    with pytest.raises(ValueError, match="align_and_match"):
        rank_timing({"ranks": {}})
