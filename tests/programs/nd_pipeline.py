"""A 2-stage pipeline (``torch.distributed.pipelining``), each stage compiled, captured (issue 20).

Run under torchrun (one stage per rank)::

    torchrun --standalone --nproc-per-node 2 tests/programs/nd_pipeline.py STORE [--run-name NAME]
        [--schedule gpipe|1f1b] [--microbatches 4] [--steps 2] [--cut-backward] [--die]

Stage 0: ``Linear(16, 32)``, ReLU, ``Linear(32, 32)``; stage 1: ``Linear(32, 32)``, ReLU,
``Linear(32, 4)`` and the loss (MSE). Each rank watches its stage module with the Agent, compiles
it (``aot_eager`` through the agent's backend), wraps it in a ``PipelineStage`` and runs
``ScheduleGPipe`` (or ``Schedule1F1B``) over 4 microbatches of a batch of 8. The agent is never
told about the pipeline: it finds the stage and schedule on the stack of the first compile.

``--cut-backward``: stage 1 detaches its input (``x.detach()``) — its compiled graph returns no
gradient for the activation it received, the schedule sends stage 0 a zero gradient, and stage
0's parameters receive all-zero gradients: a stage boundary where the backward path is cut.
``--die``: ``os._exit(0)`` right after the first step, without ``close()``.
"""

from __future__ import annotations

import argparse
import datetime
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--run-name", default="nd_pipeline")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cut-backward", action="store_true", help="stage 1 detaches its input")
    ap.add_argument("--die", action="store_true", help="os._exit after the first step, no close()")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from graphdeck.capture import Agent

    class Stage0(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    class Stage1(nn.Module):
        def __init__(self, cut: bool):
            super().__init__()
            self.fc3 = nn.Linear(32, 32)
            self.head = nn.Linear(32, 4)
            self.cut = cut

        def forward(self, x):
            if self.cut:
                x = x.detach()  # the backward path to stage 0 ends here
            return self.head(torch.relu(self.fc3(x)))

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "two stages, one per rank"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    agent = Agent(store=args.store, run=args.run_name)
    module = Stage0() if rank == 0 else Stage1(args.cut_backward)
    agent.watch(module)
    compiled = torch.compile(module, backend=agent.backend("aot_eager"))
    stage = PipelineStage(compiled, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule_cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=args.microbatches,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        x, target = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        if rank == 0:
            schedule.step(x)
        else:
            losses: list = []
            schedule.step(target=target, losses=losses)
        opt.step()
        opt.zero_grad()
        if args.die:
            os._exit(0)
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
