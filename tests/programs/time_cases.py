"""Time verdicts on 2 gloo ranks (issue 38 items 2, 3, 6): one job, two captured runs, each rank
its own process (no torchrun: a rank that dies does not take the other down before it has
finished what it was doing, so both ranks' compile records reach the store)::

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/programs/time_cases.py STORE

* ``recompile_straggler`` — a ``LAYERS``-layer MLP compiled with ``aot_eager`` (``dynamic=False``); each
  step: forward, backward, the gradients all-reduced as one flat tensor (``GRAD_ALL_REDUCE``), an
  SGD step. Step 0 compiles on both ranks (not profiled); steps 1-3 are profiled (Kineto traces
  per rank). At step 2 rank 1's batch has 5 rows: rank 1 alone recompiles (a guard on the
  input's size fails) forward and backward, and rank 0 waits for it inside the all-reduce. In the
  profiled steps rank 1 starts its step once rank 0 has reached its all-reduce (``ARRIVAL_ORDER``,
  a key in the job's c10d store): rank 1 arrives last at every step whatever a loaded host does to
  either rank, by its step's own work at steps 1 and 3 and by its recompile at step 2.
* ``compile_timeout`` — each step evaluates (``evaluate``: ``EVAL_LAYERS`` unrolled layers) then
  trains a small model, both compiled with ``aot_eager``. Rank 1 is warm: it compiled the
  evaluation ahead, before the barrier that starts the steps; rank 0 is cold: it compiles it at
  its first use, in step 0. Both ranks compile the same frames in the same order (no divergence).
  The gradients are all-reduced in a process group whose timeout is ``TIMEOUT_S``: rank 1 waits
  there past the timeout and dies (uncaught), rank 0 finishes its compile, enters the all-reduce
  and dies too. The job fails.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from graphdeck.capture import Agent  # noqa: E402

TIMEOUT_S = 2  # the gradient group's collective timeout in case 2 (rank 0's extra compile takes several s)
EVAL_LAYERS = 1000  # unrolled layers of rank 0's evaluation frame: ~7 s of aot_eager compile on a loaded 2-core box
LAYERS = 64  # rank 1's recompile (~2-3 s) must outweigh what a loaded host adds to any one step (24: ~1 s lost to it)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def train_step(compiled, model, opt, x, group=None, arrived=None) -> None:
    compiled(x).square().sum().backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    if arrived is not None:
        arrived()
    dist.all_reduce(flat, group=group)  # GRAD_ALL_REDUCE
    opt.step()
    opt.zero_grad()


def case_recompile(store: str, rank: int) -> None:
    agent = Agent(store=store, run="recompile_straggler")
    model = agent.watch(mlp())
    compiled = torch.compile(model, backend=agent.backend("aot_eager"), dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    kv = dist.distributed_c10d._get_default_store()
    with agent.profile(wait_steps=1, warmup_steps=0, active_steps=3) as prof:
        for step in range(4):
            rows = 5 if (rank == 1 and step == 2) else 4  # RANK_ONE_BATCH: rank 1 alone recompiles at step 2
            arrived = None
            if step > 0 and rank == 0:  # ARRIVAL_ORDER: rank 0 says it reached the all-reduce
                arrived = lambda step=step: kv.set(f"time_cases/arrived/{step}", "1")  # noqa: E731
            elif step > 0:  # rank 1 starts its step only then: it arrives last whatever the host's load
                kv.wait([f"time_cases/arrived/{step}"], timedelta(seconds=600))
            train_step(compiled, model, opt, torch.randn(rows, 16, generator=gen), arrived=arrived)
            if step == 0:
                dist.barrier()  # both ranks out of their first compile before the profiled steps
            prof.step()
    agent.close()


def evaluate(x, w):
    y = x
    for _ in range(EVAL_LAYERS):
        y = torch.tanh(y @ w) + y * 0.5
    return y.sum()


def case_compile_timeout(store: str, rank: int) -> None:
    torch._dynamo.reset()
    agent = Agent(store=store, run="compile_timeout")
    grads = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S), group_desc="grad_sync")
    torch.manual_seed(0)
    model = agent.watch(torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ev = torch.compile(evaluate, backend=agent.backend("aot_eager"))
    if rank == 1:  # WARM: rank 1 compiled the evaluation ahead (before the barrier); rank 0 at its first use
        with torch.no_grad():
            ev(torch.randn(4, 16), torch.eye(16))
    dist.barrier()  # default group, long timeout: what follows is the skew
    for _step in range(2):
        with torch.no_grad():
            ev(torch.randn(4, 16), torch.eye(16))  # EVALUATE: rank 0 compiles it here (cold), rank 1 is warm
        train_step(compiled, model, opt, torch.randn(4, 16), group=grads)
    agent.close()


def main() -> None:
    store = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    case_recompile(store, rank)
    dist.barrier()
    case_compile_timeout(store, rank)  # dies at step 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
