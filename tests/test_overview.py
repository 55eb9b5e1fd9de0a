"""The run overview (issue 23 item 2; NOTE: [Run overview] in analysis/summary.py): every check's
verdict with a count and a link, worst first, then the slowest steps; the same document over HTTP
(``GET /api/runs/{id}/summary``), from ``graphdeck summary RUN`` (one line per check, exit 0/1/3/2)
and drawn at the top of the run page, the details closed below it.

Inputs are real: the session's captured "tiny" run (1 rank, aot_eager, profiled: healthy), the
torch 2.13 gloo job whose blk2 sits behind a ``.detach()`` imported from its TORCH_TRACE logs
(run "detach": blk2 gets no gradient), and the shipped H200 GPT-2 store (run "gpt2": no run-time
gradient evidence, so INCOMPLETE), served by the real app over HTTP and the CLI in a subprocess;
the page in Chromium.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis import summary as S
from graphdeck.analysis.traces.mapping import map_trace
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run, Trace
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import LiveServer, shared_path

DATA = Path(__file__).parent / "data"
LINE = re.compile(r"^(PASS|FAIL|INCOMPLETE|ERROR|N/A)\s+(gradients|ranks|compile|traces|layout)\s+(.*)$")


@pytest.fixture(scope="module")
def store(captured_store, tmp_path_factory) -> Path:
    """A copy of the captured store ("tiny") with the detach job's logs imported beside it."""
    path = tmp_path_factory.mktemp("overview") / "s.db"
    with sqlite3.connect(captured_store) as src, sqlite3.connect(path) as dst:
        src.backup(dst)  # with its write-ahead log, which a file copy would leave behind
    import_torch_trace(open_engine(path), shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach"),
                       run_name="detach", strict=True)
    return path


@pytest.fixture(scope="module")
def gpt2_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("overview_gpt2") / "gpt2.db"
    with gzip.open(DATA / "gpt2_inductor" / "gpt2.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


@pytest.fixture(scope="module")
def server(store):
    with LiveServer(store) as srv:
        yield srv


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", "summary", *args], capture_output=True, text=True,
                          timeout=300)


def cli_verdicts(out: str) -> dict[str, str]:
    """check → verdict from the CLI's lines (each check exactly once)."""
    found = [m.groups()[:2] for m in map(LINE.match, out.splitlines()) if m]
    keys = [k for _, k in found]
    assert sorted(keys) == sorted(S.CHECKS), f"one line per check:\n{out}"
    return {k: v for v, k in found}


def api_summary(server, run: str) -> dict:
    r = httpx.get(f"{server.url}/api/runs/{run}/summary", timeout=120)
    assert r.status_code == 200, r.text[:500]
    return r.json()


# ---------------------------------------------------------------------------- API and CLI


def test_healthy_run_passes_every_check_it_has_evidence_for(server, store):
    doc = api_summary(server, "tiny")
    by = {c["key"]: c for c in doc["checks"]}
    assert {k: c["verdict"] for k, c in by.items()} == {
        "gradients": "PASS", "ranks": "PASS", "compile": "PASS", "traces": "PASS", "layout": "N/A"}
    assert doc["verdict"] == "PASS" and doc["exit_code"] == 0
    assert [c["key"] for c in doc["checks"]] == ["gradients", "ranks", "compile", "traces", "layout"], \
        "passes in check order, the neutral N/A last"
    assert all(c["count"] == 0 for c in doc["checks"] if c["verdict"] == "PASS")
    assert by["ranks"]["native_verdict"] == "OK" and "nothing to compare" in by["ranks"]["headline"], "1 rank: said so"
    assert "no gates" in by["compile"]["headline"], "check-compile without gates: a report, said so"
    assert by["layout"]["link"].endswith("/map") and "no parallel layout" in by["layout"]["headline"]
    # trace coverage is map_trace's own figure for the rank's trace
    with Session(open_engine(store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "tiny"))
        (tid,) = s.scalars(select(Trace.id).where(Trace.run_id == run.id)).all()
        fraction = map_trace(s, tid).coverage.fraction  # NOTE: [Trace coverage]
    (rank0,) = by["traces"]["detail"]["ranks"]
    assert rank0["trace_id"] == tid and rank0["fraction"] == pytest.approx(fraction) and fraction >= S.MIN_COVERAGE
    assert rank0["device"] == "cpu" and by["traces"]["link"] == f"#/traces/{tid}"
    assert f"{fraction:.1%}" in by["traces"]["headline"]
    for c in doc["checks"]:  # said as measured (a loaded machine may take the page's 3 s; never a verdict then)
        assert c["elapsed_s"] >= 0 and c["over_budget"] == (c["elapsed_s"] > c["budget_s"]), c
    slow = doc["slowest"]
    assert slow["available"] and slow["steps"] and slow["steps"][0]["rank"] == 0
    assert slow["steps"][0]["dur_ns"] > 0 and slow["steps"][0]["link"].startswith(f"#/traces/{tid}/replay")


def test_gradient_failure_comes_first_with_its_count_and_link(server):
    doc = api_summary(server, "detach")
    first = doc["checks"][0]
    assert first["key"] == "gradients" and first["verdict"] == "FAIL", doc["checks"]
    assert first["count"] == 2 and first["detail"]["failing"] == ["blk2.bias", "blk2.weight"]
    assert first["link"] == f"#/runs/{doc['run_id']}/grads?status=NO_GRAD"
    assert "detach" in " ".join(first["reasons"]), "the cut is named"
    by = {c["key"]: c for c in doc["checks"]}
    assert by["traces"]["verdict"] == "INCOMPLETE" and by["traces"]["count"] == 2, "no trace: missing evidence"
    assert by["traces"]["link"] is None and "ingest-trace" in by["traces"]["command"]
    assert by["ranks"]["verdict"] == "PASS" and by["compile"]["verdict"] == "PASS"
    assert doc["verdict"] == "FAIL" and doc["exit_code"] == 1
    assert doc["slowest"]["available"] is False and "no usable trace" in doc["slowest"]["reason"]
    assert [c["verdict"] for c in doc["checks"]] == sorted((c["verdict"] for c in doc["checks"]), key=S.SEVERITY.index)


def test_cli_prints_one_line_per_check_and_agrees_with_the_api(server, store):
    for run, code in (("tiny", 0), ("detach", 1)):
        proc = cli(run, "--store", str(store))
        assert proc.returncode == code, proc.stdout + proc.stderr
        doc = api_summary(server, run)
        assert cli_verdicts(proc.stdout) == {c["key"]: c["verdict"] for c in doc["checks"]}, proc.stdout
        assert proc.stdout.splitlines()[0].endswith(f": {doc['verdict']}")
        js = cli(run, "--store", str(store), "--json")
        assert js.returncode == code
        got = json.loads(js.stdout)
        assert [(c["key"], c["verdict"], c["count"]) for c in got["checks"]] == \
            [(c["key"], c["verdict"], c["count"]) for c in doc["checks"]]
    out = cli("detach", "--store", str(store)).stdout.splitlines()
    assert LINE.match(out[1]).groups()[:2] == ("FAIL", "gradients"), "the failure is the first line"
    assert "blk2.bias, blk2.weight" in out[1]
    # the checks' form (STORE --run RUN) gives the same report (issue 26 item 6)
    checks_form = cli(str(store), "--run", "detach")
    assert checks_form.returncode == 1 and checks_form.stdout.splitlines() == out, checks_form.stderr


def test_incomplete_evidence_exits_3(gpt2_store):
    proc = cli("gpt2", "--store", str(gpt2_store))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    verdicts = cli_verdicts(proc.stdout)
    assert verdicts["gradients"] == "INCOMPLETE" and "FAIL" not in verdicts.values()
    assert "no run-time gradient evidence" in proc.stdout
    assert verdicts["traces"] == "PASS", "the shipped GPU trace maps >= 90% of its kernel time"


def test_bad_input(server, store, tmp_path):
    r = httpx.get(f"{server.url}/api/runs/no-such-run/summary", timeout=30)
    assert r.status_code == 404 and "no-such-run" in r.json()["error"]
    proc = cli("no-such-run", "--store", str(store))
    assert proc.returncode == 2 and "no-such-run" in proc.stderr and not proc.stdout
    proc = cli("tiny", "--store", str(tmp_path / "missing.db"))
    assert proc.returncode == 2 and "missing.db" in proc.stderr
    proc = cli("--store", str(store))
    assert proc.returncode == 2 and "give the run" in proc.stderr
    proc = cli(str(store), "--run", "tiny", "--store", str(tmp_path / "other.db"))
    assert proc.returncode == 2 and "two stores" in proc.stderr


def test_a_check_that_raises_is_an_error_never_a_pass(store, monkeypatch):
    """``summary._CHECKERS`` is the declared seam: one check replaced by one that raises."""
    def broken(session, run, deadline):
        session.execute(select(Run).where(Run.id == -1)).all()
        raise RuntimeError("compile records unreadable <b>")

    monkeypatch.setitem(S._CHECKERS, "compile", broken)
    with Session(open_engine(store, read_only=True)) as s:
        rep = S.run_summary(s, s.scalar(select(Run).where(Run.name == "tiny")))
    by = {c.key: c for c in rep.checks}
    assert by["compile"].verdict == "ERROR" and "RuntimeError: compile records unreadable <b>" in by["compile"].error
    assert by["compile"].count is None
    assert rep.verdict == "INCOMPLETE" and rep.exit_code == 3, "an error is not a pass"
    assert [c.key for c in rep.checks][0] == "compile", "the error comes first (nothing failed)"
    assert by["traces"].verdict == "PASS" and by["gradients"].verdict == "PASS", "the other checks still ran"
    assert rep.to_text().splitlines()[1].startswith("ERROR      compile")


def test_the_trace_budget_stops_the_rank_loop(store):
    with Session(open_engine(store, read_only=True)) as s:
        rep = S.run_summary(s, s.scalar(select(Run).where(Run.name == "tiny")), budgets_s={"traces": 0.0})
    traces = next(c for c in rep.checks if c.key == "traces")
    assert traces.verdict == "INCOMPLETE" and traces.count == 1 and traces.budget_s == 0.0
    assert any("budget was spent" in r for r in traces.reasons), traces.reasons
    assert traces.over_budget and rep.exit_code == 3


# ---------------------------------------------------------------------------- the page


def _overview(page):
    page.wait_for_selector("[data-testid=run-overview][data-state=done]", timeout=60_000)
    items = page.locator("[data-testid=overview-check]")
    return [(items.nth(i).get_attribute("data-check"), items.nth(i).get_attribute("data-verdict"))
            for i in range(items.count())]


@pytest.mark.browser
def test_page_healthy_run_shows_its_verdicts_first_and_details_closed(server, store, browser):
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.url}/#/runs/tiny")
    shown = _overview(page)
    assert dict(shown) == cli_verdicts(cli("tiny", "--store", str(store)).stdout), "the page and the CLI agree"
    assert [v for _, v in shown] == ["PASS"] * 4 + ["N/A"], shown
    assert page.get_by_test_id("overview-verdict").get_attribute("data-verdict") == "PASS"
    box = page.get_by_test_id("run-overview").bounding_box()
    assert box["y"] < 300, "the overview is at the top of the page"
    for key in ("gradients", "ranks", "compile", "traces", "layout"):
        assert page.get_by_test_id(f"overview-link-{key}").is_visible(), f"{key} has a link"
    assert page.locator(".ov-check.ov-pass").count() == 4 and page.locator(".ov-check.ov-na").count() == 1
    assert page.get_by_test_id("overview-slowest-steps").locator("tbody tr").count() >= 1
    # details: closed by default, their ids kept
    assert page.locator("details.run-details[open]").count() == 0
    page.locator("#compile-records [data-testid=compile-metrics-rank-0]").wait_for(state="attached")
    assert not page.locator(".graphs-table").first.is_visible()
    # the compile-health link opens its block and shows the panel
    page.get_by_test_id("overview-link-compile").click()
    page.locator("#compile-health").wait_for(state="visible")
    assert page.locator("details#details-compile[open]").count() == 1
    assert page.locator("details#details-ranks[open]").count() == 0
    page.get_by_test_id("details-open-all").click()
    page.locator(".graphs-table").first.wait_for(state="visible")
    page.get_by_test_id("overview-link-gradients").click()
    page.wait_for_url(lambda url: url.endswith("/grads"))
    page.locator("#grads-page #grad-report").wait_for()
    page.screenshot(path="/tmp/graphdeck-overview-tiny.png", full_page=True)
    assert not errors, errors
    page.close()


@pytest.mark.browser
def test_page_gradient_failure_is_first_with_the_link_to_the_grads_page(server, store, browser):
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(f"{server.url}/#/runs/detach")
    shown = _overview(page)
    assert shown[0] == ("gradients", "FAIL"), shown
    assert dict(shown) == cli_verdicts(cli("detach", "--store", str(store)).stdout), "the page and the CI log agree"
    assert page.get_by_test_id("overview-verdict").get_attribute("data-verdict") == "FAIL"
    first = page.get_by_test_id("overview-check").first
    assert "2 failing parameter" in first.inner_text() and "blk2.bias, blk2.weight" in first.inner_text()
    traces = page.locator("[data-testid=overview-check][data-check=traces]")
    assert traces.get_attribute("data-verdict") == "INCOMPLETE" and traces.locator("a").count() == 0
    assert "No step times" in page.get_by_test_id("overview-slowest-none").inner_text()
    page.screenshot(path="/tmp/graphdeck-overview-detach.png", full_page=True)
    first.get_by_test_id("overview-link-gradients").click()
    page.wait_for_url(lambda url: url.endswith("/grads?status=NO_GRAD"))
    rows = page.locator("#grads-page #grad-report tbody tr:visible")
    rows.first.wait_for()
    assert set(rows.locator("td:nth-child(2) code").all_inner_texts()) == {"blk2.bias", "blk2.weight"}
    # ?details=open opens every block; the jump buttons open theirs
    page.goto(f"{server.url}/#/runs/detach?details=open")
    page.locator(".graphs-table").first.wait_for(state="visible")
    assert page.locator("details.run-details:not([open])").count() == 0
    page.close()


def test_layout_line_when_a_layout_was_recorded(tmp_path):
    """Layout records written through the capture's writer for a 2x2 dp x tp job; rank 3's is
    missing (it died before ``watch``): INCOMPLETE naming it, then PASS once it is there."""
    from graphdeck.analysis.parallel.layout import EVENT_NAME
    from graphdeck.capture.writer import StoreWriter
    from tests.nd_fixtures import fsdp_tp_records

    path = tmp_path / "layout.db"
    recs = fsdp_tp_records()

    def write(rank):
        w = StoreWriter(str(path), "mesh", rank, 4)
        w.write_compile_events([{"name": EVENT_NAME, "compile_id": None, "metadata": {}, "payload": json.dumps(recs[rank])}])
        w.engine.dispose()

    def layout_line():
        with Session(open_engine(path, read_only=True)) as s:
            rep = S.run_summary(s, s.scalar(select(Run).where(Run.name == "mesh")))
        return next(c for c in rep.checks if c.key == "layout"), rep

    for rank in (0, 1, 2):
        write(rank)
    line, rep = layout_line()
    assert line.verdict == "INCOMPLETE" and line.count == 1 and line.detail["missing_ranks"] == [3]
    assert "dp×tp (2×2)" in line.headline and line.link == f"#/runs/{rep.run_id}/map"
    assert any("rank(s) [3]" in r for r in line.reasons), line.reasons
    assert rep.exit_code in (1, 3)
    write(3)
    line, _ = layout_line()
    assert line.verdict == "PASS" and line.count == 0 and "every rank (4)" in line.headline
