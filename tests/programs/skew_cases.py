"""Rank timing cases on 2 gloo ranks (torchrun): a straggler and a compile skew.

Run as::

    python tests/programs/skew_cases.py prewarm CACHE_DIR STORE    # one process: fill CACHE_DIR
    torchrun --standalone --nproc-per-node 2 tests/programs/skew_cases.py job STORE WARM_DIR COLD_DIR [DONE]

``prewarm`` compiles the cache-skew model with Inductor into ``CACHE_DIR`` (a previous job
that left a warm cache), then writes ``CACHE_DIR.done``. ``job`` runs both cases, each captured
as its own run in ``STORE`` (with ``DONE``, it waits for that file before the second case, so
a prewarm may run beside the first):

* ``gloo_straggler`` — DDP (gloo) over a 3-layer MLP compiled with ``aot_eager``; rank 1 sleeps
  ``SLOW_S`` in a backward hook of its first layer's weight every step, so rank 0 waits for it
  inside DDP's ``gloo:all_reduce``. Steps 2-4 are profiled (Kineto traces stored per rank), after
  DDP's bucket rebuild at step 1 (two ``gloo:broadcast`` from rank 0).
* ``cache_skew`` — one ``nn.Linear`` compiled with Inductor, forward and backward, then its
  gradients all-reduced (the first collective). Rank 0's ``TORCHINDUCTOR_CACHE_DIR`` is the
  pre-warmed ``WARM_DIR``, rank 1's the empty ``COLD_DIR``: rank 0 is served from the FX graph
  and AOTAutograd caches, rank 1 compiles from scratch, and rank 0 waits for it in that first
  all-reduce (profiled: step 0).

The process group's timeout is ``TIMEOUT_S`` (recorded by the Flight Recorder when it is on).
"""

import os
import sys
import time
from datetime import timedelta

SLOW_S = 1.0  # long enough that a loaded 2-core machine's noise (~0.1-0.2 s a step) cannot reorder the ranks
TIMEOUT_S = 120


def configure(argv: list[str]) -> None:
    """Each rank's own Inductor cache directory, set before torch loads Inductor."""
    if argv[1] == "job":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = argv[3] if os.environ.get("RANK") == "0" else argv[4]
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = argv[2]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def skew_model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def skew_step(compiled, x):
    compiled(x).square().sum().backward()


def prewarm(store: str) -> None:
    """Compile as the job does (through the agent's backend, whose Inductor config is part of the
    cache key), into a throwaway store."""
    from graphdeck.capture import Agent

    agent = Agent(store=store, run="prewarm")
    model = agent.watch(skew_model())
    skew_step(torch.compile(model, backend=agent.backend("inductor")), torch.randn(4, 8))
    agent.close()
    with open(sys.argv[2].rstrip("/") + ".done", "w"):
        pass


def case_straggler(store: str, rank: int) -> None:
    import torch.distributed as dist  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphdeck.capture import Agent

    torch._dynamo.reset()
    torch.manual_seed(0)
    agent = Agent(store=store, run="gloo_straggler")
    model = agent.watch(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    ddp = DDP(model)
    if rank == 1:
        def slow(grad):
            time.sleep(SLOW_S)
            return grad

        model[0].weight.register_hook(slow)
    compiled = torch.compile(ddp, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with agent.profile(wait_steps=2, warmup_steps=0, active_steps=3) as prof:
        for _ in range(5):
            compiled(torch.randn(8, 16, generator=gen)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    agent.close()


def case_cache_skew(store: str, rank: int) -> None:
    import torch.distributed as dist

    from graphdeck.capture import Agent

    torch._dynamo.reset()
    agent = Agent(store=store, run="cache_skew")
    model = agent.watch(skew_model())
    compiled = torch.compile(model, backend=agent.backend("inductor"))
    with agent.profile(wait_steps=0, warmup_steps=0, active_steps=1) as prof:
        skew_step(compiled, torch.randn(4, 8))
        for p in model.parameters():
            dist.all_reduce(p.grad)
        prof.step()
    agent.close()


def job(store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    case_straggler(store, rank)
    done = sys.argv[5] if len(sys.argv) > 5 else None
    while done and not os.path.exists(done):
        time.sleep(0.2)
    dist.barrier()
    case_cache_skew(store, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    configure(sys.argv)
    import torch  # noqa: E402  (after configure: the cache directory is read when Inductor loads)

    prewarm(sys.argv[3]) if sys.argv[1] == "prewarm" else job(sys.argv[2])
