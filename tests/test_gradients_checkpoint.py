"""Eager mode and activation checkpointing (issue 17 item 4), and combining per-rank reports.

A LoRA-style model (frozen base Linear, trainable ``lora_a``/``lora_b``, a head) whose ``shared``
LoRA block runs in two checkpointed calls. Reentrant checkpointing runs the block under
``no_grad`` in forward and recomputes it in a nested backward per call, so the walk from the loss
cannot see its parameters and each call accumulates their gradient once. Every verdict is checked
against a real backward on a copy of the model (tensor hooks count the accumulations), and the DDP
consequences against real DDP steps in a 2-rank gloo group."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from torch.utils.checkpoint import checkpoint

from graphdeck.analysis.gradients.eager import DDP_READY_TWICE_ERROR, eager_report
from graphdeck.analysis.gradients.report import GradReport, combine
from graphdeck.cli import main as cli
from tests import grad_cases as C
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
D = 8
SHARED = ["shared.lora_a.weight", "shared.lora_b.weight"]
OTHER = ["other.lora_a.weight", "other.lora_b.weight"]


class LoRA(nn.Module):
    def __init__(self, d: int = D, r: int = 2):
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.lora_a = nn.Linear(d, r, bias=False)
        self.lora_b = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class CheckpointedLoRA(nn.Module):
    """``shared`` runs in two checkpointed calls of ``block``, ``other`` in one; ``head`` outside."""

    def __init__(self, reentrant: bool = True, inner_no_grad: bool = False):
        super().__init__()
        self.shared, self.other, self.head = LoRA(), LoRA(), nn.Linear(D, 2)
        self.reentrant, self.inner_no_grad = reentrant, inner_no_grad

    def block(self, x):
        s = self.shared
        if self.inner_no_grad:
            with torch.no_grad():  # CK-region
                a = s.lora_a(x)  # CK-cut
            return torch.relu(s.base(x) + s.lora_b(a))
        return torch.relu(s(x))

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        h = checkpoint(self.other, h, use_reentrant=self.reentrant)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


BLOCK_DEF = f"{Path(__file__).name}:{CheckpointedLoRA.block.__code__.co_firstlineno}"


def _x(requires_grad: bool = True):
    return torch.randn(3, D, generator=torch.Generator().manual_seed(1)).requires_grad_(requires_grad)


def real_accumulations(model, x) -> dict[str, int]:
    """Ground truth: a real backward on a copy, counting each parameter's gradient hook calls."""
    model = copy.deepcopy(model)
    seen = {n: 0 for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, n=n: seen.__setitem__(n, seen[n] + 1))
    model(x.detach().requires_grad_(x.requires_grad)).sum().backward()
    return seen


def rows(rep):
    return {r.fqn: r for r in rep}


def loss(out):
    return out.sum()


def test_reentrant_checkpoint_lora_gets_gradients_and_counts_two_accumulations():
    torch.manual_seed(0)
    model, x = CheckpointedLoRA(reentrant=True), _x()
    truth = real_accumulations(model, x)
    assert truth == {**dict.fromkeys(SHARED, 2), **dict.fromkeys(OTHER, 1), "head.weight": 1, "head.bias": 1}
    rep = eager_report(model, (x,), loss)
    r = rows(rep)
    assert not [f for f, row in r.items() if row.status == "NO_GRAD"], rep.to_text()
    assert {f: r[f].accumulations for f in truth} == truth
    assert all(r[f].status == "FROZEN" and r[f].accumulations == 0 for f in r if ".base." in f)
    assert "reentrant activation checkpointing" in r[SHARED[0]].reason and "CheckpointedLoRA.block" in r[SHARED[0]].reason
    assert "LoRA.forward" in r[OTHER[0]].reason
    # Without DDP: a warning, the check passes.
    [f] = [f for f in rep.findings if f.kind == "READY_TWICE"]
    assert f.severity == "warning" and rep.ok and sorted(f.params) == sorted(SHARED)
    assert "CheckpointedLoRA.block" in f.message and f.source == BLOCK_DEF
    assert "harmless without DDP" in f.message and DDP_READY_TWICE_ERROR in f.message
    assert "use_reentrant=False" in f.fix and "static_graph=True" in f.fix
    # Neither the model's .grad fields nor the input's were touched.
    assert all(p.grad is None for p in model.parameters()) and x.grad is None


def test_ddp_flag_makes_ready_twice_an_error():
    torch.manual_seed(0)
    rep = eager_report(CheckpointedLoRA(reentrant=True), (_x(),), loss, ddp=True)
    [f] = [f for f in rep.findings if f.kind == "READY_TWICE"]
    assert f.severity == "error" and not rep.ok and sorted(f.params) == sorted(SHARED)
    assert "harmless" not in f.message and DDP_READY_TWICE_ERROR in f.message
    assert "stays local" in f.message  # both real DDP outcomes are named
    data = json.loads(rep.to_json())
    assert {p["fqn"]: p["accumulations"] for p in data["params"]}[SHARED[0]] == 2


def test_non_reentrant_checkpoint_accumulates_once():
    torch.manual_seed(0)
    model, x = CheckpointedLoRA(reentrant=False), _x()
    truth = real_accumulations(model, x)
    assert set(truth.values()) == {1}
    rep = eager_report(model, (x,), loss, ddp=True)
    r = rows(rep)
    assert {f: r[f].accumulations for f in truth} == truth
    assert all(row.status in ("OK", "FROZEN") for row in rep), rep.to_text()
    assert r[SHARED[0]].paths == 2 and not rep.findings and rep.ok


def test_reentrant_checkpoint_whose_inputs_need_no_grad_is_a_real_cut():
    """No input of the checkpoint requires grad: torch never recomputes it, the LoRA weights get
    nothing (the real backward agrees), and the reason says why."""
    torch.manual_seed(0)
    model, x = CheckpointedLoRA(reentrant=True), _x(requires_grad=False)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        truth = real_accumulations(model, x)
    assert truth == {**dict.fromkeys(SHARED + OTHER, 0), "head.weight": 1, "head.bias": 1}
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        rep = eager_report(model, (x,), loss)
    r = rows(rep)
    for fqn in SHARED + OTHER:
        assert r[fqn].status == "NO_GRAD" and r[fqn].accumulations == 0 and r[fqn].cut.kind == "no_grad"
        assert "none of the checkpoint's tensor inputs requires grad" in r[fqn].reason
        assert "requires_grad_" in r[fqn].fix and "use_reentrant=False" in r[fqn].fix
    assert "CheckpointedLoRA.block" in r[SHARED[0]].reason and "LoRA.forward" in r[OTHER[0]].reason
    assert not rep.ok


def test_no_grad_inside_a_checkpointed_function_is_still_a_cut():
    torch.manual_seed(0)
    model, x = CheckpointedLoRA(reentrant=True, inner_no_grad=True), _x()
    truth = real_accumulations(model, x)
    assert truth["shared.lora_a.weight"] == 0 and truth["shared.lora_b.weight"] == 2 and truth[OTHER[0]] == 1
    r = rows(eager_report(model, (x,), loss))
    row = r["shared.lora_a.weight"]
    assert row.status == "NO_GRAD" and row.cut.kind == "no_grad" and row.accumulations == 0
    name = Path(__file__).name
    assert row.cut.region == f"{name}:{_line('CK-region')}" and row.cut.source == f"{name}:{_line('CK-cut')}", row
    assert r["shared.lora_b.weight"].status == "OK" and r["shared.lora_b.weight"].accumulations == 2
    assert r[OTHER[0]].status == "OK" and r[OTHER[0]].accumulations == 1


def _line(marker: str) -> int:
    for i, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return i
    raise KeyError(marker)


def test_genuine_no_grad_helper_is_still_reported():
    """G3: the backbone runs under the helper's no_grad; the backward check agrees (0 accumulations)."""
    torch.manual_seed(0)
    r = rows(eager_report(C.NoGradHelper(), (torch.randn(4, C.D),), loss))
    for fqn in ("backbone.0.weight", "backbone.1.bias"):
        assert r[fqn].status == "NO_GRAD" and r[fqn].cut.kind == "no_grad" and r[fqn].accumulations == 0
        assert r[fqn].cut.region == C.line_of("G3-region")
    assert r["head.weight"].status == "OK" and r["head.weight"].accumulations == 1


DDP_JOB = r"""
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, sys.argv[4])
from tests.test_gradients_checkpoint import CheckpointedLoRA, SHARED, _x, loss
from graphdeck.analysis.gradients.eager import eager_report
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
res = {}
for find_unused in (False, True):
    torch.manual_seed(0)
    model = DDP(CheckpointedLoRA(reentrant=True), find_unused_parameters=find_unused)
    rep = eager_report(model, (_x(),), loss)
    res[f"report_{find_unused}"] = [f.__dict__ for f in rep.findings]
    res[f"grads_untouched_{find_unused}"] = all(p.grad is None for p in model.parameters())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + rank)).requires_grad_()
    try:
        model(x).sum().backward()
        g = model.module.shared.lora_a.weight.grad
        both = [torch.zeros_like(g) for _ in range(2)]
        dist.all_gather(both, g)
        res[f"step_{find_unused}"] = "ranks agree" if torch.equal(both[0], both[1]) else "ranks differ"
    except RuntimeError as exc:
        res[f"step_{find_unused}"] = str(exc).splitlines()[0]
    dist.barrier()
Path = __import__("pathlib").Path
Path(out).write_text(json.dumps(res))
dist.destroy_process_group()
"""


def test_ddp_ready_twice_is_an_error_and_its_consequences_are_real(tmp_path):
    """2 gloo ranks: eager mode on the DDP model gives READY_TWICE (an error) naming the reused
    LoRA weights and the checkpointed function; a real DDP step then raises DDP's error with
    find_unused_parameters=True and silently leaves different gradients on the ranks without."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", DDP_JOB, str(rank), port, str(tmp_path / f"r{rank}.json"),
                               str(REPO)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank failed:\n{out[-2000:]}\n{err[-4000:]}"
    for rank in (0, 1):
        res = json.loads((tmp_path / f"r{rank}.json").read_text())
        for find_unused in (False, True):
            [f] = [f for f in res[f"report_{find_unused}"] if f["kind"] == "READY_TWICE"]
            assert f["severity"] == "error" and sorted(f["params"]) == sorted(SHARED)
            assert "CheckpointedLoRA.block" in f["message"] and f["source"] == BLOCK_DEF
            assert res[f"grads_untouched_{find_unused}"]
        true_msg = next(f for f in res["report_True"] if f["kind"] == "READY_TWICE")["message"]
        false_msg = next(f for f in res["report_False"] if f["kind"] == "READY_TWICE")["message"]
        # Each message leads with what this wrapper really does (issue 34): find_unused_parameters=True
        # raises in the first backward; False finishes DDP's iteration before the second
        # accumulation, which stays local: no error, the replicas' LoRA gradients silently diverge.
        assert true_msg.startswith("under this DDP wrapper (find_unused_parameters=True, static_graph=False): "
                                   f"the first backward raises '{DDP_READY_TWICE_ERROR}'"), true_msg
        head = false_msg.split(" — ")[0]
        assert "no error" in head and "silently diverge" in head and "stays local" in head, false_msg
        assert DDP_READY_TWICE_ERROR not in head, false_msg
        assert res["step_True"].startswith(DDP_READY_TWICE_ERROR), res
        assert res["step_False"] == "ranks differ", res


class Flip(nn.Module):
    """``enc`` gets a gradient unless ``cut`` (then its output is detached: NO_GRAD)."""

    def __init__(self, cut: bool):
        super().__init__()
        self.enc, self.head, self.cut = nn.Linear(D, D), nn.Linear(D, 2), cut

    def forward(self, x):
        h = self.enc(x)
        return self.head(h.detach() if self.cut else h)


def flip_ok():
    torch.manual_seed(0)
    return Flip(False)


def flip_cut():
    torch.manual_seed(0)
    return Flip(True)


def test_report_json_round_trip():
    torch.manual_seed(0)
    rep = eager_report(CheckpointedLoRA(reentrant=True), (_x(),), loss, ddp=True, rank=3)
    back = GradReport.from_json(rep.to_json())
    assert back.to_dict() == json.loads(rep.to_json())
    assert back.rows[0].rank == 3 and isinstance(back.findings[0].params, list)
    combined = combine([eager_report(flip_ok(), (_x(),), loss, rank=0), eager_report(flip_cut(), (_x(),), loss, rank=1)])
    back = GradReport.from_dict(json.loads(combined.to_json()))
    [hang] = [f for f in back.findings if f.kind == "PREDICTED_HANG" and f.params == ["enc.weight"]]
    assert hang.ranks == {0: "OK", 1: "NO_GRAD"}
    with pytest.raises(ValueError):
        GradReport.from_json('{"rows": []}')
    with pytest.raises(ValueError):
        GradReport.from_json("not json")


def test_cli_combine_per_rank_reports(tmp_path):
    runner = CliRunner()
    r0, r1 = tmp_path / "rank0.json", tmp_path / "rank1.json"
    r0.write_text(eager_report(flip_ok(), (_x(),), loss, rank=0).to_json())
    r1.write_text(eager_report(flip_cut(), (_x(),), loss, rank=1).to_json())
    res = runner.invoke(cli, ["check-grads", "--combine", str(r0), "--combine", str(r1)])
    assert res.exit_code == 1, res.output
    assert "ranks [0, 1]: FAIL" in res.output and "PREDICTED_HANG" in res.output and "enc.weight" in res.output
    res = runner.invoke(cli, ["check-grads", "--combine", str(r0), "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.output)["ranks"] == [0], res.output
    # Files written by the CLI itself (eager mode without a process group: all rank 0).
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, factory in ((a, "flip_ok"), (b, "flip_cut")):
        res = runner.invoke(cli, ["check-grads", "--model", f"tests.test_gradients_checkpoint:{factory}",
                                  "--inputs", "float32[3,8]", "--format", "json", "-o", str(path)])
        assert res.exit_code == (0 if factory == "flip_ok" else 1), res.output
    res = runner.invoke(cli, ["check-grads", "--combine", str(a), "--combine", str(b), "--format", "json"])
    data = json.loads(res.output)
    assert res.exit_code == 1 and data["ranks"] == [0, 1]
    assert any(f["kind"] == "PREDICTED_HANG" for f in data["findings"])
    assert any("numbered by --combine order" in n for n in data["notes"])
    # Unreadable input: exit 2 with the file named.
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args in (["--combine", str(bad)], ["--combine", str(tmp_path / "missing.json")],
                 ["--combine", str(r0), "--run", "x"]):
        res = runner.invoke(cli, ["check-grads", *args])
        assert res.exit_code == 2, (args, res.output)
    res = runner.invoke(cli, ["check-grads", "--combine", str(bad)])
    assert "bad.json" in res.output and "not a readable check-grads JSON report" in res.output


class OwnReference(nn.Module):
    """Uses ``lin.weight`` through a plain attribute the parameter swap cannot see."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.__dict__["w_ref"] = self.lin.weight

    def forward(self, x):
        return x @ self.w_ref.t() + self.lin.bias


def test_backward_check_leaves_grad_fields_alone_even_through_own_references():
    model = OwnReference()
    model.lin.bias.grad = before = torch.ones(D)
    rep = eager_report(model, (_x(),), loss)
    assert model.lin.weight.grad is None and model.lin.bias.grad is before and torch.equal(before, torch.ones(D))
    assert any("backward check incomplete" in n and "lin.weight" in n for n in rep.notes), rep.notes
    assert rows(rep)["lin.weight"].status == "OK"
