"""Node-level gradient checks and graph-only flags (issue 17, items 5 and 6), on real captures:
torch.compile with aot_eager through the graphdeck backend, one call each.

* ``DANGLING_OUTPUT``: a chunk piece the loss skips (case G7: the parameters stay OK, "output
  partly used"), a split piece nobody reads, an output whose gradient the compiled backward drops.
* ``INPLACE_ON_DETACHED_ALIAS``: ``p.data`` mutated in the forward, ``y = x.detach(); x.add_(1)``.
* ``GRAD_ENABLED_IN_INFERENCE_GRAPH``: a write into an input inside ``enable_grad`` in a graph
  called under ``no_grad`` (eagerly the input gets a grad_fn, compiled it does not).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

from graphdeck import validate_backward
from graphdeck.capture import Agent
from graphdeck.cli import main as cli
from tests import grad_cases as C

D = 8


def line_of(marker: str) -> str:
    """``"test_gradients_nodes.py:<line>"`` of the line ending with ``# <marker>``."""
    for i, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return f"{Path(__file__).name}:{i}"
    raise KeyError(marker)


class SplitDropped(nn.Module):
    """``proj`` to 3·D split in three; the third piece is never read (Dynamo drops its getitem)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D)

    def forward(self, x):
        a, b, _c = self.proj(x).split(D, dim=-1)  # N-split
        return a * torch.sigmoid(b)


class SplitAllUsed(nn.Module):
    """q, k, v all read: nothing dangles."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.T, dim=-1) @ v


class SignOutput(nn.Module):
    """Returns ``sign(h)``: the loss uses it, but its derivative is zero, so the compiled backward
    reads that output's gradient only for its shape."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        return h.sum(), torch.sign(h)  # N-sign


def sign_loss(out):
    return out[0] + out[1].sum()


class DataAlias(nn.Module):
    """Shrinks its weight in the forward through ``.data``: autograd does not see the write."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        w = self.lin.weight.data  # N-data
        w.mul_(0.5)  # N-data-write
        return self.lin(x)


class InputDetach(nn.Module):
    """``y = x.detach()`` meant as a snapshot, then ``x`` is changed in place: ``y`` changes too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = x.detach()  # N-detach
        x.add_(1)  # N-input-write
        return self.lin(x) * y


class InputSnapshot(nn.Module):
    """The fixed version: ``detach().clone()`` is a real snapshot."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = x.detach().clone()
        x.add_(1)
        return self.lin(x) * y


class WriteUnderEnableGrad(nn.Module):
    """Writes ``lin(x)`` into the caller's buffer inside ``enable_grad``; called under ``no_grad``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, out):
        with torch.enable_grad():  # N-enable
            out.copy_(self.lin(x))  # N-enable-write
        return x * 2


class ReturnUnderEnableGrad(nn.Module):
    """Returns a value computed inside ``enable_grad``, called under ``no_grad``: AOTAutograd
    builds a training graph for it (torch 2.13), so nothing is lost."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, x):
        with torch.enable_grad():
            e = self.lin(x).sum()
        return e


def _x(requires_grad: bool = False):
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(0))
    return (x.requires_grad_() * 1) if requires_grad else x


def _buffer():
    return torch.zeros(4, D)


# name -> (model factory, input factory, loss or None for a no_grad call)
CASES = {
    "g7": (C.PartlyUsedChunk, lambda: (_x(),), C.g7_loss),
    "split": (SplitDropped, lambda: (_x(),), lambda out: out.sum()),
    "qkv": (SplitAllUsed, lambda: (_x(),), lambda out: out.sum()),
    "sign": (SignOutput, lambda: (_x(),), sign_loss),
    "data_alias": (DataAlias, lambda: (_x(),), lambda out: out.sum()),
    "input_detach": (InputDetach, lambda: (_x(requires_grad=True),), lambda out: out.sum()),
    "input_snapshot": (InputSnapshot, lambda: (_x(requires_grad=True),), lambda out: out.sum()),
    "enable_write": (WriteUnderEnableGrad, lambda: (_x(), _buffer()), None),
    "enable_return": (ReturnUnderEnableGrad, lambda: (_x(),), None),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Every case captured once (one run each). No-grad cases are called under ``torch.no_grad()``;
    what the compiled call returned (and wrote) is kept with the eager result for comparison."""
    path = tmp_path_factory.mktemp("nodes") / "nodes.db"
    seen = {}
    for name, (factory, inputs, loss) in CASES.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = factory()
        agent = Agent(store=path, run=name)
        agent.watch(model)
        compiled = torch.compile(model, backend=agent.backend("aot_eager"))
        args = inputs()
        if loss is None:
            with torch.no_grad():
                out = compiled(*args)
            torch.manual_seed(0)
            eager_args = inputs()
            with torch.no_grad():
                eager_out = factory()(*eager_args)
            seen[name] = {"compiled": (out, args), "eager": (eager_out, eager_args)}
        else:
            loss(compiled(*args)).backward()
        agent.close()
    torch._dynamo.reset()
    return path, seen


def findings(store, run, kind):
    rep = validate_backward(store[0], run)
    return rep, [f for f in rep.findings if f.kind == kind]


def chunk_line() -> str:
    lines, start = inspect.getsourcelines(C.PartlyUsedChunk.forward)
    k = next(i for i, text in enumerate(lines) if ".chunk(" in text)
    return f"grad_cases.py:{start + k}"


def test_g7_unused_chunk_piece_is_a_dangling_output_not_a_broken_path(store):
    rep, found = findings(store, "g7", "DANGLING_OUTPUT")
    assert [(r.fqn, r.status, r.paths) for r in rep] == [("proj.weight", "OK", 1), ("proj.bias", "OK", 1)], \
        "G7: a partly used chunk is not a broken path for proj"
    assert len(found) == 1, rep.findings
    f = found[0]
    assert f.severity == "warning" and f.node == "b" and f.source == chunk_line(), f
    assert f.graph_id is not None and "getitem" in f.message and "chunk" in f.message, f.message
    assert "output partly used" in f.message and sorted(f.params) == ["proj.bias", "proj.weight"]
    assert all(any("output partly used" in n for n in r.notes) for r in rep), [r.notes for r in rep]
    assert not [f for f in rep.findings if f.severity == "error"], rep.findings


def test_split_piece_that_nothing_reads(store):
    rep, found = findings(store, "split", "DANGLING_OUTPUT")
    assert all(r.status == "OK" for r in rep), [(r.fqn, r.status) for r in rep]
    assert len(found) == 1 and found[0].source == line_of("N-split"), rep.findings
    f = found[0]
    assert f.node == "split" and "piece(s) 2 of split" in f.message and "zero gradient slice" in f.message, f.message
    assert "output partly used" in f.message


def test_every_piece_read_nothing_dangles(store):
    rep, found = findings(store, "qkv", "DANGLING_OUTPUT")
    assert not found and all(r.status == "OK" for r in rep), rep.findings


def test_compiled_backward_drops_the_gradient_of_a_sign_output(store):
    """The backward graph reads the tangent of output 1 (``sign``) only through ``zeros_like``."""
    rep, found = findings(store, "sign", "DANGLING_OUTPUT")
    assert len(found) == 1, rep.findings
    f = found[0]
    assert f.node == "sign" and f.source == line_of("N-sign") and f.severity == "warning", f
    assert "tangents_2" in f.message and "only for its shape (zeros_like)" in f.message, f.message
    assert "output 1" in f.message and "surrogate" in f.fix
    assert all(r.status == "OK" for r in rep), "lin still trains through h.sum()"


def test_data_alias_written_in_the_forward(store):
    rep, found = findings(store, "data_alias", "INPLACE_ON_DETACHED_ALIAS")
    assert len(found) == 1, rep.findings
    f = found[0]
    assert f.severity == "warning" and f.node == "mul_" and f.source == line_of("N-data-write"), f
    assert f.params == ["lin.weight"] and "through its detached alias w" in f.message, f.message
    assert line_of("N-data") in f.message and "_get_data_attr" in f.message
    assert ".detach().clone()" in f.fix


def test_input_changed_in_place_after_a_detached_alias_was_taken(store):
    rep, found = findings(store, "input_detach", "INPLACE_ON_DETACHED_ALIAS")
    assert len(found) == 1, rep.findings
    f = found[0]
    assert f.node == "add_" and f.source == line_of("N-input-write") and f.params == [], f
    assert "after y took a detached alias" in f.message and line_of("N-detach") in f.message, f.message
    assert "not a snapshot" in f.message
    _, fixed = findings(store, "input_snapshot", "INPLACE_ON_DETACHED_ALIAS")
    assert not fixed, "detach().clone() is a snapshot: nothing to flag"


def test_write_inside_enable_grad_of_a_no_grad_call(store):
    """Eagerly ``out`` gets a grad_fn from the write; the compiled call leaves it without one."""
    seen = store[1]["enable_write"]
    assert seen["eager"][1][1].requires_grad and seen["eager"][1][1].grad_fn is not None
    assert not seen["compiled"][1][1].requires_grad, "compiled, the write carries no autograd history"
    rep, found = findings(store, "enable_write", "GRAD_ENABLED_IN_INFERENCE_GRAPH")
    assert len(found) == 1, rep.findings
    f = found[0]
    assert f.severity == "error" and f.node == "copy_" and f.source == line_of("N-enable-write"), f
    assert f.params == ["lin.bias", "lin.weight"] and "input l_out_" in f.message, f.message
    assert f"the enable_grad at {line_of('N-enable')}" in f.message and "grad mode off" in f.message
    assert not rep.ok
    res = CliRunner().invoke(cli, ["check-grads", str(store[0]), "--run", "enable_write", "--format", "json"])
    data = json.loads(res.output)
    assert res.exit_code != 0 and data["ok"] is False, res.output
    assert any(p["status"] == "GRAD_ENABLED_IN_INFERENCE_GRAPH" for p in data["problems"]), data["problems"]


def test_value_returned_from_enable_grad_is_not_flagged(store):
    """torch 2.13 builds a training graph for it: the compiled output has a grad_fn, as eagerly."""
    seen = store[1]["enable_return"]
    assert seen["eager"][0].requires_grad and seen["compiled"][0].requires_grad
    rep, found = findings(store, "enable_return", "GRAD_ENABLED_IN_INFERENCE_GRAPH")
    assert not found, rep.findings
