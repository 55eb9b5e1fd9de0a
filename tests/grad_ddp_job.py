"""The multi-rank gradient cases in one torchrun job (2 gloo ranks, CPU): each case is its own run
in one store, captured through the graphdeck backend around ``torch.compile(DDP(model))``.

    torchrun --standalone --nproc-per-node 2 tests/grad_ddp_job.py STORE OUT_JSON [CASE ...]

Cases: ``g1`` (aot_eager, 2 steps: step 2 raises DDP's "Expected to have finished reduction"),
``g1_inductor`` (the same with Inductor), ``g2`` (1 step; the compiled run silently gives
``tgt_head`` zero gradients; 1 MiB weights and buckets, so the graph is split), ``g3`` (forward only: step 2 would raise), ``g4`` (forward only: rank 0
gets an empty target batch, rank 1 a non-empty one; the backward would hang), ``g5`` (2 steps,
``find_unused_parameters=True``: silent; split into buckets too). ``OUT_JSON`` (rank 0) receives what each step raised.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402
from tests import grad_cases as C  # noqa: E402

WIDE = 512  # a 512x512 float32 weight is 1 MiB: one DDP bucket each at bucket_cap_mb=1


def run_case(store: str, case: str, rank: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = "inductor" if case.endswith("_inductor") else "aot_eager"
    name = case.removesuffix("_inductor")
    find_unused = name == "g5"
    # G2 and G5 with 1 MiB weights and 1 MiB buckets: DDPOptimizer splits their graphs.
    wide = {"d": WIDE} if name in ("g2", "g5") else {}
    model = {"g1": C.UnusedExtra, "g2": C.TwoHeads, "g3": C.NoGradHelper, "g4": C.BranchOnBatch,
             "g5": C.DetachInMiddle}[name](**wide)
    agent = Agent(store=store, run=case)
    agent.watch(model)
    ddp = DDP(model, find_unused_parameters=find_unused, **({"bucket_cap_mb": 1} if wide else {}))
    compiled = torch.compile(ddp, backend=agent.backend(backend))
    steps = {"g1": 2, "g2": 1, "g3": 1, "g4": 1, "g5": 2}[name]
    outcome = {"errors": [], "steps_done": 0}
    if case == "g1":
        # Eager mode on the DDP-wrapped model before training: it must not disturb DDP (step 1
        # below still works; step 2 fails only because of the unused parameters).
        from graphdeck import validate_backward

        rep = validate_backward(ddp, (torch.randn(4, C.D),), lambda out: out.sum())
        outcome["eager"] = {r.fqn: r.status for r in rep}
        outcome["eager_findings"] = [f.kind for f in rep.findings]
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if name == "g5":
            x = torch.randint(0, 16, (4, 3), generator=gen)
            inputs = (x,)
        elif name == "g4":
            targets = torch.zeros(0, dtype=torch.long) if rank == 0 else torch.tensor([1, 2, 3])
            inputs = (torch.randn(4, C.D, generator=gen), targets)
        else:
            inputs = (torch.randn(4, WIDE if wide else C.D, generator=gen),)
        try:
            out = compiled(*inputs)
            if name in ("g3", "g4"):
                break  # the forward compiled (and was captured); the backward would fail or hang
            loss = C.g2_loss(out) if name == "g2" else out.sum()
            loss.backward()
            outcome["steps_done"] += 1
        except RuntimeError as exc:
            outcome["errors"].append({"step": step + 1, "message": str(exc)[:300]})
            break
    agent.close()
    return outcome


def main() -> None:
    store, out_json, *cases = sys.argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    for case in cases:
        results[case] = run_case(store, case, rank)
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump(gathered, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
