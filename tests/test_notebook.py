"""The notebook API (``graphdeck.open``, issue 23 item 4): docs/notebook.md's example runs as written, and its
reports give the verdicts the CLI gives on the same run."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphdeck

README = Path(__file__).resolve().parents[1] / "docs" / "notebook.md"


def _example() -> str:
    text = README.read_text()
    m = re.search(r"<!-- notebook-example:[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "docs/notebook.md holds the notebook example"
    return m.group(1)


def test_readme_notebook_example_runs_and_agrees_with_the_cli(captured_store):
    code = _example().replace('"graphdeck.db"', repr(str(captured_store))).replace('"demo"', '"tiny"')
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/notebook.md", "exec"), scope)  # noqa: S102 - the documented example itself
    grads, ranks = scope["grads"], scope["ranks"]
    cli = {}
    for cmd in ("check-grads", "check-ranks"):
        proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", cmd, str(captured_store), "--run", "tiny"],
                              capture_output=True, text=True, timeout=300)
        cli[cmd] = proc.returncode
    assert {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}[grads.verdict] == cli["check-grads"]
    assert {"OK": 0, "FAIL": 1, "INCOMPLETE": 3}[ranks.verdict] == cli["check-ranks"]
    assert f"{grads.verdict} {ranks.verdict}" in out.getvalue()


def test_frames_and_networkx_hold_the_stored_graph(captured_store):
    store = graphdeck.open(captured_store)
    run = store.run("tiny")
    g = run.graphs(kind="aot_forward", rank=0)[0]
    nodes, edges = g.nodes_frame(), g.edges_frame()
    assert len(nodes) == g.num_nodes and list(nodes.idx) == sorted(nodes.idx)
    assert set(edges.src) <= set(nodes.name) and set(edges.dst) <= set(nodes.name)
    nxg = g.to_networkx()
    assert nxg.number_of_nodes() == len(nodes) and nxg.number_of_edges() == len(edges)
    mm = nodes[nodes.target.str.contains("mm", na=False)]
    assert len(mm) and all(nxg.nodes[n]["op"] == "call_function" for n in mm.name)
    events = run.trace(0).events_frame(limit=50)
    assert len(events) == 50 and events.ts_ns.is_monotonic_increasing


def test_unknown_run_and_rank_are_named(captured_store):
    from graphdeck.errors import NotFoundError

    store = graphdeck.open(captured_store)
    with pytest.raises(NotFoundError, match="'nope'"):
        store.run("nope")
    with pytest.raises(NotFoundError, match="rank 7"):
        store.run("tiny").trace(7)
