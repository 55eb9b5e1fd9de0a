"""A zero-token mixture-of-experts rank skips a data-parallel all-reduce (issue 38, item 5),
captured by the graphdeck agent as run ``moe``:

    torchrun --standalone --nproc-per-node 2 tests/programs/moe_zero_token.py STORE

Each rank's layer uses its own slice of the expert gates (``self.lo = 2 * rank``: expert
parallel, a per-rank constant by design, so the ranks' graphs differ in that constant only), and
all-reduces its activations over the ``dp`` group (3 s timeout) only when its batch has tokens.
At step 1 rank 1's router sends it none: it recompiles into a graph without the all-reduce (static
shapes), so from then on rank 0 issues one all-reduce more; rank 0 times out at step 2, catches
it (as a trainer that retries would), and both ranks end normally, each dumping its recorder into
the store at exit.
"""

from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from graphdeck.capture import Agent

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    agent = Agent(store=sys.argv[1], run="moe")
    dp = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3), group_desc="dp")

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gates = torch.nn.Parameter(torch.ones(4))
            self.proj = torch.nn.Linear(8, 8)
            self.lo = 2 * rank  # EXPERT_SLICE: this rank's two experts (expert parallel, by design)

        def forward(self, x):
            h = self.proj(x) * self.gates[self.lo:self.lo + 2].sum()
            if x.shape[0] > 0:  # ZERO_TOKEN_BRANCH: a rank that got no token skips the data-parallel sync
                h = funcol.all_reduce(h, "sum", dp)
            return h

    model = agent.watch(Experts())
    compiled = torch.compile(model, backend=agent.backend("aot_eager"), dynamic=False)
    with torch.no_grad():
        compiled(torch.ones(4, 8))  # compiled before the first timed collective
    dist.barrier()
    try:
        with torch.no_grad():
            for step in range(3):
                tokens = 0 if (rank == 1 and step == 1) else 4
                compiled(torch.ones(tokens, 8)).sum().item()
    except RuntimeError as exc:
        print(f"rank {rank}: timed out: {str(exc)[:100]}", flush=True)
    dist.barrier()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
