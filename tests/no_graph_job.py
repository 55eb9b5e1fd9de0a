"""A compiled DDP job on which ``torch.compile`` compiles nothing (NOTE: [No graph produced]), for
tests/test_compile_no_graph.py: ``torch.compile(DDP(nn.Sequential(...)), backend=agent.backend("aot_eager"))``
on 2 gloo ranks (CPU), 5 steps profiled by ``Agent.profile``. Dynamo breaks DDP's forward at
``_inside_ddp_forward`` and skips ``Sequential.forward`` (torch's own file) as a frame of its own,
so no frame holds an op and the job runs eagerly.

    torchrun --standalone --nproc-per-node 2 tests/no_graph_job.py STORE RUN [own]

``own``: the same layers under a forward of the job's own (``Own``), which Dynamo compiles
(DDPOptimizer splits it): the control that is compiled.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # as the other jobs

from graphdeck.capture import Agent  # noqa: E402


class Own(nn.Module):
    def __init__(self, seq: nn.Module):
        super().__init__()
        self.seq = seq

    def forward(self, x):
        return self.seq(x)


def main() -> None:
    store, run = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    if "own" in sys.argv[3:]:
        model = Own(model)
    agent = Agent(store=store, run=run)
    agent.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(DDP(model), backend=agent.backend("aot_eager"))
    with agent.profile(wait_steps=1, warmup_steps=1, active_steps=2) as prof:
        for _ in range(5):
            loss = compiled(torch.randn(8, 32)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
