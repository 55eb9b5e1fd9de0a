"""FSDP2 x tensor parallel on a 2-D ``DeviceMesh``, compiled, captured (issue 20).

Run under torchrun (4 ranks by default: a 2 x 2 ``("dp", "tp")`` mesh)::

    torchrun --standalone --nproc-per-node 4 tests/programs/nd_fsdp_tp.py STORE [--run-name NAME]
        [--dp 2 --tp 2] [--steps 3] [--die]

The model: an input projection, two MLP blocks ``blocks.{0,1}`` (``w1``: Linear(32, 64) under
``ColwiseParallel``, ``w2``: Linear(64, 32) under ``RowwiseParallel`` on ``tp``), block 1 inside
a ``checkpoint_wrapper`` (an activation-checkpoint region), and a head. Each block and the root
are ``fully_shard``-ed on the ``dp`` sub-mesh, so every parameter is a DTensor on the 2-D mesh
(``w1.weight``: Shard(0) over dp and tp; ``w2.weight``: Shard(0) over dp, Shard(1) over tp).
Compiled with ``aot_eager`` through the capture's backend; ranks of one tp group get the same
input (seeded by the dp coordinate). ``--die``: ``os._exit(0)`` right after the first step,
without ``close()`` (a job that dies).
"""

from __future__ import annotations

import argparse
import datetime
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--run-name", default="nd_fsdp_tp")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--die", action="store_true", help="os._exit after the first step, no close()")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from graphdeck.capture import Agent

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(32, 64)
            self.w2 = nn.Linear(64, 32)

        def forward(self, x):
            return x + self.w2(torch.relu(self.w1(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 32)
            self.blocks = nn.ModuleList([MLP(), MLP()])
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    agent = Agent(store=args.store, run=args.run_name)
    model = Model()
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    model = agent.watch(model)  # before parallelising: the layout is recorded again once it changes
    for i, block in enumerate(model.blocks):
        mlp = block._checkpoint_wrapped_module if i == 1 else block
        parallelize_module(mlp, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(int(mesh.get_coordinate()[0]))
    for _ in range(args.steps):
        compiled(torch.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if args.die:
            os._exit(0)
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
