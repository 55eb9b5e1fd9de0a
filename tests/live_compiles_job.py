"""Frames compiled more than once, where the older graph still runs or not (issue 19: a recompile
that *adds* a cache entry vs one that *replaces* a graph; NOTE: [Live compiles] in
graphdeck/analysis/ranks/frame_compiles.py). Two gloo ranks, CPU, 10 s collective timeout:

    torchrun --standalone --nproc-per-node 2 tests/live_compiles_job.py STORE

Each run compiles ``step`` (``dynamic=False``: static shapes), whose graph all-reduces its
activations — so the collective's size follows the batch — with the same inputs on both ranks:

* ``alternate``: batches of 4 and 6 rows alternate; compile 0/1 (6 rows) *adds* a cache entry
  beside 0/0 and both graphs run every other step. A profiler window over two steps (the
  agent's ``profile``) shows both ``Torch-Compiled Region`` ranges;
* ``alternate_untraced``: the same without a trace: the compile records alone cannot tell
  whether 0/0 still runs;
* ``switch``: float32 inputs, then float64 from step 2 on: compile 0/1 (a dtype guard) takes
  over and 0/0 never runs again; the profiler window (steps 3-4) shows 0/1 only.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

STEPS = 6


def run(store: str, name: str, traced: bool) -> None:
    torch._dynamo.reset()
    agent = Agent(store=store, run=name)
    w = torch.ones(8, 8)

    def step(x):
        y = torch.relu(x @ w.to(x.dtype))
        return funcol.all_reduce(y, "sum", dist.group.WORLD).sum()  # STEP_ALL_REDUCE

    fn = torch.compile(step, backend=agent.backend("aot_eager"), dynamic=False)
    prof = agent.profile(wait_steps=1 if name != "switch" else 2, warmup_steps=1, active_steps=2) if traced else None
    if prof is not None:
        prof.__enter__()
    for i in range(STEPS):
        if name == "switch":
            x = torch.ones(4, 8, dtype=torch.float32 if i < 2 else torch.float64)
        else:
            x = torch.ones(4 if i % 2 == 0 else 6, 8)
        fn(x)
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.__exit__(None, None, None)
    agent.close()


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    for name, traced in (("alternate", True), ("alternate_untraced", False), ("switch", True)):
        run(sys.argv[1], name, traced)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
