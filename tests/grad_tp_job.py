"""Tensor-parallel replica agreement cases (2 gloo ranks, CPU, a 1-D ``tp`` mesh), one torchrun
job, one run per case:

    torchrun --standalone --nproc-per-node 2 tests/grad_tp_job.py STORE CASE [CASE ...]

A sequence-parallel block: each TP rank holds its own half of the tokens; a ``Replicate``
``gain`` (DTensor parameter) scales them through ``gain.to_local()``, then a column-parallel
projection (``ColwiseParallel``). The gain's true gradient is the sum over both halves: its local
gradient is a partial sum. ``tp_nograd``: ``to_local()`` without ``grad_placements``, so autograd
treats the partial sum as the Replicate gradient (no all-reduce in the backward: the TP peers
update the gain differently, nothing raises); ``tp_fixed``: ``to_local(grad_placements=[Partial()])``.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

STEPS = 4


class SPBlock(torch.nn.Module):
    def __init__(self, mesh, fixed: bool):
        super().__init__()
        self.gain = torch.nn.Parameter(distribute_tensor(torch.ones(8), mesh, [Replicate()]))
        self.proj = torch.nn.Linear(8, 16, bias=False)
        self.fixed = fixed

    def forward(self, tokens):  # tokens: this rank's half of the sequence (plain tensor)
        gain = self.gain.to_local(grad_placements=[Partial()]) if self.fixed else self.gain.to_local()  # TP-BUG
        return self.proj(tokens * gain)


def run_case(store: str, case: str, rank: int, mesh) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SPBlock(mesh, fixed=case == "tp_fixed")
    parallelize_module(model.proj, mesh, ColwiseParallel(use_local_output=True))
    agent = Agent(store=store, run=case)
    agent.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        tokens = torch.randn(4, 8, generator=gen)
        loss = model(tokens).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    agent.close()


def main() -> None:
    store, *cases = sys.argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for case in cases:
        run_case(store, case, rank, mesh)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
