"""A 4-rank gloo job (started as torchrun would) whose rank 2 takes a rank-dependent branch that adds
one op (``torch.tanh``) to its compiled graph; the other ranks compile the same graph. ``aot_eager``,
a tiny MLP, 3 steps (1 profiled, so each rank has a trace mapped onto its graphs). The N-way rank
diff (issue 42; analysis/graphs/nway.py) is checked on the store given as argv[1], run ``nway``.
"""

import os
import sys

import torch
import torch.distributed as dist

from graphdeck.capture import Agent

STORE = sys.argv[1]


class Net(torch.nn.Module):
    def __init__(self, odd: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.odd = odd

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.odd:  # rank 2 only
            h = torch.tanh(h)
        return self.b(h)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    agent = Agent(store=STORE, run="nway")
    model = agent.watch(Net(odd=rank == 2))
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    prof = agent.profile(wait_steps=1, warmup_steps=0, active_steps=1)
    prof.__enter__()
    try:
        for _step in range(3):
            compiled(torch.randn(4, 8)).sum().backward()
            prof.step()
    finally:
        prof.__exit__(None, None, None)
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
