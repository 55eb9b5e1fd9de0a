"""Multi-rank programs whose ranks compile differently (run under torchrun, 2 ranks, gloo).

Each case is captured as its own run in the store given as argv[1]:

* ``dynshape`` — rank 1's second batch has another length: a recompile (automatic dynamic shape) on
  rank 1 only.
* ``branch`` — a Python flag that is set on rank 1 only takes a branch with one more op and one
  more functional ``all_reduce`` inside the compiled graph. So that this test run itself does not
  hang, rank 0 issues the matching all-reduce eagerly, outside the compiled region; the compiled
  graphs' collective schedules still differ, which is what the checker reads.
* ``g4`` — gradient case G4: an embedding used only when the local batch has targets (rank 0 gets
  none). DDP; forward only (a backward would hang, which is the point of the case).
* ``c1`` — compile case C1: one frame compiled twice, the recompile caused by the input's
  ``requires_grad`` guard (same on both ranks, so the ranks agree).
* ``c2`` — compile case C2: a mixture-of-experts loop over ``counts.tolist()``; the token counts
  differ by rank, so ranks break and recompile differently.
* ``fsdp2_uneven`` — the 2 x H200 FSDP2 job in small (issue 11): an embedding with an odd
  vocabulary (37 rows) and the whole model under ``fully_shard``, forward compiled, and the AdamW
  step (``foreach``) compiled too. Its graph holds each rank's local shard: 19 rows on rank 0,
  18 on rank 1 — the same program with rank-dependent shard shapes, not a divergence.
* ``collective_shape`` — each rank compiles a function that all-reduces a tensor of
  ``5 - rank`` rows (a shape-only difference feeding a collective: a real divergence, though
  5 and 4 rows are what an uneven split of 9 rows would give). Compiled
  but never run (the inner backend returns a function that raises), since running it would
  corrupt or hang; the graphs are recorded at compile time.
* ``shape_dim1`` — each rank compiles a function on a ``[4, 8 + 2 * rank]`` input (same program,
  shapes differ outside dim 0, no collective): a "different shapes" divergence.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from graphdeck.capture import Agent

STORE = sys.argv[1]
CASES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["dynshape", "branch", "g4", "c1", "c2", "fsdp2_uneven", "collective_shape",
                                                                 "shape_dim1"]


def fresh(name: str) -> Agent:
    torch._dynamo.reset()
    torch.manual_seed(0)
    return Agent(store=STORE, run=name)


def case_dynshape(rank: int) -> None:
    agent = fresh("dynshape")
    model = agent.watch(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    for step in range(2):
        rows = 6 if (rank == 1 and step == 1) else 4
        compiled(torch.randn(rows, 8)).sum().backward()
    agent.close()


class Branchy(torch.nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        self.extra = extra

    def forward(self, x):
        h = funcol.all_reduce(self.a(x), "sum", dist.group.WORLD)
        if self.extra:
            h = torch.tanh(h)
            h = funcol.all_reduce(h, "sum", dist.group.WORLD)
        return self.b(h)


def case_branch(rank: int) -> None:
    agent = fresh("branch")
    model = agent.watch(Branchy(extra=rank == 1))
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    x = torch.randn(4, 8)
    with torch.no_grad():
        compiled(x)
    if rank == 0:  # keep the real run in step (see module docstring)
        dist.all_reduce(torch.zeros(4, 8))
    agent.close()


class G4(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Linear(8, 8)
        self.dn_embed = torch.nn.Embedding(10, 8)

    def forward(self, x, targets):
        h = self.main(x)
        if targets.numel() > 0:
            h = h + self.dn_embed(targets).mean(0)
        return h


def case_g4(rank: int) -> None:
    agent = fresh("g4")
    model = agent.watch(G4())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    compiled = torch.compile(ddp, backend=agent.backend("aot_eager"))
    targets = torch.zeros(0, dtype=torch.long) if rank == 0 else torch.tensor([1, 2, 3])
    compiled(torch.randn(4, 8), targets)
    agent.close()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.trainable = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.trainable(self.frozen(x))


def case_c1(rank: int) -> None:
    agent = fresh("c1")
    blocks = agent.watch(torch.nn.ModuleList([Block(), Block()]))
    compiled = [torch.compile(b, backend=agent.backend("aot_eager")) for b in blocks]
    x = torch.randn(4, 8)
    h = compiled[0](x)  # input does not require grad
    out = compiled[1](h)  # input requires grad (output of a trainable Linear)
    out.sum().backward()
    agent.close()


class MoE(torch.nn.Module):
    def __init__(self, n_experts: int = 4):
        super().__init__()
        self.router = torch.nn.Linear(8, n_experts)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(n_experts)])

    def forward(self, x):
        logits = self.router(x)
        choice = logits.argmax(-1)
        counts = torch.bincount(choice, minlength=len(self.experts))
        order = torch.argsort(choice)
        xs = x[order]
        out, start = [], 0
        for i, n in enumerate(counts.tolist()):
            out.append(self.experts[i](xs[start:start + n]))
            start += n
        return torch.cat(out)


def case_c2(rank: int) -> None:
    agent = fresh("c2")
    model = agent.watch(MoE())
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    gen = torch.Generator().manual_seed(100 + rank)  # different tokens, so different counts, per rank
    for _ in range(2):
        compiled(torch.randn(16, 8, generator=gen)).sum().backward()
    agent.close()


class Uneven(torch.nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(torch.relu(self.block(self.embed(tokens))))


def case_fsdp2_uneven(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    agent = fresh("fsdp2_uneven")
    model = agent.watch(Uneven())
    fully_shard(model.block)
    fully_shard(model)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    step = torch.compile(opt.step, backend=agent.backend("aot_eager"))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        tokens = torch.randint(0, 37, (2, 8), generator=gen)
        compiled(tokens).logsumexp(-1).mean().backward()
        step()
        opt.zero_grad(set_to_none=True)
    agent.close()


class NotRun(Exception):
    """Raised instead of running a graph that is only recorded (see ``compile_only``)."""


def compile_only(gm, example_inputs):
    """An inner backend that compiles nothing: the graph is recorded (by the graphdeck backend
    around it) and calling it raises :class:`NotRun`, so a collective of rank-dependent size
    never runs on the real process group."""
    def never(*args):
        raise NotRun(gm.__class__.__name__)
    return never


def _record_only(fn, x) -> None:
    try:
        fn(x)
    except NotRun:
        pass


def case_collective_shape(rank: int) -> None:
    agent = fresh("collective_shape")

    def reduce_rows(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    _record_only(torch.compile(reduce_rows, backend=agent.backend(compile_only)), torch.randn(5 - rank, 8))
    agent.close()


def case_shape_dim1(rank: int) -> None:
    agent = fresh("shape_dim1")

    def f(x):
        return torch.tanh(x) * 2

    torch.compile(f, backend=agent.backend("aot_eager"))(torch.randn(4, 8 + 2 * rank))
    agent.close()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name in CASES:
        globals()[f"case_{name}"](rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
