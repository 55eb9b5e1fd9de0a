"""Numeric mode of check-grads: eager vs compiled gradients in the caller's context (case N2 of
../shared/cases/gradient-paths.md) and the backward node each difference is blamed on. Real
torch.compile with aot_eager (and AOTAutograd backends built from it); no Inductor (too slow here)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from graphdeck import validate_backward
from graphdeck.capture.fxrecord import record_graph
from graphdeck.capture.writer import StoreWriter
from graphdeck.cli import main as cli
from tests import grad_cases as C

N2 = "tests.grad_cases:factory_inner_autocast_off"


def n2_input():
    """Case N2's input: bfloat16 [4, 64], requiring grad (so its gradient is compared too)."""
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()


def mismatches(rep):
    return {p: f for f in rep.findings if f.kind == "GRAD_MISMATCH" for p in f.params}


def n2_backward_graph():
    """The AOT backward graph of N2 under the outer bf16 autocast, captured by a backend of our own."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model = C.factory_inner_autocast_off()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=lambda gm, _i: make_boxed_func(gm.forward),
                                                         bw_compiler=keep))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(n2_input()).sum()
    loss.backward()
    torch._dynamo.reset()
    (bw,) = graphs
    return bw


def test_n2_outer_autocast_names_the_bf16_backward_mm():
    rep = validate_backward(C.factory_inner_autocast_off(), (n2_input(),), lambda o: o.sum(), numeric=True,
                            autocast_dtype="bfloat16")
    rows = {r.fqn: r for r in rep}
    assert rows["w.weight"].grad_max_abs_diff > 1e-3, rows["w.weight"]
    assert rows["w.bias"].status == "NOT_IN_GRAPH", "the manual matmul never reads the bias"
    assert rows["input[0]"].grad_max_abs_diff > 1e-3 and rows["input[0]"].dtype == "bfloat16"
    found = mismatches(rep)
    assert set(found) == {"w.weight", "input[0]"} and not rep.ok, rep.findings
    f = found["w.weight"]
    assert f.severity == "error" and f.source == C.line_of("N2-mm"), f
    assert f"backward node {f.node} (aten.mm) computes in bfloat16" in f.message, f.message
    assert "forward counterpart mm (aten.mm) ran in float32" in f.message
    assert "autocast(cpu, bfloat16)" in f.message and "backward_pass_autocast" in f.fix
    # The named node is the weight-gradient mm of the real backward graph, computing in bf16.
    bw = n2_backward_graph()
    nodes = {n.name: n for n in bw.graph.nodes}
    node = nodes[f.node]
    assert node.target is torch.ops.aten.mm.default and node.meta["val"].dtype == torch.bfloat16
    weight_grad = list(bw.graph.nodes)[-1].args[0][1]  # outputs: (grad of x, grad of w.weight)
    ancestors, todo = set(), [weight_grad]
    while todo:
        n = todo.pop()
        ancestors.add(n)
        todo += [a for a in n.all_input_nodes if a not in ancestors]
    assert node in ancestors, f"{f.node} must feed the weight gradient"
    assert found["input[0]"].node != f.node and found["input[0]"].node.startswith("mm"), found["input[0]"]


def test_n2_without_autocast_or_with_backward_autocast_off_has_no_difference():
    model = C.factory_inner_autocast_off()
    plain = validate_backward(model, (n2_input(),), lambda o: o.sum(), numeric=True)
    assert not mismatches(plain), plain.findings
    rows = {r.fqn: r for r in plain}
    assert rows["w.weight"].grad_max_abs_diff == 0.0 and rows["input[0]"].grad_max_abs_diff == 0.0
    assert "no autocast" in " ".join(plain.notes)
    with torch._functorch.config.patch(backward_pass_autocast="off"):
        off = validate_backward(model, (n2_input(),), lambda o: o.sum(), numeric=True, autocast_dtype="bfloat16")
    assert not mismatches(off), off.findings
    assert {r.fqn: r.grad_max_abs_diff for r in off if r.fqn != "w.bias"} == {"w.weight": 0.0, "input[0]": 0.0}


def test_keyword_inputs_and_grad_mode_off():
    """A keyword input that requires grad gets a row under its name; with grad mode off there is
    no backward: the check says so instead of failing."""
    model = C.factory_inner_autocast_off()
    rep = validate_backward(model, {"x": n2_input()}, lambda o: o.sum(), numeric=True, autocast_dtype="bf16")
    assert {"x", "w.weight"} <= set(mismatches(rep)), rep.findings
    off = validate_backward(model, {"x": n2_input()}, lambda o: o.sum(), numeric=True, grad_enabled=False)
    assert not mismatches(off) and any("no gradients to compare" in n for n in off.notes), off.notes


def test_wrong_graph_and_wrong_compiled_code_are_told_apart():
    """A wrong decomposition makes the AOT graph itself wrong (its output and producing node are
    named); a backward compiler that doubles what its graph computes is blamed on the backend; a
    non-AOT backend gets an aot_eager re-run that matches eager."""
    aten = torch.ops.aten
    boxed = lambda gm, _i: make_boxed_func(gm.forward)  # noqa: E731
    wrong_graph = aot_autograd(fw_compiler=boxed, decompositions={
        aten.threshold_backward.default: lambda grad, _out, _threshold: grad * 2})

    def doubling(gm, _inputs):
        def run(args):
            return [g * 2 if isinstance(g, torch.Tensor) else g for g in gm(*args)]

        run._boxed_call = True
        return run

    torch.manual_seed(0)
    model = C.DetachInMiddle()
    tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))
    rep = validate_backward(model, (tokens,), lambda o: o.sum(), numeric=True, backend=wrong_graph)
    found = mismatches(rep)
    assert "blk1.weight" in found and "head.weight" not in found and "blk2.weight" not in found, rep.findings
    f = found["blk1.weight"]
    blk1_line = int(C.line_of("G5-cut").split(":")[1]) - 1  # h = torch.relu(self.blk1(h)), the line above
    assert "is computed by" in f.message and f.node and f.source == f"grad_cases.py:{blk1_line}", f
    rep = validate_backward(model, (tokens,), lambda o: o.sum(), numeric=True,
                            backend=aot_autograd(fw_compiler=boxed, bw_compiler=doubling))
    found = mismatches(rep)
    assert "head.weight" in found and "backend's compiled code" in found["head.weight"].message, rep.findings

    def scaled(gm, _inputs):  # not AOTAutograd-based: its graphs cannot be recorded
        return lambda *args: [o * 1.5 for o in gm(*args)]

    rep = validate_backward(model, (tokens,), lambda o: o.sum(), numeric=True, backend=scaled)
    f = mismatches(rep)["head.weight"]
    assert "aot_eager re-run matches eager" in f.message and "report it against the backend" in f.fix, f


def test_cli_numeric_autocast():
    runner = CliRunner()
    base = ["check-grads", "--model", N2, "--inputs", "bfloat16[4,64]", "--numeric", "--allow", "w.bias"]
    res = runner.invoke(cli, [*base, "--autocast", "bfloat16"])
    assert res.exit_code == 1, res.output
    assert "GRAD_MISMATCH" in res.output and "computes in bfloat16" in res.output and C.line_of("N2-mm") in res.output
    res = runner.invoke(cli, [*base, "--autocast", "bfloat16", "--autocast-device", "cpu", "--format", "json"])
    data = json.loads(res.stdout)
    assert res.exit_code == 1 and data["findings"][0]["params"] == ["w.weight"], data["findings"]
    assert data["findings"][0]["node"].startswith("mm")
    res = runner.invoke(cli, base)
    assert res.exit_code == 0, res.output
    for bad in (["--autocast", "int64"], ["--autocast", "nonsense"]):
        res = runner.invoke(cli, [*base, *bad])
        assert res.exit_code == 2 and "error:" in res.output, res.output
    res = runner.invoke(cli, ["check-grads", "--model", N2, "--inputs", "bfloat16[4,64]", "--autocast", "bfloat16"])
    assert res.exit_code == 2 and "--numeric" in res.output, "--autocast alone is a usage error"


@pytest.fixture
def context_store(tmp_path):
    """Runs whose Dynamo graphs carry the context record the capture agent writes (``autocast``
    list and ``grad_enabled`` in graphs.meta_json), and one whose graphs carry none."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(64, 64))  # any graph: the record is in meta_json
    path = tmp_path / "ctx.db"
    bf16 = {"autocast": [{"device": "cpu", "dtype": "bfloat16", "enabled": True}], "grad_enabled": True}
    for run, metas in (("amp", [bf16, bf16]), ("mixed", [bf16, {"autocast": [], "grad_enabled": True}]),
                       ("plain", [{}])):
        writer = StoreWriter(path, run, rank=0, world_size=1)
        for k, meta in enumerate(metas):
            writer.write_graph(record_graph(gm), kind="dynamo", name=f"g{k}", compile_id=f"{k}/0", meta=meta)
    return path


def test_context_from_a_captured_run(context_store):
    from sqlalchemy.orm import Session

    from graphdeck.analysis.gradients.core import find_run
    from graphdeck.analysis.gradients.numeric import caller_context, context_options
    from graphdeck.store.db import open_engine

    with Session(open_engine(context_store, read_only=True)) as s:
        amp = caller_context(s, find_run(s, "amp"))
        mixed = caller_context(s, find_run(s, "mixed"))
        plain = caller_context(s, find_run(s, "plain"))
    assert amp.autocast == [{"device": "cpu", "dtype": "bfloat16"}] and amp.grad_enabled is True and not amp.notes
    assert plain is None
    assert mixed.autocast and "1 other Dynamo graph(s) ran under a different context" in mixed.notes[0]
    kwargs, notes = context_options(amp, (n2_input(),))
    assert kwargs == {"autocast_dtype": "bfloat16", "autocast_device": "cpu", "grad_enabled": True}, kwargs
    assert context_options(amp, (n2_input(),), autocast="off")[0]["autocast_dtype"] is None, "the flag wins"

    runner = CliRunner()
    base = ["check-grads", "--model", N2, "--inputs", "bfloat16[4,64]", "--numeric", "--allow", "w.bias",
            "--context-from", str(context_store), "--run"]
    res = runner.invoke(cli, [*base, "amp"])
    assert res.exit_code == 1 and "computes in bfloat16" in res.stdout, res.output
    assert "autocast(cpu, bfloat16) from run 'amp'" in res.stderr, res.stderr
    res = runner.invoke(cli, [*base, "plain"])
    assert res.exit_code == 0 and "records no autocast/grad mode" in res.stderr, res.output
    res = runner.invoke(cli, [*base, "plain", "--autocast", "bfloat16"])
    assert res.exit_code == 1, "with no record, the flag applies"
    assert runner.invoke(cli, [*base, "nope"]).exit_code == 2, "unknown run"
    res = runner.invoke(cli, ["check-grads", "--model", N2, "--inputs", "bfloat16[4,64]", "--numeric",
                              "--context-from", str(context_store)])
    assert res.exit_code == 2 and "--run" in res.output
