"""Run-time gradient evidence (issue 17): what arrived, per step and rank, and verdicts from it.

Single process: a compiled and an eager model whose box head's loss term is skipped at step 3 only
(reported from step 3, not step 0; identical steps compressed into few rows); a job that dies by
``os._exit`` keeps every distinct step state it saw. Two gloo ranks (tests/grad_evidence_job.py,
three torchrun jobs at once): compiled DDP where rank 1 never has positives (zero-filled, no
error, named consequence), the same under eager DDP (the reducer error and the hang predicted),
and reentrant checkpointing with a LoRA adapter used twice ("marked ready twice", the checkpointed
module named, no NO_GRAD), that job dying without ``close()``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import text

from graphdeck import validate_backward
from graphdeck.capture import Agent
from graphdeck.cli import main as cli
from graphdeck.store.db import open_engine
from tests.conftest import run_python

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.grad_evidence_job import Detector, detection_loss  # noqa: E402
from tests.launch import Ranks, wait_all  # noqa: E402


def _train(store, run, *, compiled: bool, steps: int, skip_step: int | None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Detector()
    agent = Agent(store=store, run=run)
    agent.watch(model)
    fn = torch.compile(model, backend=agent.backend("aot_eager")) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    labels = torch.tensor([0, 1] * 3)
    for step in range(steps):
        cls_logits, boxes = fn(torch.randn(6, 8))
        detection_loss(cls_logits, boxes, labels, step, skip_step).backward()
        opt.step()
        opt.zero_grad()
    agent.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_head_skipped_at_step_3_is_reported_from_step_3(tmp_path, compiled):
    store = tmp_path / "s.db"
    _train(store, "skip3", compiled=compiled, steps=8, skip_step=3)
    rep = validate_backward(store, "skip3")
    assert rep.verdict == "FAIL", rep.to_text()
    bad = {r.fqn: r for r in rep if r.status != "OK"}
    assert set(bad) == {"box_head.weight", "box_head.bias"}, rep.to_text()
    for r in bad.values():
        assert r.first_bad_step == 3
        assert r.steps == [[0, 2, "ok"], [3, 3, "zero" if compiled else "none"], [4, 7, "ok"]], r.steps
        assert r.status == ("DEAD_END" if compiled else "NO_GRAD")
        assert "step(s) 3" in r.reason
    if compiled:
        assert bad["box_head.weight"].zero_filled
        assert "loss.backward" in bad["box_head.weight"].reason or "detection_loss" in bad["box_head.weight"].reason
    assert rep.coverage["steps"][0] == {"first": 0, "last": 7, "backward_passes": 8, "numbered_by": "optimizer",
                                        "records": 3}
    # Runs of identical steps are one row each: 8 steps -> 3 rows, and the store says so.
    with open_engine(store, read_only=True).connect() as c:
        rows = c.execute(text("SELECT step_first, step_last, n_backward, closed FROM grad_steps ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(0, 2, 3, True), (3, 3, 1, True), (4, 7, 4, True)]
    text_out = rep.to_text()
    assert "steps: 0–2 ok, 3 " in text_out and "saw: rank 0: steps 0–7 (8 backward)" in text_out


def test_all_steps_healthy_passes_with_coverage(tmp_path):
    store = tmp_path / "s.db"
    _train(store, "ok", compiled=True, steps=3, skip_step=None)
    rep = validate_backward(store, "ok")
    assert rep.verdict == "PASS" and rep.ok, rep.to_text()
    assert rep.coverage["parameter_list"].startswith("the model's own")
    res = CliRunner().invoke(cli, ["check-grads", str(store), "--run", "ok", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["verdict"] == "PASS" and data["coverage"]["steps"]["0"]["backward_passes"] == 3


class _W(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n))


def test_several_watched_models_and_accumulation_over_backward_passes(tmp_path):
    """Three watched models that each hold a ``w`` (names qualified, none read as another's), one
    backward per model and one optimizer step over all: a step's gradient is what its backward
    passes accumulated (NOTE: [Several backward passes in one step]) — the third model skipped at
    step 2 is NO_GRAD at step 2 only, the others OK."""
    torch._dynamo.reset()
    store = tmp_path / "s.db"
    agent = Agent(store=store, run="three")
    mods = [agent.watch(_W(n)) for n in (2, 3, 4)]
    assert agent.watch(mods[0]) is mods[0]  # watching a model again adds no names
    step_fn = torch.compile(lambda m, x: (x @ m.w).sum(), backend=agent.backend("aot_eager"), dynamic=False)
    opt = torch.optim.SGD([m.w for m in mods], lr=0.01)
    for step in range(4):
        for k, m in enumerate(mods):
            if k == 2 and step == 2:
                continue
            step_fn(m, torch.randn(3, m.w.shape[0])).backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    rep = validate_backward(store, "three")
    rows = {r.fqn: r for r in rep}
    assert set(rows) == {"w", "_W[1].w", "_W[2].w"}, rep.to_text()
    assert rows["w"].status == rows["_W[1].w"].status == "OK", rep.to_text()
    assert rows["w"].steps == [[0, 3, "ok"]], rows["w"].steps
    bad = rows["_W[2].w"]
    assert bad.status == "NO_GRAD" and bad.steps == [[0, 1, "ok"], [2, 2, "none"], [3, 3, "ok"]], (bad.steps, rep.to_text())
    assert "step(s) 2 " in bad.reason and rep.coverage["steps"][0]["backward_passes"] == 11, rep.to_text()


JOB_DIES = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from graphdeck.capture import Agent
from tests.grad_evidence_job import Detector, detection_loss
model = Detector()
agent = Agent(store=sys.argv[1], run="dies")
agent.watch(model)
fn = torch.compile(model, backend=agent.backend("aot_eager"))
labels = torch.tensor([0, 1] * 3)
for step in range(5):
    c, b = fn(torch.randn(6, 8))
    detection_loss(c, b, labels, step, skip_step=2).backward()
os._exit(0)  # no close(), no atexit
"""


def test_a_job_that_dies_keeps_every_distinct_state(tmp_path):
    store = tmp_path / "s.db"
    proc = run_python(JOB_DIES.format(repo=str(REPO)), str(store))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = validate_backward(store, "dies")
    bad = {r.fqn: r for r in rep if r.status != "OK"}
    assert set(bad) == {"box_head.weight", "box_head.bias"}, rep.to_text()
    assert bad["box_head.bias"].first_bad_step == 2
    assert any("did not finish" in n for n in rep.coverage.get("notes", [])), rep.coverage


# ----------------------------------------------------------------------------- two gloo ranks
_JOB = REPO / "tests" / "grad_evidence_job.py"
_BRANCH = next(f"{_JOB}:{i} in detection_loss: `if pos.any() and step != skip_step:`"
               for i, line in enumerate(_JOB.read_text().splitlines(), 1) if line.strip() == "if pos.any() and step != skip_step:")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = {group: Ranks([REPO / "tests" / "grad_evidence_job.py", out / f"{group}.db", group], 2, env=env, cwd=REPO,
                         stderr_to_stdout=True) for group in ("healthy", "eager", "ckpt")}
    return {group: (out / f"{group}.db", p.returncode, p.stdout) for group, p in wait_all(jobs, 600).items()}


@pytest.mark.slow
def test_compiled_ddp_zero_filled_head_fails_with_the_consequence(jobs):
    store, rc, log = jobs["healthy"]
    assert rc == 0, log[-4000:]  # the job itself runs: nothing raises
    rep = validate_backward(store, "positives")
    assert rep.verdict == "FAIL", rep.to_text()
    bad = {(r.rank, r.fqn) for r in rep if r.status != "OK"}
    assert bad == {(1, "box_head.weight"), (1, "box_head.bias")}, rep.to_text()
    div = [f for f in rep.findings if f.kind == "RANK_DIVERGENCE"]
    assert len(div) == 1 and div[0].params == ["box_head.bias", "box_head.weight"]
    msg = div[0].message
    assert "rank(s) [0]" in msg and "rank(s) [1]" in msg and "first at step 0" in msg
    assert "zero" in msg and "no error" in msg  # what this job does: rank 1 silently averages zeros
    assert "grad_evidence_job.py:102" in msg  # the loss.backward() line of the step that built the loss
    assert "cls_logits, boxes = step_fn(x)" in msg  # where the skipped output came from
    # Issue 40 item 1: and the loss code's branch that skipped it on rank 1 (NOTE: [The branch that
    # skipped an output]), named in the finding and in the rows of the rank that skipped it.
    assert _BRANCH in msg and div[0].source == _BRANCH.split(" in ")[0], msg
    assert all(_BRANCH in r.reason for r in rep if r.status != "OK"), rep.to_text()
    assert not any(f.kind == "PREDICTED_HANG" for f in rep.findings), "the compiled job did not hang"
    # The same model with the box term skipped at step 3 on every rank: reported from step 3.
    rep3 = validate_backward(store, "step3")
    assert {r.first_bad_step for r in rep3 if r.status != "OK"} == {3}, rep3.to_text()
    assert all(_BRANCH in r.reason for r in rep3 if r.status != "OK"), rep3.to_text()


@pytest.mark.slow
def test_eager_ddp_same_finding_and_the_reducer_error(jobs):
    store, rc, log = jobs["eager"]
    assert rc != 0 and "Expected to have finished reduction" in log, log[-4000:]
    rep = validate_backward(store, "positives_eager")
    div = [f for f in rep.findings if f.kind == "RANK_DIVERGENCE"]
    assert len(div) == 1 and div[0].params == ["box_head.bias", "box_head.weight"], rep.to_text()
    assert "Expected to have finished reduction" in div[0].message and "at step 1" in div[0].message
    assert "grad_evidence_job.py:102" in div[0].message
    assert _BRANCH in div[0].message  # eager DDP: rank 1's backward left the box head without a gradient there
    assert any(f.kind == "PREDICTED_HANG" for f in rep.findings)  # rank 0 waits in the unmatched all-reduce
    assert {(r.rank, r.fqn) for r in rep if r.status == "NO_GRAD"} == {(1, "box_head.weight"), (1, "box_head.bias")}


@pytest.mark.slow
def test_reentrant_checkpoint_reuse_predicts_ready_twice(jobs):
    store, rc, log = jobs["ckpt"]
    assert rc != 0 and "mark a variable ready only once" in log, log[-4000:]
    rep = validate_backward(store, "ckpt")  # the job died in its first backward, without close()
    twice = [f for f in rep.findings if f.kind == "READY_TWICE"]
    assert len(twice) == 1 and twice[0].severity == "error", rep.to_text()
    assert "block.lora_b.weight" in twice[0].params
    assert "block (LoRALinear.forward" in twice[0].message and "mark a variable ready only once" in twice[0].message
    assert not [r for r in rep if r.status in ("NO_GRAD", "NOT_IN_GRAPH")], rep.to_text()
    assert {r.fqn for r in rep if r.status == "FROZEN"} == {"block.base.weight", "block.base.bias"}


class _WithTemperature(torch.nn.Module):
    """The detector, compiled alone, and an eager temperature that scales its loss."""

    def __init__(self):
        super().__init__()
        self.det = Detector()
        self.temp = torch.nn.Parameter(torch.ones(()))


def _watched(store, run: str, make, part: str):
    """(model, agent, the model's ``part`` compiled through the agent): a fresh Dynamo, seed 0,
    the whole model watched. ``make``: a callable building the model (after the seed)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    agent = Agent(store=store, run=run)
    agent.watch(model)
    return model, agent, torch.compile(getattr(model, part), backend=agent.backend("aot_eager"))


def test_steady_mode_drops_the_hooks_and_still_sees_a_change(tmp_path):
    """After 3 identical steps of a compiled model the per-parameter hooks come off (NOTE: [Steady
    mode]); in steady mode a parameter whose gradient stops arriving at step 5 (an eager one) is
    NO_GRAD at step 5, and after steady mode comes back a head skipped at step 12 is zero-filled
    at step 12 — each reported at its own step, the next steps OK again. Steady mode keeps no
    hook on any parameter and writes no row while nothing changes."""
    store = tmp_path / "s.db"
    model, agent, fn = _watched(store, "steady", _WithTemperature, "det")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    labels = torch.tensor([0, 1] * 3)
    steady_at, hooks = [], []
    for step in range(16):
        cls_logits, boxes = fn(torch.randn(6, 8))
        loss = detection_loss(cls_logits, boxes, labels, step, skip_step=12)
        (loss * model.temp if step != 5 else loss).backward()
        opt.step()
        opt.zero_grad()
        steady_at.append(agent._evidence._steady)
        hooks.append(len(agent._evidence._handles))
        if agent._evidence._steady:  # no hook left on any parameter, torch's own C++ hook included
            assert all(p._backward_hooks is None and p._post_accumulate_grad_hooks is None for p in model.parameters())
    agent.close()
    assert steady_at[3:5] == [True] * 2 and steady_at[5] is False, steady_at  # the change ends steady mode
    assert steady_at[9:12] == [True] * 3 and steady_at[12] is False, steady_at  # back after 3 equal steps
    assert hooks[4] == 0 and hooks[5] == 7 and hooks[10] == 0, hooks
    rep = validate_backward(store, "steady")
    temp = next(r for r in rep if r.fqn == "temp")
    assert temp.status == "NO_GRAD" and temp.first_bad_step == 5, rep.to_text()
    assert temp.steps == [[0, 4, "ok"], [5, 5, "none"], [6, 15, "ok"]], temp.steps
    row = next(r for r in rep if r.fqn == "det.box_head.weight")
    assert row.steps == [[0, 11, "ok"], [12, 12, "zero"], [13, 15, "ok"]], row.steps
    assert rep.coverage["steps"][0]["backward_passes"] == 16
    with open_engine(store, read_only=True).connect() as c:
        rows = c.execute(text("SELECT step_first, step_last, n_backward FROM grad_steps ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(0, 4, 5), (5, 5, 1), (6, 11, 6), (12, 12, 1), (13, 15, 3)], rows


def test_watching_keeps_no_replaced_parameter_alive(tmp_path):
    """NOTE: [Hooks stay on the tensor]: a parameter replaced after ``watch()`` (as ``fully_shard``
    replaces every one) is freed as it would be without the capture, in full mode and in steady mode."""
    import gc
    import weakref

    torch._dynamo.reset()
    model = _HeadsAndTail()
    agent = Agent(store=tmp_path / "s.db", run="free")
    agent.watch(model)
    old = weakref.ref(model.body.weight)
    model.body.weight = torch.nn.Parameter(torch.zeros(8, 8))
    gc.collect()
    assert old() is None, "the capture holds a parameter the model dropped"
    heads = torch.compile(model.heads, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):  # full mode, then steady mode
        a, b = heads(torch.randn(4, 8))
        (a.sum() + b.sum()).backward()
        opt.step()
        opt.zero_grad()
    assert agent._evidence._steady
    old = weakref.ref(model.h1.weight)
    del opt, a, b  # the job's own references (its outputs' autograd nodes reach the parameters)
    model.h1.weight = torch.nn.Parameter(torch.zeros(2, 8))
    gc.collect()
    assert old() is None, "the capture holds a parameter the model dropped after compiled steps"
    agent.close()


class _HeadsAndTail(torch.nn.Module):
    """Two compiled graphs a step: the heads (two outputs) and the loss (one output, ``tail``)."""

    def __init__(self):
        super().__init__()
        self.body, self.h1, self.h2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
        self.tail = torch.nn.Linear(2, 1)

    def heads(self, x):
        h = self.body(x)
        return self.h1(h), self.h2(h)

    def loss(self, a, b):
        return (self.tail(a) + b.sum(-1, keepdim=True)).pow(2).mean()


def test_steady_mode_leaves_a_one_output_graph_unwatched_and_still_judges_every_step(tmp_path):
    """NOTE: [Steady mode]: the one-output loss graph gets no pre-hook in steady mode, yet its
    parameters' gradient stopping at step 6 is NO_GRAD at step 6, and a step whose backward
    reaches only that graph (no window opened by a hook) is still judged, at its optimizer step:
    the heads' parameters NO_GRAD at step 11."""
    store = tmp_path / "s.db"
    model, agent, heads = _watched(store, "single", _HeadsAndTail, "heads")
    loss_of = torch.compile(model.loss, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    skipping = []
    for step in range(16):
        a, b = heads(torch.randn(4, 8))
        if step == 6:
            loss = (a.pow(2).sum() + b.pow(2).sum())  # the tail is not used: no gradient for it
        elif step == 11:
            loss = loss_of(a.detach(), b.detach())  # only the loss graph's backward runs
        else:
            loss = loss_of(a, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        chk = agent._evidence._check
        skipping.append(chk is not None and chk.skip_single)
    agent.close()
    assert skipping[3:6] == [True] * 3 and not skipping[6], skipping  # steady, skipping the loss graph
    assert skipping == [False] * 3 + [True] * 3 + [False] * 4 + [True] + [False] * 4 + [True], skipping
    rep = validate_backward(store, "single")
    tail = next(r for r in rep if r.fqn == "tail.weight")
    assert tail.status == "NO_GRAD" and tail.steps == [[0, 5, "ok"], [6, 6, "none"], [7, 15, "ok"]], tail.steps
    body = next(r for r in rep if r.fqn == "body.weight")
    assert body.steps == [[0, 10, "ok"], [11, 11, "none"], [12, 15, "ok"]], body.steps
    assert rep.coverage["steps"][0]["backward_passes"] == 16


def test_autograd_grad_passes_fill_no_gradient_in_full_and_steady_mode(tmp_path):
    """NOTE: [Backward passes that fill no .grad]: each step first takes ``torch.autograd.grad``
    of the heads' outputs with respect to the input (a saliency read) and, every third step, to a
    parameter (the gradient hooks run for a leaf it captures), then ``backward()``. Neither pass
    accumulates: no step reads NO_GRAD, in full mode (the engine asked per task) or steady mode
    (a window that filled no ``.grad`` dropped at its end, steady mode kept); a real gap (step 12,
    the tail unused) is still NO_GRAD at that step."""
    store = tmp_path / "s.db"
    model, agent, heads = _watched(store, "agrad", _HeadsAndTail, "heads")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steady = []
    for step in range(16):
        x = torch.randn(4, 8, requires_grad=True)
        a, b = heads(x)
        (gx,) = torch.autograd.grad(a.sum() + b.sum(), x, retain_graph=True)
        if step % 3 == 0:
            torch.autograd.grad(a.sum(), model.h1.weight, retain_graph=True)
        loss = (a.pow(2).sum() + b.pow(2).sum()) if step == 12 else model.loss(a, b)
        (loss + 0 * gx.sum()).backward()
        opt.step()
        opt.zero_grad()
        steady.append(agent._evidence._steady)
    agent.close()
    assert all(steady[4:12]) and not steady[12], steady  # the autograd.grad passes do not end steady mode
    rep = validate_backward(store, "agrad")
    for r in rep:
        want = [[0, 11, "ok"], [12, 12, "none"], [13, 15, "ok"]] if r.fqn.startswith("tail.") else [[0, 15, "ok"]]
        assert r.steps == want, (r.fqn, r.steps)


def test_steady_mode_leaves_the_jobs_own_parameter_hooks_alone(tmp_path):
    """NOTE: [Hooks stay on the tensor]: steady mode clears torch's hook only on a tensor where no
    other hook is left: a hook the job put on a parameter (before or after ``watch()``) still runs
    at every step, and that parameter keeps its hook dict while the others' are cleared."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _HeadsAndTail()
    before, after = [], []
    model.h1.weight.register_hook(lambda g: before.append(1))
    agent = Agent(store=tmp_path / "s.db", run="own-hooks")
    agent.watch(model)
    model.h2.weight.register_hook(lambda g: after.append(1))
    heads = torch.compile(model.heads, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(10):
        model.loss(*heads(torch.randn(4, 8))).backward()
        opt.step()
        opt.zero_grad()
    assert agent._evidence._steady
    assert len(before) == len(after) == 10
    assert model.h1.weight._backward_hooks and model.h2.weight._backward_hooks
    assert model.body.weight._backward_hooks is None and model.tail.weight._backward_hooks is None
    agent.close()


def test_steady_baseline_reads_only_what_the_optimizers_zero_grad_did_not_clear(tmp_path):
    """NOTE: [Steady mode]: the optimizer's own ``zero_grad(set_to_none=True)`` tells which
    tensors need no baseline read; a parameter outside the optimizer (``temp``, its gradient
    accumulated and never cleared) is still read, so its gradient stopping at step 8 is NO_GRAD at
    step 8. ``set_to_none=False`` clears nothing; a class with its own ``zero_grad`` is not
    wrapped; the wrapper keeps no dropped optimizer alive."""
    import gc
    import weakref

    model, agent, fn = _watched(tmp_path / "s.db", "zero", _WithTemperature, "det")
    ev = agent._evidence
    opt = torch.optim.SGD(model.det.parameters(), lr=0.01)  # temp: not in the optimizer
    labels = torch.tensor([0, 1] * 3)
    stale = []
    for step in range(12):
        loss = detection_loss(*fn(torch.randn(6, 8)), labels, step, None)
        (loss * model.temp if step != 8 else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=step != 10)
        stale.append(None if ev._check is None else ev._check.stale)
    assert "zero_grad" in vars(opt) and opt.zero_grad.__name__ == "zero_grad"
    assert stale[4:8] == [frozenset({id(model.temp)})] * 4, stale  # steady: only temp is read
    assert stale[10] is None, "set_to_none=False clears nothing"
    agent.close()
    temp = next(r for r in validate_backward(tmp_path / "s.db", "zero") if r.fqn == "temp")
    assert temp.status == "NO_GRAD" and temp.steps == [[0, 7, "ok"], [8, 8, "none"], [9, 11, "ok"]], temp.steps

    class OwnZero(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            super().zero_grad(set_to_none)

    own = OwnZero(model.parameters(), lr=0.01)
    ev._on_step_pre(own, (), {})
    assert "zero_grad" not in vars(own)
    gone = weakref.ref(opt)
    gc.disable()
    try:
        del opt
        assert gone() is None, "the wrapper holds the optimizer weakly: no cycle"
    finally:
        gc.enable()


def test_combine_renumbers_rank0_reports_and_bad_output_path_is_usage(tmp_path):
    """Eager reports made without a process group all say rank 0: combine() numbers them in order
    (not "rank [0] but not rank [0]"); check-grads -o to an unwritable path exits 2, not 1."""
    from graphdeck.analysis.gradients.report import GradReport, ParamRow, combine

    a = GradReport(mode="eager", run="r", rows=[ParamRow(rank=0, fqn="w", status="OK", paths=1)])
    b = GradReport(mode="eager", run="r", rows=[ParamRow(rank=0, fqn="w", status="NO_GRAD")])
    out = combine([GradReport.from_json(a.to_json()), GradReport.from_json(b.to_json())])
    assert out.ranks == [0, 1] and any("numbered" in n for n in out.notes)
    assert "rank(s) [0] but not on rank(s) [1]" in out.to_text(), out.to_text()
    store = tmp_path / "s.db"
    _train(store, "ok", compiled=False, steps=1, skip_step=None)
    res = CliRunner().invoke(cli, ["check-grads", str(store), "--run", "ok", "-o", str(tmp_path / "no" / "x.txt")])
    assert res.exit_code == 2 and "cannot write the report" in res.output, res.output


JOB_CA_EXIT = """
import os, sys, torch
from graphdeck.capture import Agent
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
agent = Agent(store=sys.argv[1], run="ca")
agent.watch(m)
f = torch.compile(m, backend=agent.backend("aot_eager"))
for i in range(3):
    loss = f(torch.randn(2, 4)).sum()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        loss.backward()
os._exit(0)
"""


def test_compiled_autograd_job_ended_by_os_exit_says_why_nothing_was_observed(tmp_path):
    store = tmp_path / "s.db"
    run_python(JOB_CA_EXIT, str(store))
    rep = validate_backward(store, "ca")
    assert rep.verdict == "INCOMPLETE", rep.to_text()
    assert any("compiled autograd" in g for g in rep.gaps), rep.gaps


JOB_CA_STEPS = """
import sys, torch
from graphdeck.capture import Agent
torch.manual_seed(0)
holder = torch.nn.Module()
holder.m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
holder.scale = torch.nn.Parameter(torch.ones(()))
agent = Agent(store=sys.argv[1], run="ca")
agent.watch(holder)
f = torch.compile(holder.m, backend=agent.backend("aot_eager"))
opt = torch.optim.SGD(holder.parameters(), lr=0.01)
for i in range(5):
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        out = f(torch.randn(2, 4)).sum()
        (out if i == 3 else out * holder.scale).backward()  # step 3: no gradient for scale
    opt.step()
    opt.zero_grad()
agent.close()
"""


def test_compiled_autograd_gradients_are_read_at_each_step(tmp_path):
    """Under compiled autograd the capture puts no hook on the autograd graph (NOTE: [Evidence
    under compiled autograd]): which parameter got a gradient is read at each optimizer step, so a
    gradient that stops arriving at step 3 is NO_GRAD at step 3, and the report says what cannot
    be seen there. Before: the evidence stood down under compiled autograd (INCOMPLETE)."""
    store = tmp_path / "s.db"
    run_python(JOB_CA_STEPS, str(store))
    rep = validate_backward(store, "ca")
    assert rep.verdict == "FAIL", rep.to_text()
    bad = {r.fqn: r for r in rep if r.status != "OK"}
    assert set(bad) == {"scale"} and bad["scale"].status == "NO_GRAD", rep.to_text()
    assert bad["scale"].steps == [[0, 2, "ok"], [3, 3, "none"], [4, 4, "ok"]], bad["scale"].steps
    assert any("compiled autograd" in n and "cannot be told" in n for n in rep.coverage.get("notes", [])), rep.to_text()
    with open_engine(store, read_only=True).connect() as c:
        modes = c.execute(text("SELECT payload FROM compile_events WHERE name = 'graphdeck_evidence_mode'")).all()
    assert modes == [('{"mode": "compiled_autograd"}',)], modes
