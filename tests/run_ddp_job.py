"""The unmodified twin of tests/ddp_overlap_job.py's ``split`` case: the same compiled DDP
training (2 gloo ranks, CPU, aot_eager, 1 MiB buckets, 4 steps) with no graphdeck in it, for
``graphdeck run`` (tests/test_run.py). Each rank prints its losses (``rank R step S LOSS`` with
the float's hex, so runs compare bit for bit).

    torchrun --standalone --nproc-per-node 2 tests/run_ddp_job.py [--crash-at STEP]

``--crash-at STEP``: step STEP's forward raises (after the earlier steps trained); nothing is caught.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WIDE, LAYERS, STEPS = 512, 4, 4


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDE, WIDE) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--crash-at", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Stack()
    ddp = DDP(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    compiled = torch.compile(ddp, backend="aot_eager")
    for step in range(STEPS):
        if step == args.crash_at:
            raise RuntimeError(f"the job fails in step {step}")
        loss = compiled(torch.randn(64, WIDE, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} {loss.item().hex()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
