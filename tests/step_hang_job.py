"""A hang whose ranks compiled a frame at different steps (issue 38 item 5): two gloo ranks on CPU,
a 6 s collective timeout, a tiny model and an SGD optimizer, captured as run ``steps``::

    torchrun --standalone --nproc-per-node 2 tests/step_hang_job.py STORE

Each step runs the compiled ``route`` (``dynamic=False``): a mixture-of-experts style token
router that all-reduces its tokens' activations over group ``tokens`` when the rank has tokens,
and over group ``eval`` for float64 tokens (an evaluation pass). Rank 1 gets zero tokens at step
2: Dynamo recompiles ``route`` there (compile 0/1) into a graph without the all-reduce, so rank 0
waits in all-reduce #3 of ``tokens``. Rank 1 goes on to step 3, where float64 tokens make Dynamo
compile ``route`` again (compile 0/2: an all-reduce of group ``eval``, which rank 0 never
reaches); both ranks wait until gloo's timeout ends the job. A steady-state prediction would take
rank 1's compile 0/2 (made at step 3); at the hang (step 2) rank 1 ran compile 0/1.

With ``sleep`` as the second argument (issue 38 item 2) instead: no recompile; rank 0 sleeps
``SLEEP_S`` in its data loader at step 2 (outside any compiled region), so rank 1 waits in the
step's all-reduce; the job finishes.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=6)
SLEEP_S = 4.0


def load_batch(rank: int, step: int, mode: str) -> torch.Tensor:
    """The data loader: this rank's tokens of ``step``."""
    if mode == "sleep" and rank == 0 and step == 2:
        time.sleep(SLEEP_S)  # SLOW_LOADER
    if mode == "hang" and rank == 1 and step == 2:
        return torch.ones(0, 8)  # ZERO_TOKENS
    if mode == "hang" and rank == 1 and step == 3:
        return torch.ones(4, 8, dtype=torch.float64)  # EVAL_TOKENS
    return torch.ones(4, 8)


def main() -> None:
    store = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "hang"
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    agent = Agent(store=store, run="steps" if mode == "hang" else "loader")
    tokens = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="tokens")
    evals = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="eval")
    torch.manual_seed(0)
    net = agent.watch(torch.nn.Linear(8, 8))

    def route(x):
        y = net(x.to(torch.float32))
        if x.shape[0] > 0:  # TOKEN_BRANCH
            r = funcol.all_reduce(y.detach().to(x.dtype), "sum", tokens if x.dtype == torch.float32 else evals)
            return y, r.sum()
        return y, None

    fn = torch.compile(route, backend=agent.backend("aot_eager"), dynamic=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(5):
        x = load_batch(rank, step, mode)
        y, _reduced = fn(x)
        (y.sum() + sum(p.sum() for p in net.parameters()) * 0).backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
