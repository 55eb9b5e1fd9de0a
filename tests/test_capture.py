"""Capture on real torch.compile: single process (aot_eager) for the gradient cases, graph breaks
and bindings; the multi-rank DDP job lives in test_main_job.py."""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.core import gradient_report
from graphdeck.capture import Agent
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Graph, GraphIO, Node, Param, Run
from tests.launch import run_python_job


def capture(tmp_path, model: nn.Module, inputs, *, run="t", backend="aot_eager", loss=None):
    """Compile ``model`` through the graphdeck backend, run forward+backward once, return the store."""
    torch._dynamo.reset()
    store = tmp_path / "store.db"
    agent = Agent(store=store, run=run)
    agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend(backend))
    out = compiled(*inputs)
    (loss(out) if loss else out.sum()).backward()
    agent.close()
    torch._dynamo.reset()
    return store


def report_of(store, run="t"):
    with Session(open_engine(store, read_only=True)) as s:
        return gradient_report(s, s.scalar(select(Run).where(Run.name == run)))


class DetachInMiddle(nn.Module):
    """The gradient case G5: ``blk2``'s output is detached, so ``blk2`` gets no gradient."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blk1 = nn.Linear(8, 8)
        self.blk2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.emb(x))
        h = torch.relu(self.blk1(h))
        h2 = self.blk2(h).detach()
        return self.head(h2) + self.aux(h).mean()


class UnusedSubmodule(nn.Module):
    """The gradient case G1: ``extra`` is only used when a flag is set, and it is not."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.extra = nn.Linear(8, 8)
        self.use_extra = False

    def forward(self, x):
        h = torch.relu(self.enc(x))
        if self.use_extra:
            h = self.extra(h)
        return self.head(h)


def test_detach_gives_no_grad_for_the_detached_block_only(tmp_path):
    store = capture(tmp_path, DetachInMiddle(), (torch.randint(0, 16, (4, 3)),))
    rep = report_of(store)
    status = {p.fqn: p.status for p in rep.params}
    assert status == {
        "emb.weight": "OK", "blk1.weight": "OK", "blk1.bias": "OK",
        "blk2.weight": "NO_GRAD", "blk2.bias": "NO_GRAD",
        "head.weight": "OK", "head.bias": "OK", "aux.weight": "OK", "aux.bias": "OK",
    }, "G5: only blk2 sits behind the detach; blk1 still reaches the loss through aux"
    assert {p["fqn"] for p in rep.problems} == {"blk2.weight", "blk2.bias"}
    blk2 = next(p for p in rep.params if p.fqn == "blk2.weight")
    assert blk2.first_use and "test_capture.py" in blk2.first_use, "the report points at the user's source line"


def test_unused_submodule_is_not_in_graph(tmp_path):
    store = capture(tmp_path, UnusedSubmodule(), (torch.randn(4, 8),))
    status = {p.fqn: p.status for p in report_of(store).params}
    assert status["extra.weight"] == status["extra.bias"] == "NOT_IN_GRAPH", "G1: no compiled graph reads extra"
    assert {k for k, v in status.items() if v == "OK"} == {"enc.weight", "enc.bias", "head.weight", "head.bias"}


def test_frozen_parameters_are_reported_frozen(tmp_path):
    model = UnusedSubmodule()
    model.enc.requires_grad_(False)
    store = capture(tmp_path, model, (torch.randn(4, 8),))
    status = {p.fqn: p.status for p in report_of(store).params}
    assert status["enc.weight"] == status["enc.bias"] == "FROZEN"
    assert status["head.weight"] == "OK"


def test_tied_weights_are_one_parameter_with_two_paths(tmp_path):
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.lm_head = nn.Linear(8, 32, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, x):
            return self.lm_head(torch.tanh(self.embed(x)))

    store = capture(tmp_path, TiedLM(), (torch.randint(0, 32, (2, 5)),))
    rep = report_of(store)
    assert len(rep.params) == 1, "G6: lm_head.weight and embed.weight are one storage"
    p = rep.params[0]
    assert p.status == "OK" and sorted(p.aliases) == ["embed.weight", "lm_head.weight"]
    assert p.paths >= 1 and rep.ok


def test_graph_break_gives_separate_graphs_with_reason(tmp_path):
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(torch.relu(h))

    store = capture(tmp_path, Breaks(), (torch.randn(2, 4),))
    with Session(open_engine(store, read_only=True)) as s:
        dyn = s.scalars(select(Graph).where(Graph.kind == "dynamo").order_by(Graph.ordinal)).all()
        assert len(dyn) == 2, "one graph before the break, one for the resumed frame"
        assert dyn[0].break_reason and "graph_break" in dyn[0].break_reason.lower().replace(" ", "_")
        assert "resume_in" in (dyn[1].frame_name or ""), dyn[1].frame_name
        kinds = [g.kind for g in s.scalars(select(Graph).order_by(Graph.ordinal))]
        assert kinds.count("aot_forward") == 2 and kinds.count("aot_backward") == 2
        names = {e.name for e in s.scalars(select(CompileEvent))}
        assert "compilation_metrics" in names, names


def test_nodes_carry_metadata_and_backward_binds_gradients(tmp_path):
    store = capture(tmp_path, DetachInMiddle(), (torch.randint(0, 16, (4, 3)),))
    with Session(open_engine(store, read_only=True)) as s:
        dyn = s.scalar(select(Graph).where(Graph.kind == "dynamo"))
        fw = s.scalar(select(Graph).where(Graph.kind == "aot_forward"))
        bw = s.scalar(select(Graph).where(Graph.kind == "aot_backward"))
        assert fw.parent_id == dyn.id and bw.parent_id == dyn.id
        linear = s.scalars(select(Node).where(Node.graph_id == dyn.id, Node.op == "call_function")).all()
        with_module = [n for n in linear if n.module_stack_json]
        assert with_module, "Dynamo nodes keep nn_module_stack"
        n = with_module[0]
        assert json.loads(n.shape_json) and n.dtype == "float32" and n.device == "cpu"
        bw_nodes = s.scalars(select(Node).where(Node.graph_id == bw.id, Node.op == "call_function")).all()
        assert any(x.seq_nr is not None for x in bw_nodes), "backward nodes keep seq_nr"
        grads = {io.param_fqn: io.has_grad for io in s.scalars(select(GraphIO).where(
            GraphIO.graph_id == bw.id, GraphIO.direction == "grad"))}
        assert grads["blk2.weight"] is False and grads["head.weight"] is True
        assert s.scalar(select(Param).where(Param.fqn == "emb.weight")).size_bytes == 16 * 8 * 4


def test_backend_by_name_through_the_entry_point(tmp_path):
    """``torch.compile(model, backend="graphdeck")`` finds the backend through the
    ``torch_dynamo_backends`` entry point and records into ``GRAPHDECK_STORE``."""
    from tests.conftest import run_python

    store = tmp_path / "named.db"
    run_python(
        "import torch; m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU());"
        "f = torch.compile(m, backend='graphdeck'); f(torch.randn(2, 4)).sum().backward();"
        "from graphdeck.capture.backend import default_agent; default_agent().close()",
        env={"GRAPHDECK_STORE": str(store), "GRAPHDECK_RUN": "named", "GRAPHDECK_INNER": "aot_eager"})
    with Session(open_engine(store, read_only=True)) as s:
        kinds = sorted(g.kind for g in s.scalars(select(Graph)))
        assert kinds == ["aot_backward", "aot_forward", "dynamo"], kinds
        assert s.scalar(select(Run.name)) == "named"
    with Session(open_engine(store, read_only=True)) as s:
        run = s.scalar(select(Run))
        rep = gradient_report(s, run)
        assert {p.fqn for p in rep.params} == {"0.weight", "0.bias"}, "parameters learned from the graph"
        # Nothing failed, but without watch() the parameter list is only what graphs read and no
        # run-time evidence exists: INCOMPLETE, never PASS (issue 17).
        assert not rep.failures and rep.verdict == "INCOMPLETE", rep.to_text()
        assert any("parameter list is incomplete" in g for g in rep.gaps)


def test_ddp_buckets_recorded_as_the_reducer_has_them():
    """The DDP buckets graphdeck records (capture/comm_groups.py) are the reducer's own, in
    all-reduce order: rebuilt in gradient-ready order after the first step, or the initial ones
    that ``find_unused_parameters=True`` keeps; a frozen parameter is in none."""
    from pathlib import Path

    prog = Path(__file__).parent / "programs" / "ddp_buckets.py"
    proc = run_python_job([prog], env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [c["find_unused"] for c in cases] == [False, True]
    for c in cases:
        assert len(c["reducer"]) > 1, c
        assert [sorted(b) for b in c["recorded"]] == [sorted(b) for b in c["reducer"]], c
        assert "1.weight" not in sum(c["recorded"], [])
