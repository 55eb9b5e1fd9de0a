"""``graphdeck replay`` is a run of its own (issue 36 item 1; NOTE: [Replay runs] in store/replay_runs.py).

Input: the main job's training code (``graphdeck.demo``: GPT-2, DDP with ``bucket_cap_mb=1``,
torch.compile through the capture agent, profiled steps) on 2 gloo ranks, ``aot_eager``, 2 blocks,
4 steps (2 profiled): conftest's ``demo_store``, run once per session and shared with test_main_job.
Every view of the captured run is recorded (check-ranks, summary, export-trace, the aligned run
timeline and its collectives, the time overlay, node times, the notebook's ``run.trace(rank)``), then
docs/executor.md's two replays run through the real CLI, then every view is recorded again and must
be the same; the replays' traces are reachable from the run (API and page).
"""

from __future__ import annotations

import json
import os
import re
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
from tests.conftest import DEMO_RUN, LiveServer

RUN = DEMO_RUN
#: Keys whose values say how or when a document was computed, not what it says.
VOLATILE = {"elapsed_s", "cache", "over_budget", "budget_s", "budgets_s", "computed_at", "took_s"}


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


def copy_store(src: Path, dst: Path) -> Path:
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    return dst


@pytest.fixture(scope="module")
def replayed(demo_store, tmp_path_factory) -> dict:
    """A copy of the demo store after docs/executor.md's two replays of rank 1's first AOT forward
    graph, through the real CLI: one profiled worker, then a pipeline of two (``auto``: the
    measured node times). The demo store itself is never replayed."""
    store = copy_store(demo_store, tmp_path_factory.mktemp("replayed") / "demo.db")
    with Session(open_engine(store, read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == RUN))
        gid = s.scalar(select(Graph.id).where(Graph.run_id == run_id, Graph.rank == 1, Graph.kind == "aot_forward")
                       .order_by(Graph.id))
    one = cli("replay", RUN, str(gid), "--store", str(store), "--json")
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    two = cli("replay", RUN, str(gid), "--store", str(store), "--workers", "2", "--strategy", "auto",
              "--microbatches", "2", "--json")
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    return {"store": store, "run_id": run_id, "gid": gid, "one": json.loads(one.stdout), "two": json.loads(two.stdout)}


@pytest.mark.slow
def test_replay_changes_nothing_the_source_run_shows(demo_store, replayed, tmp_path):
    before = views(demo_store, tmp_path, "before")
    assert before["check-ranks"][1]["verdict"] == "OK" and "diverged" not in before["check-ranks text"][1]
    assert re.search(r" [1-9]\d* collectives linked by [1-9]\d* flows$", before["export-trace line"]), before
    after = views(replayed["store"], tmp_path, "after")
    changed = [key for key in before if after.get(key) != before[key]]
    assert changed == [] and set(after) == set(before), f"changed after `graphdeck replay`: {changed}"


@pytest.mark.slow
def test_the_replays_are_runs_of_their_own_reachable_from_the_source(replayed, tmp_path):
    store, run_id, gid, one, two = (replayed[k] for k in ("store", "run_id", "gid", "one", "two"))
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
    # A third replay compares with the first (the newest earlier one-worker replay of the graph).
    store = copy_store(store, tmp_path / "again.db")
    again = cli("replay", RUN, str(gid), "--store", str(store), "--json")
    assert json.loads(again.stdout)["executor"]["recorded_trace_id"] == ex_trace, again.stdout[-2000:]
    # A run an older graphdeck's replay wrote into (its executor trace in the run itself, as
    # execute_graph(run_name=<the run>) still can) gets it moved out by the next replay.
    from graphdeck.replay.executor import execute_graph

    legacy = execute_graph(open_engine(store), gid, iters=1, run_name=RUN).trace_id
    with Session(open_engine(store, read_only=True)) as s:
        assert s.scalar(select(Trace.run_id).where(Trace.id == legacy)) == run_id
    moved = cli("replay", RUN, str(gid), "--store", str(store), "--json")
    assert moved.returncode == 0, moved.stderr[-2000:]
    with Session(open_engine(store, read_only=True)) as s:
        holder = s.get(Run, s.scalar(select(Trace.run_id).where(Trace.id == legacy)))
        assert holder.name == f"{RUN} replay (moved)" and json.loads(holder.meta_json)["replay"]["source_run_id"] == run_id
        assert sorted(s.scalars(select(Trace.rank).where(Trace.run_id == run_id))) == [0, 1], "the run's own traces only"
    # Deleting the source run deletes its replays (they time its graphs); nothing else is left.
    deleted = cli("delete-run", str(store), "--run", RUN)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    with Session(open_engine(store, read_only=True)) as s:
        assert s.scalars(select(Run.name)).all() == [] and s.scalars(select(Trace.id)).all() == []


def _run_page(page, url: str, run_id: int) -> dict:
    """What the run page shows of the run: every check's verdict, headline and reasons, the slowest
    steps and ranks, each rank's trace table."""
    page.goto(f"{url}/#/runs/{run_id}")
    page.wait_for_selector("[data-testid=run-overview][data-state=done]", timeout=120_000)
    items = page.locator("[data-testid=overview-check]")
    shown = {"verdict": page.get_by_test_id("overview-verdict").get_attribute("data-verdict")}
    for i in range(items.count()):
        item = items.nth(i)
        shown[item.get_attribute("data-check")] = (item.get_attribute("data-verdict"),
                                                   item.locator(".ov-headline").inner_text(),
                                                   item.locator(".ov-reasons").all_inner_texts())
    for tid in ("overview-slowest-steps", "overview-slowest-ranks", "overview-straggler"):
        shown[tid] = page.get_by_test_id(tid).all_inner_texts()
    page.get_by_test_id("details-open-all").click()
    for rank in (0, 1):
        shown[f"traces {rank}"] = page.locator(f"#traces-rank-{rank}").all_inner_texts()
    return shown


@pytest.mark.slow
@pytest.mark.browser
def test_run_page_after_a_replay_shows_the_same_and_links_the_replays(demo_store, replayed, browser):
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with LiveServer(demo_store) as srv:
        before = _run_page(page, srv.url, replayed["run_id"])
        assert page.get_by_test_id("replays").count() == 0
    assert before["verdict"] == "PASS" and before["ranks"][0] == "PASS" and before["traces"][0] == "PASS", before
    assert "diverged" not in json.dumps(before)
    with LiveServer(replayed["store"]) as srv:
        after = _run_page(page, srv.url, replayed["run_id"])
        assert after == before, "the run page shows the same after `graphdeck replay`"
        # The replays are listed on the run's page, each trace linked to its replay page.
        rows = page.get_by_test_id("replays-table").locator("tbody tr")
        assert rows.count() == 3, "one trace of the one-worker replay, two of the pipeline"
        assert replayed["one"]["run"] in page.get_by_test_id("replays").inner_text()
        ex_trace = replayed["one"]["executor"]["trace_id"]
        page.locator(f"a[data-testid=replay-trace-link][href='#/traces/{ex_trace}']").click()
        page.wait_for_url(lambda u: u.endswith(f"/traces/{ex_trace}"))
        page.locator("#trace-stats").wait_for(timeout=120_000)
        assert f"executor graph {replayed['gid']}" in page.locator("h1").first.inner_text()
        page.goto(f"{srv.url}/#/runs/{replayed['one']['run'].replace(' ', '%20')}")
        page.get_by_test_id("replay-of").wait_for()
        assert f"Replay of run {RUN}" in page.get_by_test_id("replay-of").inner_text()
    page.close()
    assert not errors, errors
