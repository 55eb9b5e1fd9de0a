"""The capture matrix's pipelining variant, with or without graphdeck's capture (issue 34):

    python tests/capture_matrix_pipeline.py {plain|capture} STORE OUT_JSON   (PORT: a free TCP port)

Two gloo ranks (``torch.multiprocessing.spawn``), one ``torch.distributed.pipelining`` stage
each, the stage module compiled (``aot_eager``; through ``agent.backend`` with the capture, which
watches the stage module and is never told about the pipeline), ``Schedule1F1B`` over 4
microbatches of a batch of 8, 3 steps of SGD. OUT_JSON gets what tests/capture_matrix_job.py
writes, over both ranks: the last stage's microbatch losses per step, per step a SHA-256 of each
rank's parameters and gradients, and per rank what torch decided at each compile (compile rows
and shape lines prefixed by the rank).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.capture_matrix_job import STEPS, ShapeLog, decisions, digest  # noqa: E402

MICROBATCHES = 4


class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.b(torch.relu(self.a(x))))


class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.c(x)))


def rank_main(rank: int, mode: str, store: str, out: str, port: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    shape_log = ShapeLog()
    torch._logging.set_logs(dynamic=logging.INFO)
    logging.getLogger("torch.fx.experimental.symbolic_shapes").addHandler(shape_log)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    module = Stage0() if rank == 0 else Stage1()
    agent = None
    backend = "aot_eager"
    if mode == "capture":
        from graphdeck.capture import Agent

        agent = Agent(store=store, run="pipeline")
        agent.watch(module)
        backend = agent.backend("aot_eager")
    compiled = torch.compile(module, backend=backend)
    stage = PipelineStage(compiled, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    result: dict = {"losses": [], "digests": []}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, target = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
        if rank == 0:
            schedule.step(x)
        else:
            losses: list = []
            schedule.step(target=target, losses=losses)
            result["losses"].append([loss.item().hex() for loss in losses])
        result["digests"].append(digest(module))
        opt.step()
        opt.zero_grad()
    result.update(decisions(shape_log))
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    if agent is not None:
        agent.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    mode, store, out = sys.argv[1:4]
    torch.multiprocessing.spawn(rank_main, args=(mode, store, out, os.environ["PORT"]), nprocs=2)
    ranks = []
    for r in range(2):
        with open(f"{out}.rank{r}") as f:
            ranks.append(json.load(f))
    merged = {"losses": ranks[1]["losses"], "digests": [a + b for a, b in zip(ranks[0]["digests"], ranks[1]["digests"])],
              "compiles": [[r, *row] for r, d in enumerate(ranks) for row in d["compiles"]],
              "shapes": [f"rank {r}: {line}" for r, d in enumerate(ranks) for line in d["shapes"]]}
    with open(out, "w") as f:
        json.dump(merged, f)


if __name__ == "__main__":
    main()
