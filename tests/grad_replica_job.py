"""Replica agreement cases (2 gloo ranks, CPU), one torchrun job, one run per case:

    torchrun --standalone --nproc-per-node 2 tests/grad_replica_job.py STORE CASE [CASE ...]

DDP gradient accumulation over ``ACCUM`` micro-batches per optimizer step, ``STEPS`` steps, each
rank its own data. ``nosync_*``: at steps ``BAD`` the last micro-batch also runs under
``no_sync()`` (the optimizer consumes a gradient that was never all-reduced: the replicas drift
apart, nothing raises); ``fixed_*``: ``no_sync()`` only on the non-final micro-batches (and an evaluation forward under
``no_grad`` before each step, which leaves DDP's sync attribute False: not an unsynced step).
``*_eager``: eager DDP; ``*_compiled``: ``torch.compile(ddp)`` through the agent (aot_eager).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

ACCUM, STEPS, BAD = 4, 8, (3, 6)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def run_case(store: str, case: str, rank: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    agent = Agent(store=store, run=case)
    agent.watch(model)
    ddp = DDP(model)
    step_fn = torch.compile(ddp, backend=agent.backend("aot_eager")) if case.endswith("_compiled") else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    buggy = case.startswith("nosync")
    for step in range(STEPS):
        for i in range(ACCUM):
            last = i == ACCUM - 1
            unsynced = not last or (buggy and step in BAD)  # REPLICA-BUG
            with ddp.no_sync() if unsynced else contextlib.nullcontext():
                x = torch.randn(4, 8, generator=gen)
                loss = step_fn(x).pow(2).mean() / ACCUM
                loss.backward()
        if not buggy:  # an evaluation forward before the step: DDP's forward under no_grad syncs nothing
            with torch.no_grad():
                step_fn(torch.randn(2, 8, generator=gen))
        opt.step()
        opt.zero_grad()
    agent.close()


def main() -> None:
    store, *cases = sys.argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for case in cases:
        run_case(store, case, rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
