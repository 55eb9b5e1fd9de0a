"""One process, world size 1: a model under FSDP2 (``fully_shard`` on a 1-rank mesh) whose
``unused`` layer the forward never reads, compiled with ``aot_eager``, 3 optimizer steps; then
``agent.close()``. Usage: ``python fsdp2_one_rank.py STORE PORT [--die]`` (``--die``: raise in
the second step's forward, after the first step, without ``close()``). For the FSDP2 gradient
evidence (NOTE: [FSDP2 evidence] in capture/grad_evidence.py)."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from graphdeck.capture import Agent

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


agent = Agent(store=sys.argv[1], run="fsdp2_one")
model = agent.watch(Net())
fully_shard(model.a)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
for step in range(3):
    if step == 1 and "--die" in sys.argv:
        raise SystemExit("dies after its first step")
    compiled(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
agent.close()
dist.destroy_process_group()
