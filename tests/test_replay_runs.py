"""``graphdeck replay`` is a run of its own (issue 36 item 1; NOTE: [Replay runs] in replay/runs.py).

Input: the main job's training code (``graphdeck.demo``: GPT-2, DDP with ``bucket_cap_mb=1``,
torch.compile through the capture agent, profiled steps) on 2 gloo ranks under torchrun, ``aot_eager``
and 1 block. Every view of the captured run is recorded (check-ranks, summary, export-trace, the
aligned run timeline and its collectives, the time overlay, node times, the notebook's
``run.trace(rank)``), then docs/executor.md's two replays run through the real CLI, then every view is
recorded again and must be the same; the replays' traces are reachable from the run (API and page).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Run, Trace
from tests.conftest import LiveServer

RUN = "demo"
#: Keys whose values say how or when a document was computed, not what it says.
VOLATILE = {"elapsed_s", "cache", "over_budget", "budget_s", "budgets_s", "computed_at", "took_s"}


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> Path:
    """2 gloo ranks of the demo's training code, aot_eager, 1 GPT-2 block, 4 steps (2 profiled)."""
    store = tmp_path_factory.mktemp("replay_demo") / "demo.db"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "graphdeck.demo", "--store", str(store), "--run-name", RUN, "--backend", "aot_eager",
           "--steps", "4", "--layers", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", KINETO_LOG_LEVEL="6")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return store


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, KINETO_LOG_LEVEL="6"))


def strip(doc):
    """``doc`` without the keys that say how or when it was computed (VOLATILE)."""
    if isinstance(doc, dict):
        return {k: strip(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [strip(v) for v in doc]
    return doc


def views(store: Path, tmp: Path, tag: str) -> dict:
    """Everything a user sees of run ``demo``: the CLI's check-ranks, summary and export-trace, the
    API's run, summary, timeline, collectives, per-trace analysis, time overlay and node times, and
    the notebook's newest trace per rank."""
    import graphdeck

    out: dict = {}
    for name, args in (("check-ranks", ["check-ranks", str(store), "--run", RUN, "--json"]),
                       ("summary", ["summary", RUN, "--store", str(store), "--json"])):
        proc = cli(*args)
        out[name] = (proc.returncode, strip(json.loads(proc.stdout)))
    text = cli("check-ranks", str(store), "--run", RUN)
    out["check-ranks text"] = (text.returncode, text.stdout)
    exported = tmp / f"{tag}.trace.json"
    proc = cli("export-trace", str(store), "--run", RUN, "-o", str(exported))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out["export-trace line"] = proc.stdout.split(" (")[0].replace(str(exported), "FILE")
    out["export-trace"] = strip(json.loads(exported.read_text()))
    with Session(open_engine(store, read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == RUN))
        graphs = s.scalars(select(Graph.id).where(Graph.run_id == run_id, Graph.kind.in_(("aot_forward", "dynamo")))
                           .order_by(Graph.id)).all()
        traces = s.scalars(select(Trace.id).where(Trace.run_id == run_id)).all()
    with LiveServer(store) as srv:
        get = lambda path: strip(httpx.get(srv.url + path, timeout=300).raise_for_status().json())  # noqa: E731
        run = get(f"/api/runs/{run_id}")
        run.pop("replays", None)  # the one key that lists the replays, by design
        out["run"] = run
        out["summary api"] = get(f"/api/runs/{run_id}/summary")
        out["timeline"] = get(f"/api/runs/{run_id}/timeline")
        out["collectives"] = get(f"/api/runs/{run_id}/collectives")
        for t in traces:
            out[f"analysis {t}"] = get(f"/api/traces/{t}/analysis")
        for g in graphs:
            out[f"time overlay {g}"] = get(f"/api/graphs/{g}/overlays/time")
            out[f"node times {g}"] = get(f"/api/graphs/{g}/node-times")
    nb = graphdeck.open(str(store)).run(RUN)
    out["notebook"] = {r: nb.trace(r).id for r in (0, 1)}
    return out


@pytest.mark.slow
def test_replay_changes_nothing_the_source_run_shows_and_its_traces_are_reachable(demo_store, tmp_path):
    store = tmp_path / "demo.db"
    with sqlite3.connect(demo_store) as a, sqlite3.connect(store) as b:
        a.backup(b)
    before = views(store, tmp_path, "before")
    assert before["check-ranks"][1]["verdict"] == "OK" and "diverged" not in before["check-ranks text"][1]
    assert "2 collectives linked" in before["export-trace line"] or "collectives linked" in before["export-trace line"]
    with Session(open_engine(store, read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == RUN))
        gid = s.scalar(select(Graph.id).where(Graph.run_id == run_id, Graph.rank == 1, Graph.kind == "aot_forward")
                       .order_by(Graph.id))
    # docs/executor.md: one profiled worker, then a pipeline of two (auto: measured node times).
    one = cli("replay", RUN, str(gid), "--store", str(store), "--json")
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    one = json.loads(one.stdout)
    two = cli("replay", RUN, str(gid), "--store", str(store), "--workers", "2", "--strategy", "auto",
              "--microbatches", "2", "--json")
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    two = json.loads(two.stdout)

    after = views(store, tmp_path, "after")
    changed = [key for key in before if after.get(key) != before[key]]
    assert changed == [] and set(after) == set(before), f"changed after `graphdeck replay`: {changed}"

    # The replays are runs of their own, linked to the source, and their results are reachable.
    assert one["run"] != RUN and two["run"] not in (RUN, one["run"])
    ex_trace = one["executor"]["trace_id"]
    assert "executor" not in two and len(two["pipeline"]["trace_ids"]) == 2, "auto found the first replay's times"
    assert two["plan"]["time_source"] == ex_trace, "auto balances with the first replay's measured node times"
    with LiveServer(store) as srv:
        run = httpx.get(f"{srv.url}/api/runs/{run_id}", timeout=60).json()
        replays = {r["name"]: r for r in run["replays"]}
        assert set(replays) == {one["run"], two["run"]}
        assert [t["id"] for t in replays[one["run"]]["traces"]] == [ex_trace]
        assert {t["id"]: t["rank"] for t in replays[two["run"]]["traces"]} == dict(
            zip(two["pipeline"]["trace_ids"], (0, 1))), "a pipeline worker's trace is its worker rank"
        assert all(r["graph_id"] == gid for r in replays.values())
        child = httpx.get(f"{srv.url}/api/runs/{replays[one['run']]['id']}", timeout=60).json()
        assert child["source_run"] == {"id": run_id, "name": RUN, "graph_id": gid}
        assert [t["id"] for t in child["traces"]] == [ex_trace] and child["num_graphs"] == 0
        listed = {r["name"]: r["source_run"] for r in httpx.get(f"{srv.url}/api/runs", timeout=60).json()}
        assert listed[RUN] is None and listed[one["run"]]["id"] == run_id
        ex = httpx.get(f"{srv.url}/api/graphs/{gid}/executor", timeout=120).json()
        assert [t["id"] for t in ex["traces"]] == [ex_trace, *two["pipeline"]["trace_ids"]]
        assert ex["trace_id"] == ex_trace and len(ex["overlay"]["values"]) > 10
        frames = httpx.get(f"{srv.url}/api/traces/{ex_trace}/replay", timeout=120)
        assert frames.status_code == 200, frames.text
    # A third replay compares with the first (the newest earlier replay of the graph).
    again = cli("replay", RUN, str(gid), "--store", str(store), "--json")
    assert json.loads(again.stdout)["executor"]["recorded_trace_id"] == ex_trace, again.stdout[-2000:]

    # Deleting the source run deletes its replays (they time its graphs); nothing else is left.
    deleted = cli("delete-run", str(store), "--run", RUN)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    with Session(open_engine(store, read_only=True)) as s:
        assert s.scalars(select(Run.name)).all() == [] and s.scalars(select(Trace.id)).all() == []
    shutil.rmtree(tmp_path, ignore_errors=True)
