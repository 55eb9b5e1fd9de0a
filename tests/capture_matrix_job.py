"""One training job of the capture matrix, with or without graphdeck's capture:

    python tests/capture_matrix_job.py VARIANT {plain|capture} STORE OUT_JSON
    python tests/capture_matrix_job.py --batch {plain|capture} OUTDIR VARIANT[@LABEL] ...

``--batch``: the variants one after another in this interpreter (NOTE: [Several variants in one
interpreter]).

Variants: ``agent`` (Agent.watch + agent.backend), ``backend_name`` (``backend="graphdeck"``, no
``close()``), ``ddp`` and ``fsdp2`` (1 gloo rank), ``compiled_autograd`` (the config flag, and
the backward under ``compiled_autograd._enable`` with a ``fullgraph=True`` compiler),
``compiled_autograd_enable`` (forward and backward under ``_enable`` without fullgraph, as torch
documents it), ``compiled_autograd_backward_only`` (``_enable`` around ``backward()`` alone:
nothing tells the capture before the first backward; NOTE: [Evidence under compiled autograd]),
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
``profile`` (Agent.profile around the steps), ``recompile_limit`` (``recompile_limit=1``: step
1's recompile hits the limit), ``unbacked`` (``automatic_dynamic_shapes_mark_as="unbacked"``);
``backend_name``, ``ddp``, ``fsdp2``, ``fullgraph`` and ``warm_cache`` change length too;
``agent`` keeps one static shape. Pipelining: tests/capture_matrix_pipeline.py.
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

DYNAMIC = {"dynamic", "backend_name", "mark_dynamic", "dynamic_true", "no_auto_dynamic", "ddp_optimizer", "tp",
           "profile", "ddp", "fsdp2", "fullgraph", "warm_cache", "recompile_limit", "unbacked"}
STEPS = 3
#: ``torch._dynamo.config`` per variant, set for the variant's run only.
CONFIG = {"no_auto_dynamic": {"automatic_dynamic_shapes": False},
          "recompile_limit": {"recompile_limit": 1},  # step 1's length needs a recompile: the limit is hit
          "unbacked": {"automatic_dynamic_shapes_mark_as": "unbacked"}}


class ShapeLog(logging.Handler):
    """The shape symbols Dynamo creates and the shape guards it adds, as torch logs them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if m := re.match(r"create_symbol (\S+) = \S+ for (\S+)", msg):
            self.lines.append(f"symbol {m[1]} for {m[2]}")
        elif m := re.match(r"create_unbacked_symint (.+)", msg):
            self.lines.append(f"unbacked {m[1]}")
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


def run(variant: str, mode: str, store: str, out: str) -> None:
    """One variant in this interpreter: ``out`` gets its results (see the module's docstring);
    ``torch._dynamo.config``, the shape log's handlers and the process group are as before it."""
    saved = torch._dynamo.config.get_config_copy()
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    handlers = list(shapes.handlers)
    try:
        with torch._dynamo.config.patch(CONFIG.get(variant, {})):
            _run(variant, mode, store, out)
    finally:
        now = torch._dynamo.config.get_config_copy()
        for key, value in saved.items():
            if now.get(key) != value:
                setattr(torch._dynamo.config, key, value)
        for h in set(shapes.handlers) - set(handlers):
            shapes.removeHandler(h)
        import torch.distributed as d

        if d.is_available() and d.is_initialized():
            d.destroy_process_group()


# NOTE: [Several variants in one interpreter]
# Starting an interpreter (torch, graphdeck, Dynamo's first compile) costs more than most
# variants, so the matrix runs the single-process variants one after another in one interpreter
# per mode (``--batch``). Before each, the process gets the Dynamo state of a new one:
# ``torch._dynamo.reset()`` (code caches, automatic-dynamic frame state, frame and compile
# counters, compiled autograd's state), every Dynamo counter emptied in place (graphdeck holds
# ``counters["compiled_autograd"]``: compiled_autograd_ran) and the compilation metrics cleared;
# ``run`` restores ``torch._dynamo.config`` and destroys a process group left open. Every variant
# trains a fresh model from ``manual_seed(0)``. What this cannot reset (graphdeck's process-wide
# flags: ``config.compiled_autograd`` once seen; the default agent of ``backend="graphdeck"``) is
# kept out: the compiled-autograd variants run last in that order, ``backend_name`` captured and
# jobs that die run in interpreters of their own. tests/test_capture_matrix.py checks the reset
# works: ``dynamic`` (automatic dynamic on the shared ``Net.forward``: leaked frame state would
# make its first compile dynamic) runs first and again late in each batch, with identical results.
def fresh() -> None:
    """The Dynamo state of a new interpreter (NOTE: [Several variants in one interpreter])."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    torch._dynamo.reset()
    for c in counters.values():
        c.clear()
    clear_compilation_metrics()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(mode: str, outdir: str, specs: list[str]) -> None:
    """Run each ``VARIANT`` or ``VARIANT@LABEL`` of ``specs`` in turn in this interpreter, into
    ``OUTDIR/NAME-MODE.db`` and ``.json`` (NAME: ``VARIANT`` or ``VARIANT-LABEL``); a variant that
    raises gets ``{"error": traceback}`` as its JSON and the next one runs."""
    import traceback

    for spec in specs:
        variant, _, label = spec.partition("@")
        name = f"{variant}-{label}" if label else variant
        out = os.path.join(outdir, f"{name}-{mode}.json")
        fresh()
        os.environ["PORT"] = str(free_port())
        try:
            run(variant, mode, os.path.join(outdir, f"{name}-{mode}.db"), out)
        except Exception:  # noqa: BLE001 - reported in its JSON, the batch goes on
            with open(out, "w") as f:
                json.dump({"error": traceback.format_exc()}, f)


def _run(VARIANT: str, MODE: str, STORE: str, OUT: str) -> None:  # noqa: N803 - the job's command-line names
    CAPTURE = MODE == "capture"  # noqa: N806
    LENGTHS = [4 + s for s in range(STEPS)] if VARIANT in DYNAMIC else [4] * STEPS  # noqa: N806
    shape_log = ShapeLog()
    torch._logging.set_logs(dynamic=logging.INFO)
    logging.getLogger("torch.fx.experimental.symbolic_shapes").addHandler(shape_log)
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
        if VARIANT.startswith("compiled_autograd"):
            ca_compiler = torch.compile(backend="aot_eager", fullgraph=VARIANT == "compiled_autograd")
            if VARIANT != "compiled_autograd_enable":  # _enable around backward() alone
                loss = compiled(x).square().mean()
            with torch._dynamo.compiled_autograd._enable(ca_compiler):
                if VARIANT == "compiled_autograd_enable":  # forward and backward under _enable, as torch documents
                    loss = compiled(x).square().mean()
                loss.backward()
        else:
            loss = compiled(x).square().mean()
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
    if VARIANT == "warm_cache":
        from torch._dynamo.utils import counters

        out["fx_graph_cache"] = {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")}
    with open(OUT, "w") as f:
        json.dump(out, f)
    if agent is not None:
        agent.close()
    if dist:
        import torch.distributed as d

        d.destroy_process_group()


def main() -> None:
    if sys.argv[1] == "--batch":
        batch(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        run(*sys.argv[1:5])


if __name__ == "__main__":
    main()
