"""Case N5 (``shared/cases/compile-and-ranks.md``; pytorch/pytorch#158719): FSDP2 parameters used
differently on each rank, captured by the graphdeck agent as run ``n5``:

    torchrun --standalone --nproc-per-node 2 tests/programs/n5_fsdp2_experts.py STORE

``inp``, ``expert_a``, ``expert_b`` (Linear 32->32) and ``out`` (Linear 32->1) sit in ONE
``fully_shard`` group (the root), compiled (aot_eager). ``forward(x, use_b)`` adds
``expert_b(h)`` only when ``use_b``: rank 0's batch routes no token to expert_b (False), rank 1's
does (True). In the first backward the group's post-backward reduce-scatter has a different input
size on each rank (rank 0 lacks expert_b's gradients): gloo fails with "Received data size
doesn't match expected size" (NCCL may complete it with wrong gradients, pytorch#174862). The
process group's timeout is short (``TIMEOUT_S``) so a rank left waiting ends fast; the job exits
non-zero.
"""

from __future__ import annotations

import datetime
import os
import sys

TIMEOUT_S = 10

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from graphdeck.capture import Agent

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, 32)
            self.expert_a = nn.Linear(32, 32)
            self.expert_b = nn.Linear(32, 32)
            self.out = nn.Linear(32, 1)

        def forward(self, x, use_b: bool):
            h = torch.relu(self.inp(x))
            y = self.expert_a(h)
            if use_b:  # N5_BRANCH: only ranks whose batch routes tokens to expert_b
                y = y + self.expert_b(h)
            return self.out(y)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    agent = Agent(store=sys.argv[1], run="n5")
    model = agent.watch(Experts())
    fully_shard(model)  # one group: inp, expert_a, expert_b, out
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    compiled(x, use_b=(rank == 1)).square().mean().backward()  # dies here: reduce-scatter sizes differ
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
