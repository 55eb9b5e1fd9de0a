"""Issue 40 item 1 (newcomer report): eager DDP (``find_unused_parameters=True``, 2 gloo ranks)
with the outputs passed straight into the loss, ``loss = compute_loss(model(x), y, mask)``: the
finding names the loss code's branch that skipped the box head on rank 1 (``if mask.any():``),
as it does for the two-line form and for compiled code (NOTE: [The branch that skipped an output]).

Before the fix it said only "the code that uses it was skipped at those steps": DDP's
``_DDPSinkBackward`` joins every model output into one autograd node, so the ``loss`` variable
looked as if it held the skipped output and the search stopped at ``loss.backward()``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from graphdeck import validate_backward
from tests.launch import Ranks

JOB = r'''
import sys, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from graphdeck.capture import Agent


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.cls_head = nn.Linear(32, 4)
        self.box_head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.cls_head(h), self.box_head(h)


def compute_loss(out, y, mask):
    cls, box = out
    loss = F.cross_entropy(cls, y)
    if mask.any():
        loss = loss + F.mse_loss(box[mask], torch.zeros_like(box[mask]))
    return loss


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    agent = Agent(store=sys.argv[1], run="inline")
    net = agent.watch(Net())
    model = DDP(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        mask = torch.ones(8, dtype=torch.bool) if not (rank == 1 and step == 2) else torch.zeros(8, dtype=torch.bool)
        loss = compute_loss(model(x), y, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    agent.close()
    dist.destroy_process_group()


main()
'''


@pytest.mark.slow
def test_eager_ddp_inline_loss_names_the_branch(tmp_path):
    job, store = tmp_path / "job.py", tmp_path / "s.db"
    job.write_text(JOB)
    proc = Ranks([str(job), str(store)], 2, env=dict(os.environ), stderr_to_stdout=True).wait(300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rep = validate_backward(store, "inline")
    bad = [r for r in rep if r.status != "OK"]
    assert {(r.rank, r.fqn) for r in bad} == {(1, "box_head.weight"), (1, "box_head.bias")}, rep.to_text()
    line = next(i for i, s in enumerate(JOB.splitlines(), 1) if s.strip() == "if mask.any():")
    want = f"the loss code skipped it at the branch {job}:{line} in compute_loss: `if mask.any():`"
    assert all(want in r.reason for r in bad), rep.to_text()


@pytest.mark.slow
def test_graphdeck_run_eager_ddp_sees_step_0_and_says_eager(tmp_path):
    """The same job with no capture code, under ``graphdeck run``: the eager DDP model is watched
    when DDP wraps it, so step 0's backward is seen (was: steps from 1, the model watched at the
    first optimizer step), and the report does not call the eager job "graph mode"."""
    job, store = tmp_path / "job.py", tmp_path / "s.db"
    job.write_text(JOB.replace('    agent = Agent(store=sys.argv[1], run="inline")\n', "")
                   .replace("net = agent.watch(Net())", "net = Net()").replace("    agent.close()\n", ""))
    cmd = [sys.executable, "-m", "graphdeck.cli", "run", "--store", str(store), "--run", "plain", "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(job)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = validate_backward(store, "plain")
    text = rep.to_text()
    assert "(eager job, run-time evidence)" in text.splitlines()[0], text
    assert "steps 0–3 (4 backward)" in text, text
    bad = [r for r in rep if r.status != "OK"]
    assert {(r.rank, r.fqn) for r in bad} == {(1, "box_head.weight"), (1, "box_head.bias")}, text
    assert all("in compute_loss: `if mask.any():`" in r.reason for r in bad), text
