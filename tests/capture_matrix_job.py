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
bytes after each step, so runs with and without capture compare bit for bit, and what torch
decided at each compile (NOTE: [The capture adds no guard]): per compile its frame, compile id,
guard counts, recompile reason and graph size, and the shape symbols Dynamo created and the shape
guards it added, in order.

Invisibility variants (issue 34), each on inputs whose length changes every step unless said:
``dynamic`` (Agent; automatic dynamic after one recompile), ``mark_dynamic``, ``dynamic_true`` (``torch.compile(dynamic=True)``), ``no_auto_dynamic``
(``automatic_dynamic_shapes=False``: one static compile per length), ``ddp_optimizer`` (DDP split
into buckets by DDPOptimizer), ``tp`` (ColwiseParallel/RowwiseParallel on a 1-rank mesh),
``profile`` (Agent.profile around the steps); ``backend_name``, ``ddp``, ``fsdp2``, ``fullgraph``
and ``warm_cache`` change length too; ``agent`` keeps one static shape.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import sys

import torch

VARIANT, MODE, STORE, OUT = sys.argv[1:5]
CAPTURE = MODE == "capture"
DYNAMIC = {"dynamic", "backend_name", "mark_dynamic", "dynamic_true", "no_auto_dynamic", "ddp_optimizer", "tp",
           "profile", "ddp", "fsdp2", "fullgraph", "warm_cache"}
STEPS = 3
LENGTHS = [4 + s for s in range(STEPS)] if VARIANT in DYNAMIC else [4] * STEPS


class ShapeLog(logging.Handler):
    """The shape symbols Dynamo creates and the shape guards it adds, as torch logs them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if m := re.match(r"create_symbol (\S+) = \S+ for (\S+)", msg):
            self.lines.append(f"symbol {m[1]} for {m[2]}")
        elif m := re.match(r"eval (.+?) \[guard added\]", msg):
            self.lines.append(f"guard {m[1]}")
        elif m := re.match(r"set_replacement (\S+) = (\S+)", msg):
            self.lines.append(f"replace {m[1]} = {m[2]}")


def decisions(log: ShapeLog) -> dict:
    """What torch decided at each compile, comparable across processes."""
    from torch._dynamo.utils import get_compilation_metrics

    rows = [[m.co_name, str(m.compile_id), m.guard_count, m.shape_env_guard_count, m.recompile_reason, m.fail_type,
             m.graph_op_count, m.graph_input_count] for m in get_compilation_metrics()]
    return {"compiles": rows, "shapes": log.lines}


class Net(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()  # width 512: b's weight is 1 MiB, a DDP bucket of its own at bucket_cap_mb=1
        self.a = torch.nn.Linear(8, width)
        self.b = torch.nn.Linear(width, 8)
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
    shape_log = ShapeLog()
    torch._logging.set_logs(dynamic=logging.INFO)
    logging.getLogger("torch.fx.experimental.symbolic_shapes").addHandler(shape_log)
    if VARIANT == "no_auto_dynamic":
        torch._dynamo.config.automatic_dynamic_shapes = False
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = Net(512 if VARIANT == "ddp_optimizer" else 16)
    out: dict = {"losses": [], "digests": []}
    dist = VARIANT in ("ddp", "fsdp2", "ddp_optimizer", "tp", "profile")
    if dist:
        import torch.distributed as d

        d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=0, world_size=1,
                             timeout=datetime.timedelta(seconds=60))
    if VARIANT == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a)
        fully_shard(model)
    if VARIANT == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (1,)), {"a": ColwiseParallel(), "b": RowwiseParallel()})
    wrapped = model
    if VARIANT in ("ddp", "ddp_optimizer", "profile"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, bucket_cap_mb=1) if VARIANT == "ddp_optimizer" else DDP(model)
    inner = "inductor" if VARIANT == "warm_cache" else "aot_eager"
    agent = None
    if CAPTURE and VARIANT.startswith("backend_name"):
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
    compiled = torch.compile(wrapped, backend=backend, fullgraph=full, dynamic=True if VARIANT == "dynamic_true" else None)
    prof = agent.profile(wait_steps=0, warmup_steps=1, active_steps=2) if agent is not None and VARIANT == "profile" else None
    if prof is not None:
        prof.__enter__()
    if VARIANT == "compiled_autograd":
        torch._dynamo.config.compiled_autograd = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(LENGTHS[step], 8, generator=torch.Generator().manual_seed(step))
        if VARIANT == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
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
        if prof is not None:
            prof.step()
        if VARIANT == "os_exit" and step == 1:
            with open(OUT, "w") as f:
                json.dump(out, f)
            os._exit(0)
    if prof is not None:
        prof.__exit__(None, None, None)
    out.update(decisions(shape_log))
    with open(OUT, "w") as f:
        json.dump(out, f)
    if agent is not None:
        agent.close()
    if dist:
        import torch.distributed as d

        d.destroy_process_group()


if __name__ == "__main__":
    main()
