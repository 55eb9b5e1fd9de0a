"""The live watch (issue 38 item 1; NOTE: [Live watch] in capture/heartbeat.py).

One real 2-rank gloo job (tests/live_hang_job.py: rank 1 sleeps 40 s inside step 2 before the
gradient all-reduce, 15 s collective timeout, 1 s heartbeat, 4 s threshold) runs under
``graphdeck watch``: the agents write the hang report while the job still hangs — before rank 0's
collective timeout fires, by the job's own clock — naming the step, the group, the collective and
the sleeping frame; the watch prints it and exits 1; the job still ends by gloo's timeout (rank 0)
and torchrun's SIGTERM (rank 1), as it would without graphdeck. A healthy in-process run ends the
watch with exit 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "live_hang_job.py"
_LINES = JOB.read_text().splitlines()
SLEEP_LINE = next(i for i, t in enumerate(_LINES, 1) if "# SLEEPING_FRAME" in t)
REDUCE_LINE = next(i for i, t in enumerate(_LINES, 1) if "# GRAD_ALL_REDUCE" in t)


HOSTILE = '<img src=x onerror="window.__pwned=1">'


def _live(store: Path) -> dict | None:
    """The run's live state as the API computes it, read from the store the job writes (None
    until the store and the run exist)."""
    from graphdeck.analysis.ranks.live import live_state
    from graphdeck.store.schema import Run

    try:
        with Session(open_engine(store, read_only=True, create=False)) as s:
            run = s.scalar(select(Run).where(Run.name == "live"))
            return live_state(s, run.id, world_size=run.world_size) if run is not None else None
    except Exception:  # noqa: BLE001 - the store being created by the job right now
        return None


def _get(url: str) -> tuple[dict, str]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as res:
        return json.loads(res.read()), res.headers.get("Cache-Control")


def _dashboard(browser, store: Path, gate: Path, job) -> dict:
    """The run page over the real app while the job runs: what it shows at step 1 (the job held at
    the gate), then — the gate opened, same page, no reload — the live hang report."""
    from tests.conftest import LiveServer

    seen: dict = {}
    with LiveServer(store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/live")
        page.wait_for_selector("[data-testid=live][data-state=running] [data-testid=live-rank][data-rank='1']")
        rows = page.locator("[data-testid=live-rank]")
        seen["before"] = {int(r.get_attribute("data-rank")): {
            "step": r.get_by_test_id("live-step").inner_text(), "age": r.get_by_test_id("live-beat-age").inner_text(),
            "groups": [g.inner_text() for g in r.get_by_test_id("live-group").all()]} for r in rows.all()}
        seen["api_before"], seen["cache"] = _get(f"{srv.url}/api/runs/live/live")
        page.evaluate("window.__samePage = 1")
        gate.write_text("go")
        page.wait_for_selector("[data-testid=live-report]", timeout=120_000)
        seen["job_running"] = job.poll() is None
        seen["same_page"] = page.evaluate("window.__samePage")
        seen["state"] = page.get_by_test_id("live").get_attribute("data-state")
        rep = page.get_by_test_id("live-report")
        seen["step"] = rep.get_by_test_id("live-report-step").inner_text()
        seen["groups"] = [g.inner_text() for g in rep.get_by_test_id("live-report-group").all()]
        seen["ranks"] = [r.inner_text() for r in rep.get_by_test_id("live-report-rank").all()]
        seen["img"] = page.locator("#live img").count()
        seen["pwned"] = page.evaluate("window.__pwned")
        seen["api_hang"], _ = _get(f"{srv.url}/api/runs/live/live")
        page.close()
    return seen


@pytest.fixture(scope="module")
def hung(tmp_path_factory, request):
    """The one job of this module, watched by ``graphdeck watch`` and (with Chromium) by the run
    page over the real app, which it opens while the job is held at step 1."""
    try:
        browser = request.getfixturevalue("browser")
    except pytest.skip.Exception:  # no Chromium here (never under CI=true: the fixture fails there)
        browser = None
    out = tmp_path_factory.mktemp("live")
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECK_HEARTBEAT_S="1", GRAPHDECK_WATCH_THRESHOLD_S="4")
    env.pop("TORCH_FR_BUFFER_SIZE", None)  # the agent turns the recorder on
    store, gate = out / "s.db", out / "go"
    watch = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "watch", str(store), "--run", "live",
                              "--wait-s", "90", "--poll-s", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env=env)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(JOB),
            str(store), str(out / "out"), str(gate)]
    with open(out / "job.out", "w") as o, open(out / "job.err", "w") as e:
        proc = subprocess.Popen(args, stdout=o, stderr=e, text=True, env=env, cwd=REPO)
    seen = None
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:  # both ranks held at the gate, at step 1
            st = _live(store)
            if st and [r["step"] for r in st["ranks"]] == [1, 1]:
                break
            time.sleep(0.5)
        if browser is not None:
            try:
                seen = _dashboard(browser, store, gate, proc)
            except Exception:  # noqa: BLE001 - the page's failure fails the page's tests, not the others
                import traceback

                seen = {"error": traceback.format_exc()}
    finally:
        gate.write_text("go")
        proc.wait(timeout=150)
    job = subprocess.CompletedProcess(args, proc.returncode, (out / "job.out").read_text(), (out / "job.err").read_text())
    w_out, w_err = watch.communicate(timeout=60)
    ranks = {r: json.loads((out / "out" / f"rank{r}.json").read_text()) for r in (0, 1)}
    with Session(open_engine(store, read_only=True)) as s:
        rows = s.execute(select(CompileEvent.rank, CompileEvent.name, CompileEvent.metadata_json, CompileEvent.payload)
                         .where(CompileEvent.name.in_(["graphdeck_hang_report", "graphdeck_heartbeat",
                                                       "graphdeck_stacks", "flight_recorder"]))).all()
        from graphdeck.analysis.ranks.live import live_hang
        from graphdeck.store.schema import Run

        again = live_hang(s, s.scalar(select(Run.id).where(Run.name == "live")))  # after the job, from the store
    return job, (watch.returncode, w_out, w_err), ranks, rows, again, seen


@pytest.mark.slow
def test_hang_report_written_while_the_job_hangs(hung):
    job, _watch, ranks, rows, again, _seen = hung
    reports = [json.loads(p) for _r, n, _m, p in rows if n == "graphdeck_hang_report"]
    assert len(reports) == 1, job.stderr[-3000:]
    rep = reports[0]
    # the job's own clock: issued step 2's all-reduce, then the report, then the collective timeout
    assert ranks[0]["issued"]["2"] < rep["written_at"] < ranks[0]["timeout_at"], (ranks, rep["written_at"])
    assert (rep["timeout_s"], rep["threshold_s"]) == (15, 4), "the process group's timeout, read in the job"
    assert rep["step"] == 2 and {r["step"] for r in rep["ranks"].values()} == {2}
    (g,) = rep["groups"]
    assert (g["desc"], g["op"], g["issued_by"], g["not_issued_by"]) == ("grads", "gloo:all_reduce", [0], [1])
    assert g["seq"] == 9, "the first all-reduce of step 2 (1 barrier on the default group; 4 per step on grads)"
    r0, r1 = rep["ranks"]["0"], rep["ranks"]["1"]
    assert r1["frame"].endswith(f"live_hang_job.py:{SLEEP_LINE} in train_step") and "time.sleep(40)" in r1["source"]
    assert r0["frame"].endswith(f"live_hang_job.py:{REDUCE_LINE} in train_step")
    assert r0["waiting"]["seq"] == 9 and r1["waiting"] is None, "gloo's lagging completed count is no stall"
    assert [(g.group, g.seq, g.op, g.issued_by, g.not_issued_by) for g in again.groups] == \
        [(g["group"], g["seq"], g["op"], g["issued_by"], g["not_issued_by"]) for g in rep["groups"]], \
        "the stored report is what the stored evidence gives (the watch computes the same one itself)"
    text = "\n".join(rep["lines"])
    assert "at step 2" in text and "group 1 (grads): collective #9 gloo:all_reduce" in text and "time.sleep(40)" in text


@pytest.mark.slow
def test_each_rank_dumped_live_and_the_job_ended_by_its_own_timeout(hung):
    job, _watch, ranks, rows, again, _seen = hung
    stall_dumps = {r for r, n, m, _p in rows if n == "flight_recorder" and json.loads(m)["reason"] == "stall"}
    assert stall_dumps == {0, 1}, "each live rank's watcher thread dumped its recorder"
    assert {r for r, n, _m, _p in rows if n == "graphdeck_stacks"} == {0, 1}
    beats = [r for r, n, _m, _p in rows if n == "graphdeck_heartbeat"]
    assert sorted(beats) == [0, 1], "one heartbeat row a rank, updated in place"
    # not stopped by graphdeck: rank 0 waited out the whole 15 s timeout; rank 1 was ended by torchrun
    assert job.returncode != 0 and "Timed out waiting 15000ms" in ranks[0]["error"]
    assert ranks[0]["timeout_at"] - ranks[0]["issued"]["2"] >= 15
    assert "timeout_at" not in ranks[1] and "exitcode  : -15" in job.stderr


@pytest.mark.slow
def test_watch_prints_the_report_and_exits_1(hung):
    _job, (rc, out, err), _ranks, _rows, _again, _seen = hung
    assert rc == 1, (out[-2000:], err[-2000:])
    assert "HANG (live: the job is still running) at step 2" in out
    assert f"live_hang_job.py:{SLEEP_LINE} in train_step: time.sleep(40)" in out
    assert "rank 0: step" in out, "progress per rank before the hang"


@pytest.mark.slow
@pytest.mark.browser
def test_run_page_shows_the_live_state_then_the_hang_report_without_a_reload(hung):
    job, _watch, ranks, rows, _again, seen = hung
    if seen is None:
        pytest.skip("no Chromium: the run page was not watched")
    assert "error" not in seen, seen.get("error")
    # held at the gate: each rank's step, its groups' last enqueued / completed, its heartbeat's age
    assert sorted(seen["before"]) == [0, 1]
    for r, row in seen["before"].items():
        assert row["step"] == "1", (r, row)
        assert re.fullmatch(r"\d+\.\d s", row["age"]), row
        grads = [g for g in row["groups"] if g.startswith("group 1 (grads)")]
        assert grads and re.search(r"enqueued #\d+, completed #\d+", grads[0]), row["groups"]
    # then, the gate opened, on the same page (no reload): the report the agents stored, while the job still ran
    assert seen["same_page"] == 1 and seen["state"] == "hang"
    assert seen["job_running"], "the page showed the report while the job was still hanging"
    (report,) = [json.loads(p) for _r, n, _m, p in rows if n == "graphdeck_hang_report"]
    # the page says what graphdeck watch printed (the report's lines), line for line
    assert seen["step"] == report["lines"][0] == "HANG (live: the job is still running) at step 2 (threshold 4 s of a " \
        "15 s collective timeout)"
    assert seen["groups"] == [ln.strip() for ln in report["lines"][1:2]] and seen["groups"][0].startswith(
        "group 1 (grads): collective #9 gloo:all_reduce [[8, 8]] issued by ranks [0], not by ranks [1]")
    assert seen["ranks"] == [ln.strip() for ln in report["lines"][2:]]
    text0, text1 = seen["ranks"]
    assert text1.endswith(f"{report['ranks']['1']['frame']}: time.sleep(40)  # SLEEPING_FRAME {HOSTILE}"), \
        "the sleeping frame with the job's source line, as text"
    assert report["ranks"]["1"]["frame"].endswith(f"live_hang_job.py:{SLEEP_LINE} in train_step")
    assert f"live_hang_job.py:{REDUCE_LINE} in train_step: dist.all_reduce(p.grad, group=group)" in text0
    assert seen["img"] == 0 and seen["pwned"] is None, "user strings are text, never markup"


@pytest.mark.slow
@pytest.mark.browser
def test_live_api_over_http(hung):
    _job, _watch, _ranks, rows, _again, seen = hung
    if seen is None:
        pytest.skip("no Chromium: the app was not served")
    assert "error" not in seen, seen.get("error")
    before, hang = seen["api_before"], seen["api_hang"]
    assert seen["cache"] == "no-store", "each poll reads the store"
    assert before["state"] == "running" and before["report"] is None and not before["final"]
    assert (before["timeout_s"], before["threshold_s"], before["world_size"]) == (15, 4, 2)
    for r in before["ranks"]:
        grads = next(g for g in r["groups"] if g["desc"] == "grads")
        assert r["step"] == 1 and r["ended"] is None and r["stalled"] is None and r["beat_age_s"] >= 0
        assert grads["enqueued"] >= 4 and grads["completed"] <= grads["enqueued"], "step 0's 4 all-reduces"
    assert [r["rank"] for r in before["ranks"]] == [0, 1] and len(before["lines"]) == 2
    (stored,) = [json.loads(p) for _r, n, _m, p in rows if n == "graphdeck_hang_report"]
    served = {**hang["report"], "groups": [{k: v for k, v in g.items() if k != "text"} for g in hang["report"]["groups"]],
              "ranks": {r: {k: v for k, v in x.items() if k != "text"} for r, x in hang["report"]["ranks"].items()}}
    assert hang["state"] == "hang" and served == stored, "the API serves the report the agents stored"
    assert [g["text"] for g in hang["report"]["groups"]] + [x["text"] for x in hang["report"]["ranks"].values()] == \
        [ln.strip() for ln in stored["lines"][1:]], "each with its line of the report"
    assert {r["step"] for r in hang["ranks"]} == {2}
    assert HOSTILE in hang["report"]["ranks"]["1"]["source"], "JSON carries the source line as it is"


@pytest.mark.parametrize("evidence", ["1", "0"])
def test_watch_exits_0_on_a_healthy_run(tmp_path, monkeypatch, evidence):
    import torch
    from click.testing import CliRunner

    from graphdeck.capture import Agent
    from graphdeck.cli import main as cli

    monkeypatch.setenv("GRAPHDECK_HEARTBEAT_S", "0.2")
    monkeypatch.setenv("GRAPHDECK_GRAD_EVIDENCE", evidence)  # off: the heartbeat counts the steps itself
    agent = Agent(store=tmp_path / "h.db", run="ok")
    net = agent.watch(torch.nn.Linear(4, 1))
    model = torch.compile(net, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    res = CliRunner().invoke(cli, ["watch", str(tmp_path / "h.db"), "--run", "ok", "--poll-s", "0.1"])
    assert res.exit_code == 0, res.output
    assert "rank 0: step 3" in res.output and "run ended healthy" in res.output
    from sqlalchemy import select as sel

    from graphdeck.analysis.ranks.live import live_state
    from graphdeck.store.schema import Run

    with Session(open_engine(tmp_path / "h.db", read_only=True)) as s:
        st = live_state(s, s.scalar(sel(Run.id).where(Run.name == "ok")), world_size=1)
    assert (st["state"], st["final"], [r["step"] for r in st["ranks"]]) == ("ended", True, [3]), st
    assert st["lines"][0].split("; beat")[0] in res.output, "the API's progress lines are the watch's"
    from graphdeck.analysis.ranks import live
    from graphdeck.capture import heartbeat

    assert (heartbeat.HEARTBEAT, heartbeat.STACKS, heartbeat.REQUEST) == (live.HEARTBEAT, live.STACKS, live.REQUEST)


@pytest.mark.browser
def test_64_ranks_alike_are_one_line_in_the_report_and_one_row_on_the_page(tmp_path, browser):
    """64 ranks' heartbeats and stacks in a real store, as 64 agents would leave them (rank 0
    stalled in collective #9 of group 1, the others at the same place): the report merges the 63
    ranks alike into one line, the API keeps each rank, the page draws one row for them; a run
    without heartbeats shows no live section."""
    from graphdeck.analysis.ranks.live import HEARTBEAT, STACKS, live_state, write_hang_report
    from graphdeck.capture.heartbeat import python_stacks
    from graphdeck.store.db import get_or_create_run
    from tests.conftest import LiveServer

    store, now = tmp_path / "s.db", time.time()
    engine = open_engine(store)
    stacks = json.dumps(python_stacks())
    with Session(engine) as s, s.begin():
        run = get_or_create_run(s, "wide", world_size=64)
        for r in range(64):
            grads = {"desc": "grads", "enqueued": 9 if r == 0 else 8, "completed": 8, "since": now - 6,
                     "in_flight": True if r == 0 else None}
            beat = {"t": now, "step": 2, "groups": {"1": grads}, "threshold_s": 4, "timeout_s": 15, "interval_s": 1,
                    "stalled": {"group": "1", "desc": "grads", "seq": 9, "since": now - 6, "for_s": 6.0} if r == 0 else None,
                    "ended": None}
            s.add(CompileEvent(run_id=run.id, rank=r, name=HEARTBEAT, metadata_json="{}", payload=json.dumps(beat)))
            s.add(CompileEvent(run_id=run.id, rank=r, name=STACKS, metadata_json="{}", payload=stacks))
        run_id = run.id
        get_or_create_run(s, "plain", world_size=1)  # no heartbeat: no live section
    lines = write_hang_report(engine, run_id, rank=0)
    ranks_lines = [ln for ln in lines if ln.startswith(("  rank ", "  ranks "))]
    assert [ln.split(" (step")[0] for ln in ranks_lines] == ["  rank 0", "  ranks [1-63]"], lines
    assert "waiting 6.0 s in collective #9 of group 1" in ranks_lines[0]
    with Session(engine) as s:
        st = live_state(s, run_id, world_size=64)
    assert st["state"] == "hang" and len(st["ranks"]) == 64 and all(r["beating"] for r in st["ranks"])
    assert st["report"]["lines"] == lines and len(st["report"]["ranks"]) == 64
    with LiveServer(store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/wide")
        page.wait_for_selector("[data-testid=live-report]")
        rows = page.get_by_test_id("live-rank")
        assert [(r.get_attribute("data-rank"), r.get_attribute("data-ranks")) for r in rows.all()] == \
            [("0", None), (None, "1-63")]
        assert page.get_by_test_id("live-report-rank").all_inner_texts() == [ln.strip() for ln in ranks_lines]
        assert "64 of 64 ranks beating" in page.locator("#live p.summary").first.inner_text()
        page.goto(f"{srv.url}/#/runs/plain")
        page.wait_for_selector("#live[data-state=none]", state="attached")
        assert not page.locator("#live").is_visible()
        page.close()
