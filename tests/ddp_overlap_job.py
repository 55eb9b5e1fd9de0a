"""Compiled DDP with and without DDPOptimizer's split (2 gloo ranks, CPU), one torchrun job, one
run per case, each profiled (2 active steps):

    torchrun --standalone --nproc-per-node 2 tests/ddp_overlap_job.py STORE CASE [CASE ...]

A stack of ``LAYERS`` 512x512 float32 linear layers (1 MiB weights) under ``DDP(bucket_cap_mb=1)``:
one reducer bucket per layer or so, compiled with ``aot_eager`` through the agent. ``split``:
Dynamo's default (``optimize_ddp`` on: one backward graph per bucket); ``nosplit``:
``torch._dynamo.config.optimize_ddp = False`` (one backward graph feeds every bucket: no
all-reduce can overlap the backward).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

WIDE, LAYERS, STEPS = 512, 4, 4


class Stack(torch.nn.Module):
    """A user module (Dynamo skips torch.nn.Sequential's own frame)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDE, WIDE) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def run_case(store: str, case: str, rank: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack()
    agent = Agent(store=store, run=case)
    agent.watch(model)
    ddp = DDP(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    with torch._dynamo.config.patch(optimize_ddp=case != "nosplit"):
        compiled = torch.compile(ddp, backend=agent.backend("aot_eager"))
        with agent.profile(wait_steps=1, warmup_steps=1, active_steps=2) as prof:
            for _ in range(STEPS):
                compiled(torch.randn(64, WIDE, generator=gen)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
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
