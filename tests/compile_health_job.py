"""Jobs for tests/test_compile_health.py, captured by the graphdeck Agent (aot_eager), one store:

* run ``shapes``: ``post_orthogonalize`` compiled and called under ``no_grad`` on each parameter
  of a model whose nine parameters have nine shapes (a Muon-style per-parameter step): parameters
  keep static shapes (``force_parameter_static_shapes``), so torch itself compiles 0/0 … 0/7 on the
  shape guard and the 9th hits the recompile limit (8) and runs eagerly — with or without capture
  (a detached copy would go dynamic after one recompile: NOTE: [The capture adds no guard]);
* run ``n8`` (case N8 of ../shared/cases/compile-and-ranks.md in one process; run ``n8-ddp``,
  below, is the case as written, under DDP on 2 ranks): each layer counts
  ``n = int((x > 0).sum().item())``, the top-level forward also logs ``loss.item()``;
* run ``shapes-fullgraph``: the same loop under ``fullgraph=True``; the 9th compile raises and the
  job dies with ``os._exit`` (no ``close()``, no atexit): what the store holds was written as the
  records arrived.

Usage: ``python tests/compile_health_job.py STORE`` (exit 17 after the fullgraph failure); and
``torchrun --standalone --nproc-per-node 2 tests/compile_health_job.py STORE ddp``: run ``n8-ddp``,
case N8 as written (``torch.compile(DDP(model))``, 2 gloo ranks).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # as the other jobs

from graphdeck.capture import Agent  # noqa: E402

SHAPES = 9


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(4 + i, 3)) for i in range(SHAPES))


def post_orthogonalize(p):
    g = p @ p.T
    return (g / g.norm()).sum()


def shapes(store: str, run: str, fullgraph: bool) -> None:
    torch._dynamo.reset()
    agent = Agent(store=store, run=run)
    model = Shapes()
    step = torch.compile(post_orthogonalize, backend=agent.backend("aot_eager"), fullgraph=fullgraph)
    try:
        with torch.no_grad():
            for p in model.parameters():
                step(p)
    except Exception as exc:  # the 9th compile under fullgraph=True
        print(f"job raised: {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        os._exit(17)  # dies here: no close(), no atexit flush
    agent.close()


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        n = int((x > 0).sum().item())
        return torch.tanh(self.lin(x)) * (n / x.numel())


class N8(nn.Module):
    def __init__(self, d=16, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        loss = x.pow(2).mean()
        self.logged = {"loss": loss.item()}
        return loss


def n8(store: str, steps: int = 3) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    agent = Agent(store=store, run="n8")
    model = agent.watch(N8())
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        compiled(torch.randn(64, 16, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    agent.close()


def n8_ddp(store: str, steps: int = 3) -> None:
    """Case N8 as the case is written: ``torch.compile(DDP(model))`` on 2 gloo ranks (run
    ``n8-ddp``; 60 s collective timeout, so a stuck rank ends the job)."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    agent = Agent(store=store, run="n8-ddp")
    model = agent.watch(N8())
    compiled = torch.compile(DDP(model), backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        compiled(torch.randn(64, 16, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[2:] == ["ddp"]:  # torchrun --standalone --nproc-per-node 2 tests/compile_health_job.py STORE ddp
        n8_ddp(sys.argv[1])
        sys.exit(0)
    shapes(sys.argv[1], "shapes", fullgraph=False)
    n8(sys.argv[1])
    shapes(sys.argv[1], "shapes-fullgraph", fullgraph=True)
    sys.exit(0)  # not reached: the fullgraph run raises
