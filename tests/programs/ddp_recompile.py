"""A 2-rank gloo DDP job that recompiles on one rank and finishes fine (issue 19, "Tried as a new
user would", second bullet), captured by the graphdeck agent as run ``ddp_recompile``:

    torchrun --standalone --nproc-per-node 2 tests/programs/ddp_recompile.py STORE

A compiled DDP model (DDPOptimizer splits its graph into buckets) trains 3 steps; at step 1
rank 1's batch has 6 rows instead of 4, so rank 1 recompiles its forward (compile 0/1, automatic
dynamic shapes) and rank 0 does not. The forward all-reduces a [512] batch statistic inside the
graph (the same size on both ranks), and both ranks all-reduce the same gradient buckets every
step: the job completes. The agent turns the Flight Recorder on and dumps it on ``close()``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from graphdeck.capture import Agent  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))  # 1 MiB each

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        # batch statistics synchronised across ranks (as SyncBatchNorm does): one all_reduce
        # inside the compiled graph, of a [512] tensor whatever the batch
        mean = funcol.all_reduce(x.detach().mean(0), "avg", dist.group.WORLD)  # GRAPH_ALL_REDUCE
        return x - mean


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agent = Agent(store=sys.argv[1], run="ddp_recompile")
    torch.manual_seed(0)
    model = agent.watch(Net())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)  # a layer a bucket
    compiled = torch.compile(ddp, backend=agent.backend("aot_eager"))
    for step in range(3):
        rows = 6 if (rank == 1 and step == 1) else 4
        compiled(torch.randn(rows, 512)).sum().backward()
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
