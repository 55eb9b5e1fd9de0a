"""Run-time gradient evidence cases, one torchrun job per group (2 gloo ranks, CPU):

    torchrun --standalone --nproc-per-node 2 tests/grad_evidence_job.py STORE GROUP

``healthy`` (ends normally): ``positives`` — compiled DDP (aot_eager), a detection-style model whose
box head's loss term is added only when the local batch has positives; rank 1 never has any, so
its compiled backward zero-fills the box head's gradient (4 steps, no error); ``step3`` — the same
model compiled, the box term skipped at step 3 on every rank (5 steps).
``eager`` (dies): ``positives_eager`` — the positives model under eager DDP: rank 1 never marks the
box head ready; step 1 raises DDP's "Expected to have finished reduction" there.
``ckpt`` (dies): ``ckpt`` — LoRA-style blocks under reentrant activation checkpointing, one LoRA
adapter used in two checkpointed calls, eager DDP: the first backward raises "Expected to mark a
variable ready only once". The job neither catches it nor calls ``close()``: what was captured
must be in the store anyway (interpreter exit flushes it).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

D = 8


class Detector(torch.nn.Module):
    """A trunk, a class head and a box head (returned together)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(D, D)
        self.cls_head = torch.nn.Linear(D, 2)
        self.box_head = torch.nn.Linear(D, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.cls_head(h), self.box_head(h)


def detection_loss(cls_logits, boxes, labels, step, skip_step=None):
    """Cross-entropy on every sample; the box term only for positive samples (none: no term)."""
    loss = torch.nn.functional.cross_entropy(cls_logits, labels)
    pos = labels > 0
    if pos.any() and step != skip_step:
        loss = loss + boxes[pos].pow(2).mean()  # the box head's loss term
    return loss


class LoRALinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(D, D)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Linear(D, 2, bias=False)
        self.lora_b = torch.nn.Linear(2, D, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class CheckpointedLoRA(torch.nn.Module):
    """Two checkpointed calls of one shared LoRA block, then a trainable head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(D, D)
        self.block = LoRALinear()
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        h = ckpt.checkpoint(self.block, h, use_reentrant=True)
        h = ckpt.checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


def detector_run(store: str, run: str, rank: int, *, compiled: bool, steps: int, skip_step=None) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Detector()
    agent = Agent(store=store, run=run)
    agent.watch(model)  # README's order: watch the model, then wrap it (the agent finds the wrapper)
    ddp = DDP(model)
    step_fn = torch.compile(ddp, backend=agent.backend("aot_eager")) if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(6, D, generator=gen)
        # rank 1's batches never hold a positive sample in "positives"
        labels = torch.zeros(6, dtype=torch.long) if (rank == 1 and skip_step is None) else torch.tensor([0, 1] * 3)
        cls_logits, boxes = step_fn(x)
        loss = detection_loss(cls_logits, boxes, labels, step, skip_step)
        loss.backward()
        opt.step()
        opt.zero_grad()
    agent.close()


def main() -> None:
    store, group = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if group == "healthy":
        detector_run(store, "positives", rank, compiled=True, steps=4)
        dist.barrier()
        detector_run(store, "step3", rank, compiled=True, steps=5, skip_step=3)
        dist.barrier()
    elif group == "eager":
        detector_run(store, "positives_eager", rank, compiled=False, steps=3)
    elif group == "ckpt":
        torch.manual_seed(0)
        model = CheckpointedLoRA()
        agent = Agent(store=store, run="ckpt")
        ddp = DDP(model)
        agent.watch(ddp)
        x = torch.randn(4, D, requires_grad=True)
        ddp(x).sum().backward()  # raises on every rank: "Expected to mark a variable ready only once"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
