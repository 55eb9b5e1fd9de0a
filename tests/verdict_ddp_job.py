"""Real DDP jobs whose outcome a prediction must match (issue 34), 2 gloo ranks on CPU:

    torchrun --standalone --nproc-per-node 2 tests/verdict_ddp_job.py STORE OUT.json

Runs, each captured with graphdeck's Agent (``agent.watch(model)`` then DDP), each ending normally:

* ``unused_static`` — ``torch.compile(DDP(model, static_graph=True))`` (aot_eager) whose ``aux``
  Linear is never used: DDP's static graph finds it unused in the first iteration, so no step
  raises (``find_unused_parameters`` is False); 5 steps.
* ``lora_silent`` — eager ``DDP(model)`` (``find_unused_parameters=False``), one LoRA adapter used in
  two calls under *reentrant* activation checkpointing, the head the only other trainable
  module: DDP finishes its iteration before the second accumulation, which stays local: no error,
  and the replicas' LoRA gradients differ; 3 steps.
* ``lora_raises`` — the same LoRA model with a trainable ``embed`` Linear before the checkpoints: its
  first accumulation comes last, so the second accumulation of the LoRA weights comes while DDP still
  listens: the first backward raises "Expected to mark a variable ready only once" on both ranks.
* ``twice`` — eager ``DDP(model)``, a Linear used twice in one forward without checkpointing (autograd
  sums both uses into one accumulation: nothing for DDP to object to); 3 steps.

OUT.json (written by rank 0): per run, ``steps`` completed, ``error`` (None: no rank raised),
``max_diff`` — the largest gradient difference between the ranks after the last backward, per
parameter (0.0: the replicas agree) — and ``eager``: the findings of graphdeck's eager mode
(``validate_backward(ddp_model, inputs)``) on the same DDP-wrapped model, as dicts.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

D = 8


class WithAux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = torch.nn.Linear(D, D), torch.nn.Linear(D, 1), torch.nn.Linear(D, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))  # aux: never used


class LoRA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(D, D).requires_grad_(False)
        self.lora_a = torch.nn.Linear(D, 2, bias=False)
        self.lora_b = torch.nn.Linear(2, D, bias=False)

    def forward(self, x):
        return torch.relu(self.base(x) + self.lora_b(self.lora_a(x)))


class SharedLoRA(torch.nn.Module):
    """One LoRA block in two reentrant-checkpointed calls, then a head."""

    def __init__(self):
        super().__init__()
        self.block, self.head = LoRA(), torch.nn.Linear(D, 1)

    def forward(self, x):
        h = ckpt.checkpoint(self.block, x, use_reentrant=True)
        h = ckpt.checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


class EmbedLoRA(SharedLoRA):
    """:class:`SharedLoRA` after a trainable ``embed`` (the last parameter to become ready)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(D, D)

    def forward(self, x):
        return super().forward(self.embed(x))


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = torch.nn.Linear(D, D), torch.nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.lin(torch.relu(self.lin(x))))


def run(store: str, name: str, make, steps: int, *, compiled: bool = False, x_grad: bool = False, **ddp_kw) -> dict:
    rank = dist.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    agent = Agent(store=store, run=name)
    agent.watch(model)
    ddp = DDP(model, **ddp_kw)
    from graphdeck import validate_backward

    probe = torch.randn(4, D, generator=torch.Generator().manual_seed(99)).requires_grad_(x_grad)
    eager = [f.__dict__ for f in validate_backward(ddp, (probe,), lambda out: out.sum()).findings]
    fn = torch.compile(ddp, backend=agent.backend("aot_eager")) if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(10 + rank)
    done, error, diff = 0, None, {}
    try:
        for _ in range(steps):
            x = torch.randn(4, D, generator=gen).requires_grad_(x_grad)
            fn(x).sum().backward()
            diff = {}
            for n, p in model.named_parameters():
                if p.grad is not None:
                    both = [torch.zeros_like(p.grad) for _ in range(2)]
                    dist.all_gather(both, p.grad.contiguous())
                    diff[n] = float((both[0] - both[1]).abs().max())
            opt.step()
            opt.zero_grad()
            done += 1
    except RuntimeError as exc:
        error = str(exc).splitlines()[0][:200]
    agent.close()
    return {"steps": done, "error": error, "max_diff": diff, "eager": eager}


def main() -> None:
    store, out = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    res = {
        "unused_static": run(store, "unused_static", WithAux, 5, compiled=True, static_graph=True),
        "lora_silent": run(store, "lora_silent", SharedLoRA, 3, x_grad=True),
        "lora_raises": run(store, "lora_raises", EmbedLoRA, 3, x_grad=True),
        "twice": run(store, "twice", Twice, 3),
    }
    dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
