"""A newcomer's small faults (issue 36, item 4), each against the repository's demo store
(tests/data/demo_warm_bucket) through the real CLI:

* ``delete-run`` counted only the rows its DELETE matched, not those the same statement removed
  by ``ON DELETE CASCADE`` (a graph's child graphs): "2 graphs" for 20;
* ``memory --scope graph --dtype bfloat16`` printed the graph's report and dropped the what-if
  without a word: exit 2 saying the what-if is a step's;
* README's tour named a "gradients" overlay the graph page lacks; docs/commands.md sent
  ``memory-snapshot`` to a page that never mentioned it: every overlay the tour names is one of
  the page's, every page a command's row links to names the command;
* two compile-time totals for rank 0 on the run page (compile health's, with backward compiles, and
  the compile index's, frames only) without saying what each counts: the health total is split
  into frames + backward, the frames part equal to the index's sum, and every total says it;
* ``replay`` printed libkineto's USDT lines and ratios like "x8158.76 vs recorded" with no word
  on noise: quiet now, a caveat line with the median ratio, no ratio for nodes under 20 us;
* ``upload`` printed ~50 lines of merge JSON: now one line saying what was added (``--json``: all);
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys

import httpx
import pytest

from graphdeck.store.db import open_engine
from tests.conftest import REPO, LiveServer

RUN = "demo"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("newcomer") / "demo.db"
    with gzip.open(REPO / "tests/data/demo_warm_bucket/demo.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True, timeout=300)


def test_delete_run_counts_every_row_it_deleted(store, tmp_path):
    copy = tmp_path / "copy.db"
    shutil.copy(store, copy)
    with sqlite3.connect(copy) as c:
        before = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("graphs", "nodes", "traces")}
    proc = cli("delete-run", str(copy), "--run", RUN)
    assert proc.returncode == 0, proc.stderr
    said = {t: int(n) for n, t in re.findall(r"(\d+) (\w+)", proc.stdout.split(": ", 1)[1])}
    assert before["graphs"] == 20 and said["graphs"] == 20, (before, proc.stdout)
    assert all(said[t] == n for t, n in before.items()), (before, said)
    with sqlite3.connect(copy) as c:
        assert c.execute("SELECT count(*) FROM graphs").fetchone()[0] == 0


def test_upload_says_what_it_added_in_one_line(store, tmp_path):
    server_store = tmp_path / "server.db"
    open_engine(server_store).dispose()
    with LiveServer(server_store) as srv:
        plain = cli("upload", str(store), "--url", srv.url, "--run", "up")
        again = cli("upload", str(store), "--url", srv.url, "--run", "up", "--json")
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.strip().splitlines()
    assert len(lines) == 1, plain.stdout
    assert re.search(r"as bundle \w+ to run 'up' \(id \d+\): 2 ranks, 20 graphs, 1,766 nodes, 2 traces, 6,146 trace "
                     r"events, .* other rows$", lines[0]), lines[0]
    assert again.returncode == 0 and "(already uploaded before)" in again.stdout, again.stderr
    head, body = again.stdout.split("\n", 1)
    assert json.loads(body)["already_merged"] is True, body[:500]


def test_memory_what_if_with_scope_graph_is_refused_not_dropped(store):
    for what in (["--dtype", "bfloat16"], ["--checkpoint", "transformer/h/0"]):
        proc = cli("memory", RUN, "5", "--store", str(store), "--scope", "graph", *what)
        assert proc.returncode == 2 and "what-if of a training step" in proc.stderr and what[0] in proc.stderr, (
            what, proc.returncode, proc.stdout, proc.stderr)
    step = cli("memory", RUN, "5", "--store", str(store), "--dtype", "bfloat16")
    assert step.returncode == 0 and "what-if" in step.stdout, step.stdout + step.stderr


def test_the_readme_tour_names_only_the_graph_page_s_overlays():
    tour = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("3. **Graphs**"))
    named = [w.strip() for w in re.search(r"overlays \(([^)]*)\)", tour).group(1).split(",")]
    js = (REPO / "frontend/graph.js").read_text()
    labels = re.findall(r'\["\w*", "([^"]+)"\]', js[js.index("const OVERLAYS"):js.index("];", js.index("const OVERLAYS"))])
    assert len(labels) >= 8, labels
    missing = [n for n in named if not any(all(w in label for w in n.split()) for label in labels)]
    assert not missing, f"the tour names overlays the graph page does not have: {missing} (page: {labels})"


def test_every_page_a_command_row_links_names_the_command():
    wrong = []
    for line in (REPO / "docs/commands.md").read_text().splitlines():
        m = re.match(r"\| `graphdeck ([\w-]+)", line)
        if not m:
            continue
        for page in re.findall(r"\]\(([\w-]+\.md)\)", line):
            if m.group(1) not in (REPO / "docs" / page).read_text():
                wrong.append((m.group(1), page))
    assert not wrong, f"docs/commands.md sends these commands to pages that never mention them: {wrong}"


@pytest.mark.slow  # a real replay: torch, the profiler, ~15 s
def test_replay_is_quiet_and_says_what_its_ratios_are(store, tmp_path):
    copy = tmp_path / "replay.db"
    shutil.copy(store, copy)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "replay", RUN, "5", "--store", str(copy)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "USDT" not in proc.stdout + proc.stderr and "libkineto" not in proc.stdout + proc.stderr, proc.stderr
    assert "compare nodes with the median, not with 1.0" in proc.stdout, proc.stdout
    for line in proc.stdout.splitlines():
        m = re.match(r"\s+\S+\s+([\d.]+) us\s+x[\d.]+ vs recorded$", line)
        if m:
            assert float(m.group(1)) >= 20, f"a ratio for a node under the noise floor: {line}"


def test_compile_time_totals_say_what_they_count_and_add_up(store):
    with LiveServer(store) as srv:
        health = httpx.get(f"{srv.url}/api/runs/{RUN}/compile-health", timeout=60).json()
        index = httpx.get(f"{srv.url}/api/runs/{RUN}/compile-index", timeout=60).json()
    for rank in ("0", "1"):
        st = health["ranks"][rank]["stats"]
        frames = sum(e["compile_time_s"] or 0 for e in index["ranks"][rank])
        assert st["bwd_compile_s"] > 1 and abs(st["compile_s"] - st["frame_compile_s"] - st["bwd_compile_s"]) < 1e-6, st
        assert abs(st["frame_compile_s"] - frames) < 1e-3, (rank, st, frames)
    text = cli("check-compile", str(store), "--run", RUN).stdout
    assert "compile time (frames' forward compiles + backward compiles)" in text and "+ backward" in text, text
    js = (REPO / "frontend/compile.js").read_text()
    assert js.count("backward graphs not counted") == 2 and '"Frames (forward)"' in js and '"Backward graphs"' in js


def _doc_commands(page: str) -> list[list[str]]:
    """Every ``graphdeck …`` command line in the code blocks of ``docs/<page>``, continuation lines
    joined, split as a shell splits it (synopses with ``[…]`` left out)."""
    import shlex

    text = (REPO / "docs" / page).read_text()
    out = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line.startswith("graphdeck ") and "[" not in line:
                out.append(shlex.split(line))
    return out


def test_the_run_page_s_examples_parse_in_the_one_form_of_graphdeck_run_help():
    """docs/run.md mixed ``graphdeck run --store S --run R`` with the checks' ``STORE --run R``
    form: every command of the page (and every ``graphdeck run`` of integrations.md) parses with
    the CLI's own parser, names the store and the run as options, and hands ``graphdeck run`` a
    real command after ``--``; the synopsis lists exactly the options of ``graphdeck run --help``."""
    import click

    from graphdeck.cli import main

    examples = _doc_commands("run.md") + [c for c in _doc_commands("integrations.md") if c[1] == "run"]
    assert sum(c[1] == "run" for c in examples) >= 5, examples
    for argv in examples:
        group = main.make_context("graphdeck", argv[1:], resilient_parsing=True)
        sub = main.get_command(group, argv[1])
        assert sub is not None, argv
        ctx = sub.make_context(argv[1], argv[2:], parent=group)  # raises click.UsageError if it does not parse
        assert ctx.params.get("store") and ctx.params.get("run_name"), ("store and run as options", argv)
        assert ctx.params.get("target") is None, ("no positional store or run", argv)
        if argv[1] == "run":
            assert "--" in argv and argv[argv.index("--") + 1] in ("torchrun", "python"), argv
            command = list(ctx.params["command"])
            assert command == argv[argv.index("--") + 1:], (argv, command)  # passed on untouched
    synopsis = re.search(r"```\n(graphdeck run \[.*?)\n```", (REPO / "docs/run.md").read_text()).group(1)
    run_cmd = main.get_command(click.Context(main), "run")
    helped = {o for p in run_cmd.params for o in p.opts if o.startswith("--")}
    assert set(re.findall(r"\[(--[\w-]+)", synopsis)) == helped, (synopsis, helped)
    # the checks' positional STORE form given to graphdeck run is refused with the form to use
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "run", "runs.db", "--run", "exp1", "--", "python",
                           "-c", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "runs.db is a store, not a command: graphdeck run takes the store as an " \
                                   "option, before the command: graphdeck run --store runs.db" in proc.stderr, proc.stderr
