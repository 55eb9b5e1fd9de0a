"""What the capture reads of the compile it runs inside: the frame and graph-break reason Dynamo
hands the backend, DDPOptimizer's bucket being compiled, the caller's grad mode and autocast, and
how the watched model is parallelised. Read-only: nothing here changes the compile.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.fx


def compile_reason(gm: torch.fx.GraphModule) -> tuple[str | None, str | None]:
    """(frame "name (file:line)", graph-break reason or ``None``) from Dynamo's
    ``compile_subgraph_reason`` on the graph it hands to the backend."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None:
        return None, None
    frame_name = None
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        fs = stack[-1]
        frame_name = f"{fs.name} ({os.path.basename(fs.filename)}:{fs.lineno})"
    brk = str(getattr(reason, "reason", "graph break")) if getattr(reason, "graph_break", False) else None
    return frame_name, brk


def is_ddp(obj: Any) -> bool:
    """Whether ``obj`` is a ``DistributedDataParallel`` wrapper: torch's class or any subclass of
    it (a framework's own DDP), whose ``.module`` is the model and whose parameter names
    carry a ``module.`` prefix the model's own names do not."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(obj, DistributedDataParallel)


def parallel_info(model: torch.nn.Module) -> dict:
    """How ``model`` is parallelised: ``{"ddp": bool, "find_unused_parameters": bool | None,
    "static_graph": bool | None, "fsdp2": bool}``."""
    out: dict = {}
    if is_ddp(model):
        out.update(ddp=True, find_unused_parameters=bool(getattr(model, "find_unused_parameters", False)),
                   static_graph=bool(getattr(model, "static_graph", False)))
    try:
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            out["fsdp2"] = True
    except Exception:  # noqa: BLE001 - torch without FSDP2
        pass
    return out


def compile_context() -> dict:
    """The caller's grad mode and autocast state while a graph is compiled: ``{"grad_enabled":
    bool, "autocast": [{"device": "cpu", "dtype": "bfloat16", "enabled": True}, ...]}`` (only
    devices where autocast is on)."""
    out: dict = {"grad_enabled": torch.is_grad_enabled(), "autocast": []}
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                out["autocast"].append({"device": device, "enabled": True,
                                        "dtype": str(torch.get_autocast_dtype(device)).removeprefix("torch.")})
        except Exception:  # noqa: BLE001 - older torch spells these differently
            pass
    return out


def ddp_compile_mode() -> str | None:
    """``torch._dynamo.config.optimize_ddp`` as Dynamo reads it (``"ddp_optimizer"``,
    ``"no_optimization"``, ``"python_reducer"``...) while a DDP module's forward is being compiled,
    else None (no DDP forward active, or a torch without the setting). Read by the DDP overlap
    check (NOTE: [DDP overlap by construction] in analysis/compilation/ddp_overlap.py)."""
    try:
        from torch.nn.parallel import DistributedDataParallel

        if DistributedDataParallel._get_active_ddp_module() is None:
            return None
        return str(torch._dynamo.utils.get_optimize_ddp_mode())
    except Exception:  # noqa: BLE001 - an older/newer torch: nothing recorded
        return None


def frame_self(frame) -> Any:
    """``self`` of a frame running a method of torch's code, else None.

    Never asks another frame for its locals: before Python 3.13, ``frame.f_locals`` copies the
    locals into a dict the frame keeps, so a user's training-loop frame read at compile time
    would hold that moment's tensors (a batch, an optimizer) for as long as it runs — the
    capture changing the job's memory (``test_watching_keeps_no_replaced_parameter_alive``)."""
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self":
        return None
    if not str(frame.f_globals.get("__name__") or "").startswith("torch."):
        return None
    return frame.f_locals.get("self")


def under_ddp_optimizer() -> bool:
    """Whether DDPOptimizer is on the call stack (it calls the backend itself, split or not)."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except Exception:
        return False
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        if isinstance(frame_self(frame), DDPOptimizer):
            return True
        frame = frame.f_back
    return False


def ddp_context():
    """(DDPOptimizer, unsplit GraphModule, sub-module name) when DDPOptimizer is compiling one of
    its bucket sub-graphs right now, else ``None``.

    # NOTE: [Finding the DDP bucket]
    # DDPOptimizer splits the Dynamo graph and calls the backend once per bucket from
    # SubmodCompiler.run_node; neither passes the bucket to the backend. We look up the calling
    # frames (a few levels) for those two objects. This is read-only and falls back to
    # recording a plain Dynamo graph if the frames are not found (e.g. a future torch).
    """
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer, SubmodCompiler
    except Exception:
        return None
    frame = sys._getframe(2)
    submod_name, opt, full_gm = None, None, None
    for _ in range(40):
        if frame is None:
            break
        self_obj = frame_self(frame)
        if submod_name is None and isinstance(self_obj, SubmodCompiler):
            n = frame.f_locals.get("n")
            if isinstance(n, torch.fx.Node) and n.op == "call_module":
                submod_name = str(n.target)
        if isinstance(self_obj, DDPOptimizer):
            opt, full_gm = self_obj, frame.f_locals.get("gm")
            break
        frame = frame.f_back
    if submod_name is None or opt is None or full_gm is None:
        return None
    return opt, full_gm, submod_name


MODEL_FRAMES = "graphdeck_model_frames"


def model_frames(models: list) -> list[dict]:
    """Dynamo's own rule for each watched model's ``forward`` reached as a frame of its own (not
    inlined from a compiled frame), as ``torch._dynamo.trace_rules.check_verbose`` answers it:
    ``[{"model": "torch.nn.modules.container.Sequential", "forward": "FILE:LINE", "skipped": bool,
    "reason": "file matches MOD_SKIPLIST (...torch/nn)"}]``; ``[]`` when Dynamo was never imported
    (nothing was compiled) or the rule cannot be read.

    # NOTE: [No graph produced]
    # ``torch.compile(DDP(model))`` compiles the model through DDPOptimizer only when Dynamo
    # compiles the model's forward as a frame of its own: DDP's forward is broken at
    # ``_inside_ddp_forward`` (marked skipped) and DDP calls ``self.module`` from frames Dynamo
    # skips. A forward in torch's own files (``nn.Sequential``) is in Dynamo's skipfiles, so no
    # frame produces a graph and the job runs eagerly while ``torch.compile`` raised nothing.
    # Torch logs that skip only at DEBUG (``skipping: forward (reason: ...)``), never in its
    # structured trace; the capture asks the same rule, read-only, at close, so check-compile can
    # name the cause (analysis/compilation/no_graph.py).
    """
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is None:
        return []
    out = []
    for m in models:
        code = getattr(getattr(type(m), "forward", None), "__code__", None)
        if code is None:
            continue
        res = rules.check_verbose(code, is_inlined_call=False)
        out.append({"model": f"{type(m).__module__}.{type(m).__qualname__}",
                    "forward": f"{code.co_filename}:{code.co_firstlineno}",
                    "skipped": bool(getattr(res, "skipped", False)), "reason": str(getattr(res, "reason", ""))})
    return out
