"""FSDP2, a rank-0-only ``full_tensor()`` after a step (issue 38, item 4), captured by the
graphdeck agent as run ``full_tensor``:

    torchrun --standalone --nproc-per-node 2 tests/programs/fsdp2_full_tensor.py STORE

A two-layer model under ``fully_shard`` (each Linear, then the root), compiled (aot_eager), Adam.
At the end of step 0 rank 0 alone gathers an optimizer state (``exp_avg``) with
``full_tensor()`` — an all-gather on the FSDP group — while rank 1 is already in step 1's
forward, in FSDP's own all-gather of the same group: the two all-gathers differ in size, gloo
aborts one side (``TIMEOUT_S`` keeps a rank left waiting short), NCCL would hang. The job exits
non-zero.
"""

from __future__ import annotations

import datetime
import os
import sys

TIMEOUT_S = 5

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from graphdeck.capture import Agent

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    agent = Agent(store=sys.argv[1], run="full_tensor")
    model = agent.watch(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 64)))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        compiled(torch.randn(4, 4, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step == 0:  # RANK0_ONLY: log the optimizer state's norm on rank 0
            exp_avg = opt.state[model[2].weight]["exp_avg"].full_tensor()  # FULL_TENSOR
            print(f"step {step}: exp_avg norm {exp_avg.norm():.4f}", flush=True)
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
