"""The capture's store writes run on the graphdeck-writer thread, not the compiling thread
(NOTE: [Writes off the compiling thread] in graphdeck.capture.writer_thread).

Real parts: torch.compile through the agent's backend (aot_eager), a real SQLite store in a temp
dir, a fresh interpreter for the exit paths.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from sqlalchemy import event, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.capture import Agent
from graphdeck.capture.writer import StoreWriter
from graphdeck.capture.writer_thread import THREAD_NAME
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, GradStep, Graph

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _writer_thread_on(monkeypatch):
    """The writer thread is opt-in (``GRAPHDECK_WRITER_THREAD=1``, capture/writer_thread.py): on here,
    for this process and the jobs it starts."""
    monkeypatch.setenv("GRAPHDECK_WRITER_THREAD", "1")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _stored(store) -> tuple[list[tuple[int, str, int | None]], list[str]]:
    with Session(open_engine(store, read_only=True)) as s:
        graphs = [tuple(r) for r in s.execute(select(Graph.id, Graph.kind, Graph.parent_id).order_by(Graph.id))]
        names = s.scalars(select(CompileEvent.name)).all()
    return graphs, names


def test_the_compile_runs_no_sql_and_close_flushes_every_write(tmp_path, monkeypatch):
    """While the writer thread is held (its first graph write waits on a gate), the compile and
    the first step finish: no SQL statement ran on the compiling thread, the store has no graph
    yet, and the step's gradient evidence did not wait for it either. ``close()`` then makes every
    queued write, in order (the AOT graphs name the Dynamo graph's id, which was only known on the
    writer thread; the evidence's row names its step)."""
    store = tmp_path / "s.db"
    gate, reached, seen, sql_threads = threading.Event(), threading.Event(), [], []
    real = StoreWriter.write_graph

    def held_write_graph(self, *a, **k):
        seen.append(threading.current_thread().name)
        reached.set()
        gate.wait(300)
        return real(self, *a, **k)

    def on_sql(conn, cursor, statement, *rest):
        sql_threads.append(threading.current_thread().name)

    monkeypatch.setattr(StoreWriter, "write_graph", held_write_graph)
    event.listen(Engine, "before_cursor_execute", on_sql)
    try:
        agent = Agent(store=store, run="thread")
        model = agent.watch(_model())
        compiled = torch.compile(model, backend=agent.backend("aot_eager"))
        sql_threads.clear()
        compiled(torch.randn(4, 8)).sum().backward()  # the compile (forward and backward graphs)
        assert reached.wait(300)  # the writer thread got to the first graph (however slow the host)
        main = threading.main_thread().name
        assert sql_threads and main not in sql_threads, sql_threads  # none on the compiling thread
        assert seen == [THREAD_NAME], seen  # held at the first graph: the rest still queued
        assert _stored(store)[0] == []
        gate.set()
        agent.close()
    finally:
        gate.set()
        event.remove(Engine, "before_cursor_execute", on_sql)
    assert set(seen) == {THREAD_NAME} and len(seen) == 3, seen
    graphs, names = _stored(store)
    assert [k for _, k, _ in graphs] == ["dynamo", "aot_forward", "aot_backward"], graphs
    assert [p for _, _, p in graphs] == [None, graphs[0][0], graphs[0][0]], graphs
    assert agent.graph_ids == [g for g, _, _ in graphs]
    with Session(open_engine(store, read_only=True)) as s:
        assert s.scalars(select(GradStep.step_first)).all() == [0]
    assert {"dynamo_start", "compilation_metrics", "bwd_compilation_metrics", "graphdeck_watch"} <= set(names), names
    assert not agent._writer._thread.is_alive()  # close() stopped it: later writes run on the caller


def test_a_failed_write_is_reported_and_the_rest_kept(tmp_path, monkeypatch):
    """A write that fails on the writer thread is warned about (its type and message) and listed
    in ``failures``; the writes after it are made; training is not affected."""
    monkeypatch.setenv("GRAPHDECK_GRAD_EVIDENCE", "0")
    real = StoreWriter.write_graph

    def failing(self, record, **k):
        if k.get("kind") == "aot_forward":
            raise RuntimeError("disk on fire")
        return real(self, record, **k)

    monkeypatch.setattr(StoreWriter, "write_graph", failing)
    store = tmp_path / "s.db"
    agent = Agent(store=store, run="fail")
    model = agent.watch(_model())
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
        out.sum().backward()
        agent.close()
    torch.testing.assert_close(out, model(x))
    said = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert any("aot_forward" in m and "RuntimeError: disk on fire" in m for m in said), said
    assert any("RuntimeError: disk on fire" in f for f in agent._writer.failures), agent._writer.failures
    assert [k for _, k, _ in _stored(store)[0]] == ["dynamo", "aot_backward"]


EXIT_JOB = r"""
import sys, time, torch
from graphdeck.capture import Agent
from graphdeck.capture.writer import StoreWriter
real = StoreWriter.write_graph
def slow(self, *a, **k):  # the writer thread is behind when the job dies
    time.sleep(0.5)
    return real(self, *a, **k)
StoreWriter.write_graph = slow
agent = Agent(store=sys.argv[1], run="crash")
model = agent.watch(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
compiled(torch.randn(4, 8)).sum().backward()
print("queued", flush=True)
raise RuntimeError("the job crashed")
"""


def test_a_job_that_crashes_before_close_keeps_every_queued_write(tmp_path):
    """No ``close()``: an uncaught exception ends the interpreter while the writer thread is
    still behind; the exit flush makes every queued write (graphs, compile records, evidence)."""
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-c", EXIT_JOB, str(store)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "the job crashed" in proc.stderr, proc.stderr[-3000:]
    assert "queued" in proc.stdout
    graphs, names = _stored(store)
    assert [k for _, k, _ in graphs] == ["dynamo", "aot_forward", "aot_backward"], (graphs, proc.stderr[-3000:])
    assert {"dynamo_start", "compilation_metrics", "bwd_compilation_metrics"} <= set(names), names
