"""Reference-parity cases (issue 35, item 3): a tiny language model whose lm head is vocab-parallel
(``ColwiseParallel(use_local_output=False)``: the logits are a ``DTensor`` sharded on the vocab
dimension) on a 1-D ``tp`` mesh of every rank, its loss under ``loss_parallel()``:

    graphdeck parity --store S --nproc 2 -- tests/grad_parity_job.py CASE

``handwritten``: the token log-likelihood written by hand on the vocab-sharded ``log_softmax``
(``-(log_softmax(logits) * one_hot).sum() / tokens``, as in pytorch/pytorch#190746). The forward
is right (``loss_parallel``'s ``_log_softmax`` all-reduces), but its backward handler returns the
incoming gradient unchanged (it assumes an ``nll_loss`` consumer that folds the softmax Jacobian
in): the lm head and everything below it get a wrong gradient, nothing raises.
``ce``: ``F.cross_entropy`` on the same logits, the supported way (right gradients).
``*_compiled``: the model through ``torch.compile`` (the agent's ``aot_eager`` backend), the loss eager.

The mesh has as many ranks as the job (1 for the reference run); every rank draws the same
batch (seeded generator), as tensor-parallel ranks must.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

VOCAB, DIM, STEPS = 16, 8, 2


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.proj(self.embed(tokens))))


def main() -> None:
    store, case = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = TinyLM()
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
    agent = Agent(store=store, run=case)
    agent.watch(model)
    step_fn = torch.compile(model, backend=agent.backend("aot_eager")) if case.endswith("_compiled") else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        tokens = torch.randint(VOCAB, (2, 6), generator=gen)
        targets = torch.randint(VOCAB, (2, 6), generator=gen)
        with loss_parallel():
            logits = step_fn(tokens)  # DTensor, Shard(-1): each rank holds its slice of the vocab
            if case.startswith("handwritten"):
                logp = F.log_softmax(logits, dim=-1)
                mask = distribute_tensor(F.one_hot(targets, VOCAB).float(), mesh, [Shard(-1)])
                loss = -(logp * mask).sum() / targets.numel()  # PARITY-BUG
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
