"""FSDP2 (``fully_shard`` per block and at the root) + ``torch.compile`` on gloo ranks, captured.

Run under torchrun::

    torchrun --standalone --nproc-per-node 2 tests/programs/fsdp2_blocks.py STORE [--frozen]

The model is three identical residual MLP blocks and a head. Under FSDP2 the block hooks break
the Dynamo graph at every block, so one compiled block graph serves all three blocks, called with
each block's unsharded parameters in turn (see NOTE: [Run-time parameter binding] in
capture/agent.py). ``--frozen`` freezes nothing but leaves ``blocks.2.spare`` unused (a real
NOT_IN_GRAPH the check must still report).
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--unused", action="store_true", help="give block 2 a parameter no graph reads")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from graphdeck.capture import Agent

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

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    agent = Agent(store=args.store, run="fsdp2")
    model = Model()
    if args.unused:
        model.blocks[2].spare = nn.Linear(32, 32)
    model = agent.watch(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        compiled(torch.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
