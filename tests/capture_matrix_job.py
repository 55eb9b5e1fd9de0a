"""One training job of the capture matrix, with or without graphdeck's capture:

    python tests/capture_matrix_job.py VARIANT {plain|capture} STORE OUT_JSON

Variants: ``agent`` (Agent.watch + agent.backend), ``backend_name`` (``backend="graphdeck"``, no
``close()``), ``ddp`` and ``fsdp2`` (1 gloo rank), ``compiled_autograd`` (the config flag, and
the backward under ``compiled_autograd._enable`` with a ``fullgraph=True`` compiler: Dynamo would
trace the capture's hooks), ``compiled_autograd_enable`` (``_enable`` without fullgraph: the hooks
run eagerly, where ``queue_callback`` is refused),
``fullgraph``, ``warm_cache`` (Inductor, run twice by the test: the second finds warm caches),
``raises`` (step 2's forward raises; the job catches nothing), ``os_exit`` (``os._exit`` after
step 2, no ``close()``). OUT_JSON gets the losses and a SHA-256 of every parameter and gradient's
bytes after each step, so runs with and without capture compare bit for bit.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys

import torch

VARIANT, MODE, STORE, OUT = sys.argv[1:5]
CAPTURE = MODE == "capture"
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(t.contiguous().numpy().tobytes())
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            h.update(g.contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = Net()
    out: dict = {"losses": [], "digests": []}
    dist = VARIANT in ("ddp", "fsdp2")
    if dist:
        import torch.distributed as d

        d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=0, world_size=1,
                             timeout=datetime.timedelta(seconds=60))
    if VARIANT == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a)
        fully_shard(model)
    wrapped = model
    if VARIANT == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    inner = "inductor" if VARIANT == "warm_cache" else "aot_eager"
    agent = None
    if CAPTURE and VARIANT == "backend_name":
        os.environ.update(GRAPHDECK_STORE=STORE, GRAPHDECK_RUN=VARIANT, GRAPHDECK_INNER=inner)
        backend = "graphdeck"
    elif CAPTURE:
        from graphdeck.capture import Agent

        agent = Agent(store=STORE, run=VARIANT)
        agent.watch(wrapped)
        backend = agent.backend(inner)
    else:
        backend = inner
    full = VARIANT in ("fullgraph", "compiled_autograd")
    compiled = torch.compile(wrapped, backend=backend, fullgraph=full)
    if VARIANT == "compiled_autograd":
        torch._dynamo.config.compiled_autograd = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if VARIANT == "raises" and step == 2:
            out["raised_at"] = step
            with open(OUT, "w") as f:
                json.dump(out, f)
            raise RuntimeError("the job fails in step 2's forward")
        loss = compiled(x).square().mean()
        if VARIANT.startswith("compiled_autograd"):
            ca_compiler = torch.compile(backend="aot_eager", fullgraph=VARIANT == "compiled_autograd")
            with torch._dynamo.compiled_autograd._enable(ca_compiler):
                loss.backward()
        else:
            loss.backward()
        out["losses"].append(loss.item().hex())
        out["digests"].append(digest(model))
        opt.step()
        opt.zero_grad()
        if VARIANT == "os_exit" and step == 1:
            with open(OUT, "w") as f:
                json.dump(out, f)
            os._exit(0)
    with open(OUT, "w") as f:
        json.dump(out, f)
    if agent is not None:
        agent.close()
    if dist:
        import torch.distributed as d

        d.destroy_process_group()


if __name__ == "__main__":
    main()
