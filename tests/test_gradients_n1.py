"""Case N1 of ../shared/cases/gradient-paths.md (pytorch/pytorch#139476): ``requires_grad`` of
``layer2`` flipped between steps on a compiled model, captured for real (1 rank, 12 steps,
aot_eager through the graphdeck backend).

The frame ``forward`` recompiles every step (the ``num_iter`` guard, and the ``requires_grad``
guard on ``layer2``) until Dynamo's recompile limit (8): compiles 0/0 … 0/7, failure at 0/8,
eager afterwards. check-grads must say ``layer1.weight`` NOT_IN_GRAPH, and ``layer2.*`` trainable in
the odd-step compiles (their backward graphs return its gradient) and frozen in the even-step ones,
per compile, with a final status that is not a failure.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from sqlalchemy.orm import Session

from graphdeck import validate_backward
from graphdeck.analysis.gradients.compiles import compile_findings, compile_states
from graphdeck.analysis.gradients.core import find_run
from graphdeck.analysis.gradients.report import ParamRow
from graphdeck.capture import Agent
from graphdeck.cli import main as cli
from graphdeck.store.db import open_engine

D = 8
STEPS = 12
ODD = ["0/1", "0/3", "0/5", "0/7"]
EVEN = ["0/0", "0/2", "0/4", "0/6"]


class N1(nn.Module):
    """Reads only ``layer1.bias`` (never ``layer1.weight``) and counts its calls in a Python int."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(D, D)
        self.layer2 = nn.Linear(D, D)
        self.num_iter = 0

    def forward(self, x):
        self.num_iter += 1
        return self.layer2(x + self.layer1.bias)


def train(model: nn.Module, step_fn) -> None:
    """12 SGD steps; before each, layer2 trains on odd steps only."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        for p in model.layer2.parameters():
            p.requires_grad_(step % 2 == 1)
        x = torch.randn(4, D, generator=gen)
        step_fn(x).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def n1_store(tmp_path_factory):
    """The capture, plus the parameters after 12 eager steps of an identical model."""
    path = tmp_path_factory.mktemp("n1") / "n1.db"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = N1()
    torch.manual_seed(0)
    twin = N1()
    agent = Agent(store=path, run="n1")
    agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    train(model, compiled)
    agent.close()
    torch._dynamo.reset()
    train(twin, twin)
    return path, model, twin


def test_the_capture_is_n1(n1_store):
    """Store facts the diagnosis rests on: 8 compiles of forward, the 9th refused at the limit."""
    path, model, twin = n1_store
    con = sqlite3.connect(path)
    cids = [c for (c,) in con.execute("SELECT compile_id FROM graphs WHERE kind = 'dynamo' ORDER BY id")]
    assert cids == [f"0/{k}" for k in range(8)], cids
    failed = [(c, json.loads(m)["compilation_metrics"].get("fail_reason") or "") for c, m in con.execute(
        "SELECT compile_id, metadata_json FROM compile_events WHERE name = 'compilation_metrics'")]
    assert [c for c, reason in failed if "recompile limit" in reason.lower()] == ["0/8"], failed
    con.close()
    assert model.num_iter == STEPS
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-6), f"{name}: compiled training matches eager on torch 2.13"


def test_check_grads_reports_layer2_per_compile(n1_store):
    rep = validate_backward(n1_store[0], "n1")
    rows = {r.fqn: r for r in rep}
    assert rows["layer1.weight"].status == "NOT_IN_GRAPH", rows["layer1.weight"]
    assert rows["layer1.bias"].status == "OK"
    per_compile = (f"per compile: gradient in {', '.join(ODD)}; frozen (no gradient slot: requires_grad was "
                   f"False when compiled) in {', '.join(EVEN)}")
    for fqn in ("layer2.weight", "layer2.bias"):
        r = rows[fqn]
        assert not r.failing and r.status == "OK", f"{fqn} trains in the odd-step compiles: {r}"
        assert per_compile in r.notes, r.notes
    changed = [f for f in rep.findings if f.kind == "REQUIRES_GRAD_CHANGED"]
    assert len(changed) == 1 and changed[0].severity == "warning", rep.findings
    f = changed[0]
    assert f.params == ["layer2.weight", "layer2.bias"] and "forward" in f.message, f
    assert "hit the recompile limit at 0/8" in f.message and "gradient in 0/1, 0/3, 0/5, 0/7" in f.message
    assert [p["fqn"] for p in rep.problems] == ["layer1.weight"], rep.problems
    res = CliRunner().invoke(cli, ["check-grads", str(n1_store[0]), "--run", "n1", "--format", "json"])
    params = {p["fqn"]: p for p in json.loads(res.output)["params"]}
    assert per_compile in params["layer2.bias"]["notes"], res.output


def test_per_compile_states_from_the_backward_graphs(n1_store):
    """From the graphs alone (no run-time evidence): what each compile's backward has a slot for.
    A row that the recorded ``requires_grad`` calls FROZEN becomes OK, since compiles return
    its gradient."""
    with Session(open_engine(n1_store[0], read_only=True)) as s:
        run = find_run(s, "n1")
        rows = [ParamRow(rank=0, fqn=f, status="FROZEN", aliases=[f], requires_grad=False,
                         reason="requires_grad is False") for f in ("layer2.weight", "layer2.bias")]
        rows.append(ParamRow(rank=0, fqn="layer1.bias", status="OK", aliases=["layer1.bias"], paths=1))
        states = compile_states(s, run.id, rows)
        expected = {**{c: "gradient" for c in ODD}, **{c: "frozen" for c in EVEN}}
        assert states[id(rows[0])] == states[id(rows[1])] == expected, states
        assert set(states[id(rows[2])].values()) == {"gradient"}, "layer1.bias trains in every compile"
        found = compile_findings(s, run.id, rows)
    assert [(r.fqn, r.status) for r in rows] == [("layer2.weight", "OK"), ("layer2.bias", "OK"), ("layer1.bias", "OK")]
    assert "compile(s) 0/1, 0/3, 0/5, 0/7 return its gradient" in rows[0].reason, rows[0].reason
    assert not rows[2].notes and len(found) == 1 and found[0].params == ["layer2.weight", "layer2.bias"]


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_evaluation_under_no_grad_is_not_a_requires_grad_change(tmp_path):
    """Train, then evaluate the same compiled model under no_grad: the second compile is an
    inference graph, which says nothing about requires_grad."""
    path = tmp_path / "eval.db"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoLayers()
    agent = Agent(store=path, run="eval")
    agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    compiled(torch.randn(4, D)).sum().backward()
    with torch.no_grad():
        compiled(torch.randn(4, D))
    agent.close()
    torch._dynamo.reset()
    with Session(open_engine(path, read_only=True)) as s:
        kinds = sorted(k for (k,) in s.connection().exec_driver_sql("SELECT kind FROM graphs"))
        assert kinds.count("aot_inference") == 1 and kinds.count("aot_backward") == 1, kinds
        run = find_run(s, "eval")
        rows = [ParamRow(rank=0, fqn=f, status="OK", aliases=[f], paths=1) for f in ("a.weight", "b.bias")]
        states = compile_states(s, run.id, rows)
        assert sorted(states[id(rows[0])].values()) == ["gradient", "inference"], states
    rep = validate_backward(path, "eval")
    assert rep.ok and not [f for f in rep.findings if f.kind == "REQUIRES_GRAD_CHANGED"], rep.findings
    assert not any(r.notes for r in rep), [r.notes for r in rep]


def test_frozen_after_the_parameter_list_was_written(tmp_path):
    """``b`` is frozen after the capture wrote the parameter list (``requires_grad`` True there):
    the only compile has no gradient slot for it, so it is FROZEN, not a NO_GRAD failure."""
    path = tmp_path / "frozen.db"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoLayers()
    agent = Agent(store=path, run="frozen")
    agent.watch(model)
    assert agent.writer is not None  # the parameter list is written now, as watch() does under torch.distributed
    model.b.requires_grad_(False)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    compiled(torch.randn(4, D)).sum().backward()
    agent.close()
    torch._dynamo.reset()
    con = sqlite3.connect(path)
    assert dict(con.execute("SELECT fqn, requires_grad FROM params"))["b.weight"] == 1
    con.close()
    rep = validate_backward(path, "frozen")
    assert rep.ok and {r.fqn: r.status for r in rep}["b.weight"] == "FROZEN", [(r.fqn, r.status, r.reason) for r in rep]
    with Session(open_engine(path, read_only=True)) as s:  # the graph-only path (no run-time evidence)
        run = find_run(s, "frozen")
        rows = [ParamRow(rank=0, fqn=f, status="NO_GRAD", aliases=[f]) for f in ("b.weight", "b.bias")]
        found = compile_findings(s, run.id, rows)
    assert [r.status for r in rows] == ["FROZEN", "FROZEN"] and not found, [(r.status, r.reason) for r in rows]
    assert "requires_grad was False in every compile that reads it (0/0" in rows[0].reason, rows[0].reason
