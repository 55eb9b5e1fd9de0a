"""``graphdeck diff-runs`` (issue 21 item 2) on real captured runs and on the shared TORCH_TRACE logs.

One subprocess captures three runs of one small model (3 blocks: Linear + ReLU + a ``Wide``
linear over a repeated input) into one store, compiled with ``aot_eager`` through the graphdeck
backend and profiled for 8 steps: ``base`` and ``base2`` (the same code) and ``changed`` (a
``torch._dynamo.graph_break()`` after block 1, and block 1's ``Wide`` 256 times wider: its
matmul, and that matmul's backward, are far slower). The ``changed`` run's name holds markup, for
the page's escaping.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.cli import main as cli
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Run
from tests.conftest import IN_CI, REPO, LiveServer, run_python, shared_path

CHANGED = 'changed<img src=x onerror="window.__xss=1">'
BREAK_LINE = 31  # the torch._dynamo.graph_break() line of PROGRAM (the file is written as given)

PROGRAM = r'''import sys, torch
import torch.nn.functional as F
from graphdeck.capture import Agent


class Wide(torch.nn.Module):
    def __init__(self, d, rep):
        super().__init__()
        self.rep = rep
        self.weight = torch.nn.Parameter(torch.randn(d, d * rep) / (d * rep) ** 0.5)

    def forward(self, h):
        return F.linear(h.repeat(1, self.rep), self.weight)


class Block(torch.nn.Module):
    def __init__(self, d, rep):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.big = Wide(d, rep)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return h + self.big(h)


def forward(self, x):
    x = self.blocks[0](x)
    x = self.blocks[1](x)
    if self.brk:
        torch._dynamo.graph_break()
    x = self.blocks[2](x)
    return x.sum()


class M(torch.nn.Module):
    forward = forward

    def __init__(self, changed):
        super().__init__()
        self.brk = changed
        self.blocks = torch.nn.ModuleList([Block(64, 256 if changed and i == 1 else 1) for i in range(3)])


def capture(store, run, changed):
    torch._dynamo.reset()
    torch.manual_seed(0)
    agent = Agent(store=store, run=run)
    model = agent.watch(M(changed))
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    gen = torch.Generator().manual_seed(0)
    with agent.profile(wait_steps=1, warmup_steps=1, active_steps=8) as prof:
        for _ in range(10):
            compiled(torch.randn(16, 64, generator=gen)).backward()
            prof.step()
    agent.close()


store = sys.argv[1]
capture(store, "base", False)
capture(store, sys.argv[2], True)
capture(store, "base2", False)
'''


@pytest.fixture(scope="module")
def diff_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("diffruns")
    prog = d / "diffprog.py"
    prog.write_text(PROGRAM)
    assert PROGRAM.splitlines()[BREAK_LINE - 1].strip() == "torch._dynamo.graph_break()"
    store = d / "diff.db"
    run_python(f"import runpy, sys; sys.argv = [{str(prog)!r}] + sys.argv[1:]; runpy.run_path({str(prog)!r}, "
               "run_name='__main__')", str(store), CHANGED, env={"OMP_NUM_THREADS": "1"})
    return store


def cli_json(*args: str) -> tuple[int, dict | None, str]:
    res = CliRunner().invoke(cli, ["diff-runs", *args, "--format", "json"])
    try:
        return res.exit_code, json.loads(res.output), res.output
    except ValueError:
        return res.exit_code, None, res.output


@pytest.mark.slow
def test_changed_run_reports_the_break_and_the_slower_op(diff_store, tmp_path):
    junit = tmp_path / "diff.xml"
    code, rep, out = cli_json(str(diff_store), "base", CHANGED, "--max-new-graph-breaks", "0",
                              "--junit", str(junit))
    assert code == 1, out
    assert rep["verdict"] == "FAIL" and rep["failures"] == ["--max-new-graph-breaks: 1 new graph break(s) > 0"]
    by_id = {f["id"]: f for f in rep["findings"]}
    roots = [by_id[i] for i in rep["roots"]]
    # Exactly the two changes made to the code ...
    assert sorted(f["kind"] for f in roots) == ["new_graph_break", "node_regression"], out
    brk = next(f for f in roots if f["kind"] == "new_graph_break")
    assert brk["detail"]["source_line"] == f"diffprog.py:{BREAK_LINE}" and "graph_break()" in brk["message"]
    slow = next(f for f in roots if f["kind"] == "node_regression")
    assert slow["detail"]["module"] == "blocks.1.big" and set(slow["detail"]["phases"]) == {"forward", "backward"}
    mm = [n for n in slow["detail"]["nodes"] if n["target"] == "aten.mm.default"]
    assert len(mm) == 3 and all(n["delta_ns"] > n["floor_ns"] and n["b_ns"] > 3 * n["a_ns"] for n in mm), slow
    # ... and what follows from them, each naming its cause: block 1's graph changed (the wider
    # weight; the break cut it), the resumed frame after the break is a new graph, and the wider
    # matmul raised the graph-derived peak and the saved activations.
    rest = {f["kind"]: f for f in rep["findings"] if f["follows_from"]}
    # A module summed slower with no node of it beyond the floor (block 0 after the wide matmul's
    # cache pressure, on a loaded machine) may appear; it follows from the regression, never alone.
    for f in rep["findings"]:
        if f["kind"] == "module_regression":
            assert f["follows_from"] == [slow["id"]] and "interference" in f["message"], f
    rest.pop("module_regression", None)
    assert set(rest) == {"structure_changed", "new_graph", "peak_memory", "saved_activations"}, out
    assert set(rest["structure_changed"]["follows_from"]) == {brk["id"], slow["id"]}
    assert "[blocks/1/big]" in rest["structure_changed"]["message"]
    assert rest["new_graph"]["follows_from"] == [brk["id"]] and "resume" in rest["new_graph"]["message"]
    for kind in ("peak_memory", "saved_activations"):
        assert set(rest[kind]["follows_from"]) == {rest["structure_changed"]["id"], rest["new_graph"]["id"]}
        assert rest[kind]["detail"]["pct"] > 100
    # Every link names graphs of the right run.
    engine = open_engine(diff_store, read_only=True)
    with Session(engine) as s:
        run_of = dict(s.execute(select(Graph.id, Graph.run_id)).all())
        ids = {r.name: r.id for r in s.scalars(select(Run))}
    for f in rep["findings"]:
        assert f["links"], f
        for link in f["links"]:
            assert link["a"] is None or run_of[link["a"]] == ids["base"]
            assert link["b"] is None or run_of[link["b"]] == ids[CHANGED]
    assert all(s["status"] == "compared" for k, s in rep["sections"].items() if k != "gates"), rep["sections"]
    xml = junit.read_text()
    assert 'name="max-new-graph-breaks"' in xml and "<failure" in xml
    # Text: roots first, consequences say what they follow from.
    res = CliRunner().invoke(cli, ["diff-runs", str(diff_store), "base", CHANGED])
    assert res.exit_code == 0, res.output  # no gate given
    assert re.search(r"2 finding\(s\), \d+ following from them", res.output) and "follows from [" in res.output


def _margin(row: dict, drift: float) -> float:
    """How far a row's run-B lower quartile (drift-adjusted) is above run A's median, ns: what
    must pass the floor for a regression (NOTE: [Noise floor])."""
    import numpy as np

    return float(np.percentile(row["b_steps"], 25)) / drift - float(np.median(row["a_steps"]))


@pytest.mark.slow
def test_a_module_regression_links_both_runs_graphs(diff_store):
    """docs/ci-gates.md: every finding links both runs' graphs. A module slower in sum with no node
    beyond the floor alone (``module_regression``) had ``links: []`` (issue 36 item 3: it appeared
    only under load). Made to appear on any host: no noise multiple (``--noise-k 0``) and a floor
    between the wide module's margin and its slowest node's, both read from this very diff."""
    code, rep, out = cli_json(str(diff_store), "base", CHANGED, "--noise-k", "0")
    row = rep["timing"]["0"]
    drift = row["drift"]
    wide = next(m for m in row["modules"] if m["module"] == "blocks.1.big")
    node_margin = max(_margin(n, drift) for n in row["nodes"])
    module_margin = _margin(wide, drift)
    assert module_margin > 1.5 * node_margin > 0, (module_margin, node_margin, "3 wide matmuls in one module")
    floor = int((module_margin + node_margin) / 2)
    code, rep, out = cli_json(str(diff_store), "base", CHANGED, "--noise-k", "0", "--min-regression-ns", str(floor))
    kinds = Counter(f["kind"] for f in rep["findings"])
    assert kinds["module_regression"] >= 1 and kinds["node_regression"] == 0, out
    engine = open_engine(diff_store, read_only=True)
    with Session(engine) as s:
        run_of = dict(s.execute(select(Graph.id, Graph.run_id)).all())
        ids = {r.name: r.id for r in s.scalars(select(Run))}
    for f in rep["findings"] + rep["improvements"]:
        assert f["links"], f
        for link in f["links"]:
            assert link["a"] is None or run_of[link["a"]] == ids["base"], f
            assert link["b"] is None or run_of[link["b"]] == ids[CHANGED], f
    mod = next(f for f in rep["findings"] if f["kind"] == "module_regression" and f["detail"]["module"] == "blocks.1.big")
    assert all(link["a"] and link["b"] and link["node_a"] and link["node_b"] for link in mod["links"]), mod
    with Session(engine) as s:  # the linked graphs hold the module's nodes, forward and backward
        kinds_linked = {s.get(Graph, link["b"]).kind for link in mod["links"]}
    assert kinds_linked == {"aot_forward", "aot_backward"}, mod["links"]


@pytest.mark.slow
def test_same_code_reports_nothing_beyond_the_noise_floor(diff_store):
    code, rep, out = cli_json(str(diff_store), "base", "base2", "--max-new-graph-breaks", "0",
                              "--max-new-recompiles", "0", "--max-node-regression-pct", "0",
                              "--max-peak-memory-increase-pct", "0", "--fail-on-new-divergence",
                              "--fail-on-new-grad-findings")
    assert code == 0 and rep["verdict"] == "PASS", out
    assert rep["findings"] == [] and rep["improvements"] == []
    assert rep["sections"]["timing"]["status"] == "compared" and rep["graphs"]["0"]["same"] == 3
    nodes = rep["timing"]["0"]["nodes"]
    assert nodes and all(n["floor_ns"] >= 50_000 and not n["regression"] for n in nodes)
    # The node times were read from the table the ingest wrote, not from the events.
    assert rep["timing"]["0"]["times_a"] == rep["timing"]["0"]["times_b"] == "node-time table"
    assert "from the table written at ingest" in rep["sections"]["timing"]["why"]


def _same_report(got: dict, want: dict) -> None:
    """Everything but where the node times came from is equal."""
    def strip(rep):
        rep = json.loads(json.dumps(rep))
        rep["sections"]["timing"]["why"] = rep["sections"]["timing"]["why"].split("; node times of")[0]
        for row in rep["timing"].values():
            row.pop("times_a"), row.pop("times_b")
        return rep

    assert strip(got) == strip(want)


@pytest.mark.slow
def test_without_a_valid_node_time_table_the_events_give_the_same_diff(diff_store, tmp_path):
    """NOTE: [Node-time table]: a store written before schema 5 (here: the same store migrated
    down to 0004 by Alembic, read-only as the CLI reads it) and a table made stale by a kernel link
    stored after the trace are mapped from the events again: the same findings, said so."""
    import sqlite3

    from graphdeck.store import migrate
    from graphdeck.store.db import store_url

    with sqlite3.connect(diff_store) as con:  # one set per trace (3 runs x 1 rank), 8 profiled steps
        sets = con.execute("SELECT steps, source, mapped_calls > 0 FROM node_time_sets").fetchall()
        assert sets == [(8, "cpu ops of compiled functions", 1)] * 3, sets
        rows = con.execute("SELECT total_ns, count, steps_ns_json FROM node_times").fetchall()
    assert rows and all(sum(json.loads(st)) <= total and n >= 1 for total, n, st in rows)
    args = ("base", CHANGED, "--max-new-graph-breaks", "0")
    code, want, out = cli_json(str(diff_store), *args)
    assert code == 1 and {r["times_a"] for r in want["timing"].values()} == {"node-time table"}, out

    old = tmp_path / "old.db"
    shutil.copyfile(diff_store, old)
    from alembic import command
    from sqlalchemy import create_engine

    engine = create_engine(store_url(old))
    with engine.begin() as conn:
        command.downgrade(migrate.alembic_config(conn), "0004")
    engine.dispose()
    with sqlite3.connect(old) as con:
        assert not con.execute("SELECT name FROM sqlite_master WHERE name = 'node_times'").fetchall()
    code, got, out = cli_json(str(old), *args)
    assert code == 1, out
    _same_report(got, want)
    assert "predates the node-time table" in got["sections"]["timing"]["why"], got["sections"]["timing"]

    stale = tmp_path / "stale.db"
    shutil.copyfile(diff_store, stale)
    with sqlite3.connect(stale) as con:
        run_id = con.execute("SELECT id FROM runs WHERE name = 'base'").fetchone()[0]
        con.execute("INSERT INTO kernel_nodes (run_id, rank, kernel_name, node_name, source) "
                    "VALUES (?, 0, 'late_kernel', 'mm', 'seq_nr')", (run_id,))
    code, got, out = cli_json(str(stale), *args)
    assert code == 1, out
    _same_report(got, want)
    assert got["timing"]["0"]["times_a"].startswith("trace events (rank 0's graphs or kernel links changed")
    assert got["timing"]["0"]["times_b"] == "node-time table"
    # What the capture does after linking kernels: the stale set is mapped again, and used.
    from graphdeck.store.node_times import refresh

    engine = open_engine(stale)
    trace_a = got["timing"]["0"]["trace_a"]
    assert refresh(engine, trace_a) is not None
    engine.dispose()
    code, again, out = cli_json(str(stale), *args)
    assert code == 1 and again["timing"]["0"]["times_a"] == "node-time table", out
    _same_report(again, want)


@pytest.mark.slow
def test_usage_errors_exit_2(diff_store, tmp_path):
    for args, why in ((["base", "nope"], "'nope' not found"), (["base", "base"], "same run"),
                      (["base", "base2", "--max-new-graph-breaks", "-1"], "-1")):
        res = CliRunner().invoke(cli, ["diff-runs", str(diff_store), *args])
        assert res.exit_code == 2 and why in res.output, res.output
    res = CliRunner().invoke(cli, ["diff-runs", str(tmp_path / "missing.db"), "a", "b"])
    assert res.exit_code == 2, res.output


@pytest.mark.slow
def test_api_over_http(diff_store):
    import httpx

    with LiveServer(diff_store) as srv:
        got = httpx.get(f"{srv.url}/api/diff", params={"run_a": "base", "run_b": CHANGED,
                                                        "max_new_graph_breaks": 0}, timeout=60)
        assert got.status_code == 200, got.text
        rep = got.json()
        assert rep["verdict"] == "FAIL" and sorted(rep["findings"][i - 1]["kind"] for i in rep["roots"]) == [
            "new_graph_break", "node_regression"]
        assert httpx.get(f"{srv.url}/api/diff", params={"run_a": "base", "run_b": "nope"}).status_code == 404
        same = httpx.get(f"{srv.url}/api/diff", params={"run_a": "base", "run_b": "base"})
        assert same.status_code == 400 and "same run" in same.json()["error"]
        bad = httpx.get(f"{srv.url}/api/diff", params={"run_a": "base", "run_b": "base2", "max_node_regression_pct": -1})
        assert bad.status_code == 422


@pytest.mark.slow
@pytest.mark.browser
def test_page_links_both_runs_graphs_and_escapes(diff_store, browser):
    with LiveServer(diff_store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/base")
        page.get_by_test_id("diff-link").click()
        page.wait_for_selector("[data-testid=pick-b]")
        page.get_by_test_id("pick-b").select_option(label=f"{CHANGED} (#2)")
        page.get_by_role("button", name="compare").click()
        page.wait_for_selector("[data-testid=diff-verdict]", timeout=60_000)
        assert "FAIL" not in page.get_by_test_id("diff-verdict").inner_text()  # no gate given: PASS
        roots = page.locator("[data-testid=diff-roots] > li")
        assert roots.count() == 2
        assert {roots.nth(i).get_attribute("data-kind") for i in range(2)} == {"new_graph_break", "node_regression"}
        consequences = page.locator("[data-testid=diff-consequences] > li")
        assert consequences.count() >= 4
        assert "follows from: [" in consequences.first.get_by_test_id("follows-from").inner_text()
        changed = page.locator("[data-kind=structure_changed]")
        a_link, b_link = changed.get_by_test_id("link-a").first, changed.get_by_test_id("link-b").first
        assert re.match(r"#/graphs/\d+\?node=", a_link.get_attribute("href"))
        assert re.match(r"#/graphs/\d+\?node=", b_link.get_attribute("href"))
        assert page.evaluate("window.__xss") is None and page.locator("main img").count() == 0
        assert CHANGED in page.locator("h1").inner_text()
        b_link.click()
        page.wait_for_selector("svg", timeout=60_000)
        assert page.url.split("#")[1].startswith("/graphs/")
        page.close()


# ---------------------------------------------------------------------------- imported logs


def _tlparse_breaks(log, out) -> int:
    exe = shutil.which("tlparse")
    if exe is None:
        if IN_CI:
            pytest.fail("tlparse is missing under CI=true (it is in the test extra)")
        pytest.skip("tlparse not installed")
    subprocess.run([exe, str(log), "-o", str(out), "--overwrite", "--no-browser"], check=True, capture_output=True,
                   timeout=120)
    directory = json.loads((out / "compile_directory.json").read_text())
    return sum(1 for v in directory.values() for art in v.get("artifacts", [])
               if art["name"].startswith("dynamo_graph_break_reason_"))


@pytest.fixture(scope="module")
def trace_stores(tmp_path_factory):
    from graphdeck.store.torch_trace import import_torch_trace

    base = shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo")
    d = tmp_path_factory.mktemp("ttdiff")
    one, two = open_engine(d / "one.db"), open_engine(d / "two.db")
    for scenario in ("ddp", "graphbreak"):
        import_torch_trace(one, sorted((base / scenario).glob("*.log")), run_name=scenario, strict=False)
    import_torch_trace(two, sorted((base / "graphbreak").glob("*.log")), run_name="graphbreak", strict=False)
    return base, d / "one.db", d / "two.db"


def test_imported_logs_ddp_vs_graphbreak_agree_with_tlparse(trace_stores, tmp_path):
    base, one, two = trace_stores
    code, rep, out = cli_json(str(one), "ddp", "graphbreak", "--max-new-graph-breaks", "0")
    assert code == 1, out
    roots = [f for f in rep["findings"] if not f["follows_from"]]
    assert [f["kind"] for f in roots] == ["new_graph_break"], out
    brk = roots[0]
    assert brk["detail"]["source_line"] == "ddp_trace.py:17" and brk["ranks"] == [0, 1]  # the print() line
    # tlparse's break records: graphbreak has exactly the new break's records more than ddp.
    extra = Counter()
    for scenario in ("ddp", "graphbreak"):
        for i, log in enumerate(sorted((base / scenario).glob("*.log"))):
            extra[i] += _tlparse_breaks(log, tmp_path / f"{scenario}{i}") * (1 if scenario == "graphbreak" else -1)
    assert sum(extra.values()) == brk["detail"]["records"] and all(v > 0 for v in extra.values()), (extra, brk)
    # The frame the break cut changed and its resumed frame is new: both follow from the break.
    assert {f["kind"] for f in rep["findings"] if f["follows_from"] == [brk["id"]]} >= {"structure_changed", "new_graph"}
    # No trace in either run: timing is INCOMPLETE, never "no regression"; a timing gate is not passed.
    assert rep["sections"]["timing"]["status"] == "INCOMPLETE" and "no profiler trace" in rep["sections"]["timing"]["why"]
    res = CliRunner().invoke(cli, ["diff-runs", str(one), "ddp", "ddp", "--store-b", str(two)])
    assert res.exit_code == 2  # a run named ddp is not in the second store
    code, rep2, out = cli_json(str(one), "ddp", "graphbreak", "--store-b", str(two), "--max-node-regression-pct", "10")
    assert code == 3 and rep2["verdict"] == "INCOMPLETE" and not rep2["same_store"], out
    assert [f["message"] for f in rep2["findings"]] == [f["message"] for f in rep["findings"]]
    res = CliRunner().invoke(cli, ["diff-runs", str(one), "ddp", "graphbreak", "--max-node-regression-pct", "10"])
    assert res.exit_code == 3 and "timing: INCOMPLETE" in res.output and "no claim is made about node times" in res.output
    assert "no regression" not in res.output.lower()
    res = CliRunner().invoke(cli, ["diff-runs", str(one), "ddp", "graphbreak", "--max-node-regression-pct", "10",
                                   "--allow-incomplete"])
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------------------- GPU kernels (stored H200 traces)


@pytest.fixture(scope="module")
def h200_stores(tmp_path_factory):
    """The 2 x H200 DDP GPT-2 run of tests/data/ddp_h200x2 (Inductor, 5 profiled steps; see its
    README.md), unpacked into two stores as tests/test_h200x2.py does. In the second, every forward
    memory-efficient attention kernel (``fmha_cutlassF_...``, which
    ``aten::_scaled_dot_product_efficient_attention`` launches) is made 5x longer: a data change
    standing in for a slower attention kernel (no GPU here)."""
    import gzip
    import sqlite3

    from graphdeck.analysis.traces.mapping import link_kernels
    from graphdeck.store.traces import ingest_trace

    data = REPO / "tests" / "data" / "ddp_h200x2"
    out = []
    for name in ("same", "slow"):
        path = tmp_path_factory.mktemp("h200") / f"{name}.db"
        with gzip.open(data / "ddp.db.gz") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        engine = open_engine(path)
        for rank in (0, 1):
            ingest_trace(engine, data / f"ddp_rank{rank}.pt.trace.json.gz", run_name="ddp", strict=True)
        link_kernels(engine, 1)
        engine.dispose()
        out.append(path)
    with sqlite3.connect(out[1]) as con:
        con.execute("UPDATE trace_events SET dur_ns = dur_ns * 5 WHERE name_id IN (SELECT id FROM strings WHERE "
                    "value LIKE 'fmha_cutlassF_%') AND cat_id IN (SELECT id FROM strings WHERE value = 'kernel')")
        # The events were edited behind the ingest's back: the node times it kept are not theirs.
        con.execute("DELETE FROM node_time_sets")
    return out


@pytest.mark.slow
def test_gpu_kernel_times_across_two_stores(h200_stores):
    same, slow = h200_stores
    code, rep, out = cli_json(str(same), "ddp", "ddp", "--store-b", str(same))
    assert code == 2 and "same run" in out  # the same run of the same store
    code, rep, out = cli_json(str(same), "ddp", "ddp", "--store-b", str(same.parent / "missing.db"))
    assert code == 2, out  # a missing second store
    # A copy of the run: nothing, though every node was compared from the GPU kernels.
    copy = h200_stores[0].parent / "copy.db"
    shutil.copyfile(same, copy)
    code, rep, out = cli_json(str(same), "ddp", "ddp", "--store-b", str(copy), "--max-node-regression-pct", "10")
    assert code == 0 and rep["findings"] == [] and rep["verdict"] == "PASS", out
    for r in ("0", "1"):
        t = rep["timing"][r]
        assert t["source_a"] == "gpu kernels" and t["steps_a"] == t["steps_b"] == 5 and t["drift"] == 1.0
    # Attention 5x slower: node regressions at the attention op, in every layer, on both ranks.
    code, rep, out = cli_json(str(same), "ddp", "ddp", "--store-b", str(slow), "--max-node-regression-pct", "10")
    assert code == 1 and rep["failures"][0].startswith("--max-node-regression-pct"), out
    assert {f["kind"] for f in rep["findings"]} == {"node_regression"}, out
    targets = {n["target"] for f in rep["findings"] for n in f["detail"]["nodes"]}
    assert targets == {"aten._scaled_dot_product_efficient_attention.default"}, targets
    assert all(f["ranks"] == [0, 1] for f in rep["findings"]) and len(rep["findings"]) >= 2
