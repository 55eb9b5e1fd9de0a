"""FSDP2 written from torch's public APIs, no graphdeck in it (for ``graphdeck run``,
tests/test_run.py): ``fully_shard`` on each of three blocks, then on the root, over a 1-D
``DeviceMesh`` of the ranks (CPU, gloo), compiled with aot_eager, 2 SGD steps. Prints each rank's
losses as ``rank R step S LOSS`` (the float's hex).

    torchrun --standalone --nproc-per-node 2 tests/run_fsdp2_job.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 64)
        self.proj = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(self.ln(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(2):
        loss = compiled(torch.randn(8, 16, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {dist.get_rank()} step {step} {loss.item().hex()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
