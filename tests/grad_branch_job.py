"""The loss code that skips a model output at one step (issue 40 item 1), one process, CPU:

    python tests/grad_branch_job.py STORE

Five runs of a detector (trunk, class head, box head), 3 steps each; step 1's batch has no
foreground, so the box head's loss term is skipped there, each run by another form of branch:
``compiled_helper`` (aot_eager) and ``eager_helper``: ``if fg_mask.sum():`` in ``box_term``,
a helper of the loss function ``compute_loss``; ``compiled_continue`` and ``eager_continue``: ``if not labels[i] >
0: continue`` in a per-sample loop of ``per_sample_loss``, the outputs passed straight in (no
variable holds them);
``eager_dict``: a dict output, an always-true branch on the class term before the skipped one.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402


class Detector(torch.nn.Module):
    def __init__(self, as_dict: bool = False):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.cls_head = torch.nn.Linear(16, 3)
        self.box_head = torch.nn.Linear(16, 4)
        self.as_dict = as_dict

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        cls, box = self.cls_head(h), self.box_head(h)
        return {"cls": cls, "box": box} if self.as_dict else (cls, box)


def box_term(box, fg_mask, target):
    if fg_mask.sum():
        return F.l1_loss(box[fg_mask], target[fg_mask])
    return torch.zeros(())


def compute_loss(cls, box, labels, target):
    loss = F.cross_entropy(cls, labels)
    fg = labels > 0
    return loss + box_term(box, fg, target)


def per_sample_loss(outputs, labels, target):
    cls, box = outputs
    loss = F.cross_entropy(cls, labels)
    for i in range(len(labels)):
        if not labels[i] > 0:
            continue
        loss = loss + (box[i] - target[i]).abs().mean()
    return loss


def dict_loss(out, labels, target):
    loss = torch.zeros(())
    if labels.numel():
        loss = loss + F.cross_entropy(out["cls"], labels)
    fg = labels > 0
    if fg.any():
        loss = loss + F.l1_loss(out["box"][fg], target[fg])
    return loss


def step_helper(step_fn, x, labels, target):
    cls, box = step_fn(x)
    loss = compute_loss(cls, box, labels, target)
    loss.backward()


def step_per_sample(step_fn, x, labels, target):
    loss = per_sample_loss(step_fn(x), labels, target)  # the outputs are held by no variable here
    loss.backward()


def step_dict(step_fn, x, labels, target):
    out = step_fn(x)
    loss = dict_loss(out, labels, target)
    loss.backward()


RUNS = {"compiled_helper": step_helper, "eager_helper": step_helper, "compiled_continue": step_per_sample,
        "eager_continue": step_per_sample, "eager_dict": step_dict}


def run(store: str, name: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Detector(as_dict=name == "eager_dict")
    agent = Agent(store=store, run=name)
    agent.watch(model)
    step_fn = torch.compile(model, backend=agent.backend("aot_eager")) if name.startswith("compiled") else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x, target = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        labels = torch.zeros(6, dtype=torch.long) if step == 1 else torch.tensor([1, 0, 2, 0, 1, 1])
        RUNS[name](step_fn, x, labels, target)
        opt.step()
        opt.zero_grad()
    agent.close()


if __name__ == "__main__":
    for name in RUNS:
        run(sys.argv[1], name)
