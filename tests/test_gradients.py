"""Gradient-path validation on the cases of ../shared/cases/gradient-paths.md (single process):
graph mode over real captures (torch.compile with aot_eager through the graphdeck backend, one
forward + backward) and eager mode over the same modules must give the same diagnosis.
The 2-rank DDP cases (G1, G4, and G2/G3/G5 under DDP) are in test_gradients_ddp.py."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck import validate_backward
from graphdeck.capture import Agent
from graphdeck.cli import main as cli
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph
from tests import grad_cases as C
from tests.conftest import LiveServer

X = torch.randn(4, C.D, generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))

# case name -> (model factory, inputs, loss)
CASES = {
    "g2": (C.TwoHeads, (X,), C.g2_loss),
    "g3": (C.NoGradHelper, (X,), None),
    "g4_empty": (C.BranchOnBatch, (X, torch.zeros(0, dtype=torch.long)), None),
    "g5": (C.DetachInMiddle, (TOKENS,), None),
    "g6": (C.TiedLM, (torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0)),), None),
    "g7": (C.PartlyUsedChunk, (X,), C.g7_loss),
    "g8": (C.ArgmaxRouter, (X,), None),
    "g8_weighted": (lambda: C.ArgmaxRouter(weighted=True), (X,), None),
    "g9": (C.DownUp, (torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(0)),), C.g9_loss),
}


def _loss(fn):
    return fn or (lambda out: out.sum())


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Every case captured once into one store (one run per case); what each step raised is kept."""
    path = tmp_path_factory.mktemp("grads") / "cases.db"
    raised = {}
    for name, (factory, inputs, loss) in CASES.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = factory()
        agent = Agent(store=path, run=name)
        agent.watch(model)
        compiled = torch.compile(model, backend=agent.backend("aot_eager"))
        try:
            _loss(loss)(compiled(*inputs)).backward()
        except RuntimeError as exc:
            raised[name] = str(exc)
        agent.close()
    torch._dynamo.reset()
    return path, raised


def graph(store, name):
    return validate_backward(store[0], name)


def eager(name):
    factory, inputs, loss = CASES[name]
    torch.manual_seed(0)
    return validate_backward(factory(), inputs, _loss(loss))


def by_fqn(rep):
    return {r.fqn: r for r in rep}


MODES = ["graph", "eager"]


def report(mode, store, name):
    return graph(store, name) if mode == "graph" else eager(name)


@pytest.mark.parametrize("mode", MODES)
def test_g2_output_unused_by_the_loss_is_a_dead_end(mode, store):
    rows = by_fqn(report(mode, store, "g2"))
    for fqn in ("tgt_head.weight", "tgt_head.bias"):
        r = rows[fqn]
        assert r.status == "DEAD_END" and r.paths == 0, f"G2 ({mode}): {fqn} feeds only tgt_logits: {r}"
        assert r.cut.kind == "dead_output" and r.cut.source == C.line_of("G2-return"), \
            f"the cut names the line returning tgt_logits: {r.cut}"
    for fqn in ("trunk.0.weight", "trunk.0.bias", "src_head.weight", "src_head.bias"):
        assert rows[fqn].status == "OK" and rows[fqn].paths == 1, f"G2 ({mode}): {fqn} through src_head: {rows[fqn]}"


@pytest.mark.parametrize("mode", MODES)
def test_g3_no_grad_helper_cuts_the_backbone(mode, store):
    rep = report(mode, store, "g3")
    rows = by_fqn(rep)
    for fqn in ("backbone.0.weight", "backbone.0.bias", "backbone.1.weight", "backbone.1.bias"):
        r = rows[fqn]
        assert r.status == "NO_GRAD", f"G3 ({mode}): {fqn} runs under the helper's no_grad: {r}"
        assert r.cut.kind == "no_grad" and r.cut.region == C.line_of("G3-region"), \
            f"the cut names the helper's `with torch.no_grad()` line: {r.cut}"
        assert r.cut.source == C.line_of("G3-cut") and r.cut.module_path == fqn.rsplit(".", 1)[0].replace(".", "/")
    assert rows["backbone.0.weight"].cut.op.endswith("linear"), "the backbone's first linear is the cut"
    assert rows["head.weight"].status == rows["head.bias"].status == "OK"
    assert not rep.ok


def test_g3_compiled_graph_shows_the_grad_mode_region(store):
    from graphdeck.store.schema import Run

    with Session(open_engine(store[0], read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "g3"))
        code = s.scalar(select(Graph.code).where(Graph.run_id == run_id, Graph.kind == "dynamo"))
    assert "_set_grad_enabled(False)" in code and "_set_grad_enabled(True)" in code, code


@pytest.mark.parametrize("mode", MODES)
def test_g4_branch_not_taken_is_not_in_graph(mode, store):
    rows = by_fqn(report(mode, store, "g4_empty"))
    assert rows["dn_embed.weight"].status == "NOT_IN_GRAPH", "G4 on the rank with an empty target batch"
    assert rows["main.weight"].status == "OK"


@pytest.mark.parametrize("mode", MODES)
def test_g5_detach_cuts_blk2_only(mode, store):
    rep = report(mode, store, "g5")
    rows = by_fqn(rep)
    assert {k for k, r in rows.items() if r.status != "OK"} == {"blk2.weight", "blk2.bias"}, \
        f"G5 ({mode}): only blk2 is behind the detach; blk1 reaches the loss through aux"
    cut = rows["blk2.weight"].cut
    assert cut.kind == "detach" and cut.source == C.line_of("G5-cut") and "detach" in cut.code
    assert all(rows[k].paths == 1 for k in ("emb.weight", "blk1.weight", "head.weight", "aux.weight"))


def test_g5_cut_links_to_the_graph_node(store):
    r = by_fqn(graph(store, "g5"))["blk2.weight"]
    assert r.cut.graph_id in r.graphs and r.cut.node and r.cut.path[-1] == r.cut.node
    assert len(r.cut.path) >= 3, f"placeholder → linear → detach: {r.cut.path}"


@pytest.mark.parametrize("mode", MODES)
def test_g6_tied_weights_are_one_parameter_with_two_paths(mode, store):
    rep = report(mode, store, "g6")
    assert len(rep) == 1, "G6: lm_head.weight and embed.weight are one storage"
    r = rep.rows[0]
    assert r.status == "OK" and sorted(r.aliases) == ["embed.weight", "lm_head.weight"] and r.paths == 2, r
    assert rep.ok


@pytest.mark.parametrize("mode", MODES)
def test_g7_partly_used_chunk_is_ok(mode, store):
    rep = report(mode, store, "g7")
    assert [(r.fqn, r.status, r.paths) for r in rep] == [("proj.weight", "OK", 1), ("proj.bias", "OK", 1)], \
        "G7: the unused half gets a zero slice, not a broken path"
    assert rep.ok


@pytest.mark.parametrize("mode", MODES)
def test_g8_argmax_router_and_its_weighted_fix(mode, store):
    rows = by_fqn(report(mode, store, "g8"))
    for fqn in ("router.weight", "router.bias"):
        r = rows[fqn]
        assert r.status == "NO_GRAD" and r.cut.kind == "integer_output", f"G8 ({mode}): {r}"
        assert r.cut.source == C.line_of("G8-cut") and "argmax" in r.cut.op
    assert all(rows[f"experts.{i}.{p}"].status == "OK" for i in (0, 1) for p in ("weight", "bias"))
    weighted = report(mode, store, "g8_weighted")
    assert weighted.ok and all(r.status == "OK" for r in weighted), "softmax gathered at the choice: router trains"


def test_g9_outputs_of_one_region_feeding_each_other(store):
    path, raised = store
    assert "appears to not have been used in the graph" in raised.get("g9", ""), \
        f"compiled, autograd.grad(out, z) fails for real: {raised.get('g9')!r}"
    rep = graph(store, "g9")
    found = [f for f in rep.findings if f.kind == "OUTPUT_NOT_ANCESTOR"]
    assert len(found) == 1 and found[0].severity == "warning", rep.findings
    f = found[0]
    assert f.node == "z" and f.source == C.line_of("G9-z") and "graph break" in f.fix, f
    assert f.graph_id is not None and "z →" in f.message
    assert eager("g9").ok, "eagerly the same loss works"


def test_numeric_mode_finds_wrong_compiled_gradients():
    """A compiler whose backward scales every gradient by 2 (gradients present but wrong)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def bad_bw(gm, _inputs):
        def run(args):
            return [g * 2 if isinstance(g, torch.Tensor) else g for g in gm(*args)]

        run._boxed_call = True
        return run

    buggy = aot_autograd(fw_compiler=lambda gm, _i: make_boxed_func(gm.forward), bw_compiler=bad_bw)
    torch.manual_seed(0)
    model = C.DetachInMiddle()
    good = validate_backward(model, (TOKENS,), lambda o: o.sum(), numeric=True, backend="aot_eager")
    assert not [f for f in good.findings if f.kind == "GRAD_MISMATCH"]
    assert all(r.grad_max_abs_diff in (None, 0.0) or r.grad_max_abs_diff < 1e-5 for r in good)
    bad = validate_backward(model, (TOKENS,), lambda o: o.sum(), numeric=True, backend=buggy)
    mismatch = [f for f in bad.findings if f.kind == "GRAD_MISMATCH"]
    assert mismatch and "head.weight" in mismatch[0].params and "blk2.weight" not in mismatch[0].params, mismatch
    assert not bad.ok


def test_report_renderings_and_allow(store):
    rep = graph(store, "g5")
    data = json.loads(rep.to_json())
    assert data["ok"] is False and data["summary"]["NO_GRAD"] == 2 and data["mode"] == "graph"
    blk2 = next(p for p in data["params"] if p["fqn"] == "blk2.weight")
    assert blk2["cut"]["kind"] == "detach" and blk2["failing"] is True
    root = ET.fromstring(rep.to_junit())
    failures = root.findall(".//testcase/failure")
    assert {f.get("type") for f in failures} == {"NO_GRAD"} and len(failures) == 2
    assert root.get("failures") == "2" and int(root.get("tests")) == len(rep)
    allowed = graph(store, "g5").apply_allow(["blk2.*"])
    assert allowed.ok and all(r.allowed for r in allowed if r.fqn.startswith("blk2"))
    assert len(ET.fromstring(allowed.to_junit()).findall(".//skipped")) == 2
    text = rep.to_text()
    assert text.startswith("gradient paths of g5 (graph mode), ranks [0]: FAIL") and C.line_of("G5-cut") in text


def test_cli_graph_mode_formats_and_exit_codes(store, tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["check-grads", str(store[0]), "--run", "g5"])
    assert res.exit_code == 1 and "blk2.weight" in res.output and C.line_of("G5-cut") in res.output, res.output
    res = runner.invoke(cli, ["check-grads", str(store[0]), "--run", "g5", "--allow", "blk2.*"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["check-grads", str(store[0]), "--run", "g7", "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.output)["ok"] is True
    out = tmp_path / "grads.xml"
    res = runner.invoke(cli, ["check-grads", str(store[0]), "--run", "g8", "--format", "junit", "-o", str(out)])
    assert res.exit_code == 1 and ET.parse(out).getroot().get("failures") == "2"
    assert runner.invoke(cli, ["check-grads", str(store[0]), "--run", "nope"]).exit_code == 2, "unknown run"
    assert runner.invoke(cli, ["check-grads", str(tmp_path / "missing.db"), "--run", "g5"]).exit_code == 2
    assert runner.invoke(cli, ["check-grads", str(store[0])]).exit_code == 2, "neither --run nor --model"


def test_cli_eager_mode_over_a_factory():
    runner = CliRunner()
    res = runner.invoke(cli, ["check-grads", "--model", "tests.grad_cases:factory_detach", "--inputs", "int64[4,3]<16"])
    assert res.exit_code == 1 and "NO_GRAD" in res.output and C.line_of("G5-cut") in res.output, res.output
    res = runner.invoke(cli, ["check-grads", "--model", "tests.grad_cases:factory_two_heads", "--inputs", "float32[4,8]",
                              "--loss", "tests.grad_cases:g2_loss", "--format", "json"])
    assert res.exit_code == 1, res.output
    rows = {p["fqn"]: p["status"] for p in json.loads(res.output)["params"]}
    assert rows["tgt_head.weight"] == "DEAD_END" and rows["src_head.weight"] == "OK"
    for bad in (["--inputs", "float32[4,8"], ["--inputs", "nodtype[2]"]):
        res = runner.invoke(cli, ["check-grads", "--model", "tests.grad_cases:factory_detach", *bad])
        assert res.exit_code == 2 and "error:" in res.output, res.output
    res = runner.invoke(cli, ["check-grads", "--model", "tests.grad_cases:no_such", "--inputs", "float32[1]"])
    assert res.exit_code == 2


def test_api_report_filters_and_junit(store):
    with LiveServer(store[0]) as srv:
        import httpx

        with httpx.Client(base_url=srv.url, timeout=30) as api:
            full = api.get("/api/runs/g5/gradients").json()
            assert full["ok"] is False and len(full["params"]) == 9 and full["summary"]["NO_GRAD"] == 2
            only = api.get("/api/runs/g5/gradients", params={"status": "NO_GRAD", "rank": 0}).json()
            assert [p["fqn"] for p in only["params"]] == ["blk2.weight", "blk2.bias"]
            assert only["summary"] == full["summary"], "filters narrow rows, never the verdict"
            bad = api.get("/api/runs/g5/gradients", params={"status": "BOGUS"})
            assert bad.status_code == 400 and bad.json()["ok"] is False and "BOGUS" in bad.json()["error"]
            allowed = api.get("/api/runs/g5/gradients", params={"allow": "blk2.*"}).json()
            assert allowed["ok"] is True
            junit = api.get("/api/runs/g5/gradients.junit")
            assert junit.headers["content-type"].startswith("application/xml")
            assert ET.fromstring(junit.text).get("failures") == "2"
            assert api.get("/api/runs/nope/gradients").status_code == 404


def test_collectives_in_the_backward_graph(tmp_path):
    """A backward graph that all-reduces gradients in-graph (as compiled autograd with
    python_reducer or FSDP2 produce): one gradient skips the reduction, one all_reduce is never
    waited on. Real torch.fx graphs with the _c10d_functional ops, written by the capture's writer."""
    from graphdeck.capture.fxrecord import record_graph
    from graphdeck.capture.writer import IOBinding, StoreWriter

    aten, funcol = torch.ops.aten, torch.ops._c10d_functional
    fw = torch.fx.Graph()
    x, w1, w2, w3 = (fw.placeholder(n) for n in ("x", "w1", "w2", "w3"))
    fw.output((fw.call_function(aten.relu.default, (fw.call_function(aten.mm.default, (x, w1)),)),
               fw.call_function(aten.mm.default, (x, w2)), fw.call_function(aten.mm.default, (x, w3))))
    bw = torch.fx.Graph()
    g, xs = bw.placeholder("tangents_1"), bw.placeholder("x")
    grads = [bw.call_function(aten.mm.default, (xs, g)) for _ in range(3)]
    reduced1 = bw.call_function(funcol.wait_tensor.default,
                                (bw.call_function(funcol.all_reduce.default, (grads[0], "sum", "0")),))
    bw.call_function(funcol.all_reduce.default, (grads[2], "sum", "0"))  # never waited on
    bw.output((reduced1, grads[1], grads[2]))
    writer = StoreWriter(tmp_path / "c.db", "coll", rank=0, world_size=2)
    writer.write_params([{"fqn": f, "kind": "parameter", "storage_key": f, "shape": [4, 4], "dtype": "float32",
                          "numel": 16, "size_bytes": 64, "requires_grad": True} for f in ("w1", "w2", "w3")])
    names = {"w1": "w1", "w2": "w2", "w3": "w3"}
    fid = writer.write_graph(record_graph(torch.fx.GraphModule(torch.nn.Module(), fw)), kind="dynamo", name="fw",
                             compile_id="0/0", io=[IOBinding("in", k + 1, n, n) for k, n in enumerate(names)],
                             param_by_node=names)
    out_nodes = [reduced1, grads[1], grads[2]]
    writer.write_graph(record_graph(torch.fx.GraphModule(torch.nn.Module(), bw)), kind="aot_backward", name="bw",
                       compile_id="0/0", parent_id=fid,
                       io=[IOBinding("grad", k, out_nodes[k].name, f"w{k + 1}", has_grad=True) for k in range(3)])
    rep = validate_backward(tmp_path / "c.db", "coll")
    kinds = {f.kind: f for f in rep.findings}
    assert set(kinds) == {"COLLECTIVE_NOT_WAITED", "GRAD_NOT_REDUCED"}, rep.findings
    assert kinds["GRAD_NOT_REDUCED"].params == ["w2", "w3"], \
        "only w1's returned gradient comes out of all_reduce+wait; w3's all_reduce result is not what is returned"
    assert kinds["COLLECTIVE_NOT_WAITED"].node == "all_reduce_default_1", "the second all_reduce"
    assert {r.fqn: r.reduced for r in rep} == {"w1": True, "w2": False, "w3": False}
    assert not rep.ok


def test_eager_reports_of_two_ranks_combine_into_a_predicted_hang():
    """G4 in eager mode: each rank validates its own batch; combined, the gradient sets differ."""
    from graphdeck.analysis.gradients.report import combine

    torch.manual_seed(0)
    model = C.BranchOnBatch()
    per_rank = [validate_backward(model, (X, targets), lambda out: out.sum(), rank=rank)
                for rank, targets in ((0, torch.zeros(0, dtype=torch.long)), (1, torch.tensor([1, 2])))]
    rep = combine(per_rank, run="g4-eager")
    hang = [f for f in rep.findings if f.kind == "PREDICTED_HANG"]
    assert len(hang) == 1 and hang[0].ranks == {0: "NOT_IN_GRAPH", 1: "OK"}, rep.findings
    assert hang[0].source == C.line_of("G4-branch") and not rep.ok


def test_gpt2_loss_and_logits_outputs_are_not_flagged(captured_store):
    """A region returning (loss, logits) with logits feeding the scalar loss is the common case,
    not G9: only non-scalar outputs feeding other outputs are reported (conftest's GPT-2 run)."""
    rep = validate_backward(captured_store, "tiny")
    assert rep.ok and not [f for f in rep.findings if f.kind == "OUTPUT_NOT_ANCESTOR"], rep.findings
    wte = next(r for r in rep if r.fqn == "transformer.wte.weight")
    assert wte.paths == 2 and sorted(wte.aliases) == ["lm_head.weight", "transformer.wte.weight"]


def test_a_run_without_parameters_does_not_pass(tmp_path):
    """A CI gate over a run with nothing to check (only a trace, or logs without parameter
    records) fails with NOTHING_CHECKED instead of passing vacuously."""
    import subprocess
    import sys

    from graphdeck.store.db import get_or_create_run, open_engine, write_session

    store = tmp_path / "empty.db"
    engine = open_engine(store)
    with write_session(engine) as s:
        get_or_create_run(s, "job")
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-grads", str(store), "--run", "job"],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NOTHING_CHECKED" in proc.stdout and "nothing was checked" in proc.stdout
