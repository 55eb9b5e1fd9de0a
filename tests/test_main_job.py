"""The main job for real: GPT-2 (transformers) under DDP + torch.compile on 2 gloo ranks
(started as torchrun would: tests/launch.py), with the capture agent in each rank writing to one SQLite store."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.core import gradient_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Graph, Param, Partition, Rank, Run, Trace
from tests.conftest import DEMO_RUN, run_demo

pytestmark = pytest.mark.slow


def graph_signature(session: Session, run_id: int, rank: int) -> list[tuple]:
    """(ordinal, kind, nodes, structural hash) of every graph of one rank, in capture order."""
    return [tuple(r) for r in session.execute(
        select(Graph.ordinal, Graph.kind, Graph.num_nodes, Graph.structural_hash)
        .where(Graph.run_id == run_id, Graph.rank == rank).order_by(Graph.ordinal))]


def test_two_rank_ddp_gpt2_capture(demo_store):
    """conftest's ``demo_store``: aot_eager, 2 blocks, 4 steps (2 profiled), shared with test_replay_runs."""
    with Session(open_engine(demo_store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == DEMO_RUN))
        assert run.world_size == 2
        ranks = s.scalars(select(Rank).where(Rank.run_id == run.id).order_by(Rank.rank)).all()
        assert [r.rank for r in ranks] == [0, 1] and all(r.backend == "gloo" for r in ranks)
        sigs = [graph_signature(s, run.id, r) for r in (0, 1)]
        assert sigs[0] == sigs[1], "SPMD: both ranks compile the same graphs, node for node"
        kinds = Counter(k for _, k, _, _ in sigs[0])
        assert kinds["aot_forward"] >= 1 and kinds["aot_backward"] >= 1, kinds
        assert kinds["dynamo"] >= 1 and kinds["ddp_partition"] >= 2, \
            f"bucket_cap_mb=1 splits GPT-2 into several DDP buckets: {kinds}"
        assert all(n > 0 for _, _, n, _ in sigs[0])
        split = s.scalars(select(Graph).where(Graph.run_id == run.id, Graph.kind == "ddp_partition")).all()
        assert all(g.break_reason is None and g.parent_id for g in split), \
            "DDPOptimizer's split is not a user graph break; each bucket points at its unsplit graph"
        parts = s.scalars(select(Partition).where(Partition.run_id == run.id, Partition.rank == 0)).all()
        assert len(parts) == kinds["ddp_partition"]
        bucket_params = {p for part in parts for p in json.loads(part.params_json)}
        assert "transformer.h.0.attn.c_attn.weight" in bucket_params, "bucket params are named by FQN"
        names = set(s.scalars(select(Param.fqn).where(Param.run_id == run.id, Param.rank == 1)))
        assert {"transformer.wte.weight", "lm_head.weight", "transformer.h.1.mlp.c_fc.weight"} <= names
        rep = gradient_report(s, run)
        assert rep.ranks == [0, 1] and rep.ok, rep.problems
        assert rep.summary["OK"] == len(rep.params) and len(rep.params) >= 2 * 20
        wte = next(p for p in rep.params if p.fqn == "transformer.wte.weight" and p.rank == 0)
        assert set(wte.aliases) == {"transformer.wte.weight", "lm_head.weight"} and wte.paths == 2, \
            "tied embedding/lm_head: one storage, a gradient from the embedding and from the projection"
        traces = s.execute(select(Trace.rank, Trace.num_events, Trace.status).where(Trace.run_id == run.id)
                           .order_by(Trace.rank)).all()
        assert [t.rank for t in traces] == [0, 1] and all(t.num_events > 100 and t.status == "ok" for t in traces)


def test_inductor_warm_cache_records_the_same_graphs(tmp_path):
    """Second run of the same job hits Inductor's caches, which skip the compile hooks; the
    capture must still record the same graphs."""
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    store = tmp_path / "warm.db"
    run_demo(store, "cold", backend="inductor", steps=2, layers=1, profile=False, env=cache)
    run_demo(store, "warm", backend="inductor", steps=2, layers=1, profile=False, env=cache)
    with Session(open_engine(store, read_only=True)) as s:
        ids = {r.name: r.id for r in s.scalars(select(Run))}
        for rank in (0, 1):
            cold, warm = graph_signature(s, ids["cold"], rank), graph_signature(s, ids["warm"], rank)
            assert cold and cold == warm, f"rank {rank}: warm run recorded {warm}, cold {cold}"
            assert Counter(k for _, k, _, _ in warm)["aot_backward"] >= 1
            # The cold run's graphs came from Inductor's own compile, the warm run's from the
            # shadow trace on a cache hit (NOTE: [Graphs from the inner compile]): the same graphs.
            sources = {n: {json.loads(m).get("aot_source") for m in s.scalars(select(Graph.meta_json).where(
                Graph.run_id == ids[n], Graph.rank == rank, Graph.kind.in_(("dynamo", "ddp_partition"))))} - {None}
                for n in ("cold", "warm")}  # None: a DDP-split graph's unsplit parent
            assert sources["cold"] == {"inner"}, "a cold compile hands its own graphs over, no shadow trace"
            assert sources["warm"] <= {"inner", "shadow"}, sources

        def cache_hits(run_id):
            total = 0
            for (meta,) in s.execute(select(CompileEvent.metadata_json).where(
                    CompileEvent.run_id == run_id, CompileEvent.name == "compilation_metrics")):
                m = json.loads(meta)["compilation_metrics"]
                total += (m.get("inductor_fx_local_cache_hit_count") or 0) + (m.get("aotautograd_local_cache_hit_count") or 0)
            return total

        assert cache_hits(ids["cold"]) == 0, "the first run compiles from scratch"
        assert cache_hits(ids["warm"]) > 0, "the second run is served from the warm caches"
        assert s.scalar(select(func.count()).select_from(Graph).where(Graph.run_id == ids["warm"])) > 0
