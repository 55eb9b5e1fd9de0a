"""Eager mode: run a module on an example batch, walk autograd back from the loss, and explain
every parameter that the walk does not reach from the ops recorded while it ran.

* The walk: from ``loss.grad_fn`` through ``next_functions`` to the ``AccumulateGrad`` nodes;
  ``paths`` of a parameter = the number of autograd edges into its ``AccumulateGrad`` (2 for a
  tied embedding/output projection, one per use).
* The record: a ``TorchFunctionMode`` sees each torch call made on a tensor derived from a
  parameter (``F.linear``, ``Tensor.detach``, ``Tensor.data.__get__``, ``argmax``, …) with its grad
  mode, output dtype, the innermost user frame outside torch, and the module that ran it
  (forward pre/post hooks). From it a :class:`~graphdeck.analysis.grad_cuts.FlowGraph` is built and
  the cut is searched as in graph mode; an op whose output stops requiring grad is the cut.
* Numeric mode (``numeric=True``): the same batch through ``torch.compile(model, backend=...)``,
  gradient max-abs difference per parameter against eager.

Imports torch lazily (the server never imports this module).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from graphdeck.analysis.grad_cuts import FlowGraph, first_cut, no_grad_region, short_source, source_line
from graphdeck.analysis.grad_report import Cut, Finding, GradReport, ParamRow, ddp_unused_finding

_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class _Op:
    name: str
    inputs: list[int]  # ids of tracked input tensors
    outputs: list[Any]  # output tensors (kept alive: ids stay unique)
    grad_enabled: bool
    frame: tuple[str, int, str] | None
    module: str | None
    requires_grad_in: bool = False
    stack: list[tuple[str, int, str]] = field(default_factory=list)  # user frames, innermost first


@dataclass
class _Record:
    ops: list[_Op] = field(default_factory=list)
    producer: dict[int, int] = field(default_factory=dict)  # id(tensor) -> op index
    tracked: set[int] = field(default_factory=set)


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def _user_frames(torch_dir: str, limit: int = 8) -> list[tuple[str, int, str]]:
    """Up to ``limit`` frames outside torch and graphdeck's analysis, innermost first."""
    out = []
    f = sys._getframe(2)
    while f is not None and len(out) < limit:
        fn = f.f_code.co_filename
        if not fn.startswith(torch_dir) and not fn.startswith(_THIS_DIR) and not fn.startswith("<"):
            out.append((fn, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return out


def _make_mode(rec: _Record, module_stack: list[str]):
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    torch_dir = _torch_dir()

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) in rec.tracked]
            if not ins:
                return out
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if not outs:
                return out
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
            if name.startswith(("_TensorBase.", "TensorBase.")):
                name = "Tensor." + name.split(".", 1)[1]
            stack = _user_frames(torch_dir)
            op = _Op(name=name, inputs=[id(t) for t in ins], outputs=outs, grad_enabled=torch.is_grad_enabled(),
                     frame=stack[0] if stack else None, module=module_stack[-1] if module_stack else None,
                     requires_grad_in=any(t.requires_grad for t in ins), stack=stack)
            k = len(rec.ops)
            rec.ops.append(op)
            for t in outs:
                rec.producer[id(t)] = k
                rec.tracked.add(id(t))
            return out

    return Recorder()


def _default_loss(out: Any):
    """``out.loss`` when present (Hugging Face outputs), else the sum of the first tensor output."""
    import torch
    from torch.utils._pytree import tree_leaves

    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise TypeError("the model returned no floating-point tensor; pass loss_fn")
    return leaves[0].sum()


def _call(model, example_inputs):
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return model(*example_inputs)
    return model(example_inputs)


def _walk(loss) -> tuple[set, dict[int, int]]:
    """Autograd nodes reachable from ``loss`` and, per leaf tensor id, edges into its AccumulateGrad."""
    reached, counts = set(), {}
    fn = loss.grad_fn
    if fn is None:
        return reached, counts
    stack = [fn]
    reached.add(fn)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                counts[id(var)] = counts.get(id(var), 0) + 1
            if nxt not in reached:
                reached.add(nxt)
                stack.append(nxt)
    return reached, counts


def eager_report(model, example_inputs, loss_fn: Callable | None = None, *, numeric: bool = False,
                 backend: str = "aot_eager", rank: int | None = None, run: str | None = None,
                 include_buffers: bool = False, rtol: float = 1e-4, atol: float = 1e-5,
                 autocast_dtype: str | None = None, autocast_device: str | None = None,
                 grad_enabled: bool = True) -> GradReport:
    """The report of ``model`` on ``example_inputs`` (a tuple of positional args, a dict of keyword
    args, or one tensor) with ``loss_fn(output) -> scalar tensor`` (default: ``output.loss`` or
    the sum of the first tensor output). ``model`` may be DDP-wrapped: its ``.module`` runs (the
    wrapper's reducer is left untouched) and the DDP error a missing gradient raises is predicted.

    ``numeric``: also run ``torch.compile(model, backend=backend)`` on the same batch and store
    ``grad_max_abs_diff`` per parameter and per input that requires grad (rows ``input[0]`` or
    the keyword name); a difference over ``atol + rtol * max|g_eager|`` is a ``GRAD_MISMATCH``
    finding naming the backward node to blame (see ``grad_numeric``). Both runs take the
    caller's context: forward and loss under ``torch.autocast(autocast_device, dtype=autocast_dtype)``
    (``autocast_dtype`` e.g. ``"bfloat16"``, ``None``: off; device default: the inputs') and
    grad mode ``grad_enabled``. The model's ``.grad`` fields are not touched (``autograd.grad``).

    Raises:
        TypeError: the loss is not a tensor that requires grad.
        UsageError: ``autocast_dtype`` is not a floating dtype name.
    """
    import torch

    inner = model.module if type(model).__name__ == "DistributedDataParallel" else model
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    named = list(inner.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    tensor_of: dict[int, Any] = {}
    for fqn, p in named:
        groups.setdefault(id(p), []).append(fqn)
        tensor_of[id(p)] = p

    rec = _Record(tracked=set(tensor_of))
    module_stack: list[str] = []
    handles = []
    def enter(name):
        def pre(_m, _a):
            module_stack.append(name)

        def post(_m, _a, _o):
            if module_stack and module_stack[-1] == name:
                module_stack.pop()

        return pre, post

    for mname, mod in inner.named_modules():
        pre, post = enter(mname)
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        with _make_mode(rec, module_stack):
            # A DDP wrapper's forward would arm its reducer for a backward that never comes
            # (the next real step would then fail): run the wrapped module itself.
            out = _call(inner, example_inputs)
            n_model_ops = len(rec.ops)
            loss = (loss_fn or _default_loss)(out)
    finally:
        for hnd in handles:
            hnd.remove()
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise TypeError(f"loss_fn must return a tensor that requires grad, got {type(loss).__name__}"
                        + (" without grad" if isinstance(loss, torch.Tensor) else ""))
    reached, counts = _walk(loss)
    from torch.utils._pytree import tree_leaves

    model_outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    flow, start_of = _flow_graph(rec, tensor_of, model_outputs, reached, n_model_ops)
    live = [False] * len(flow)
    for k, op in enumerate(rec.ops):
        live[len(tensor_of) + k] = any(t.grad_fn is not None and t.grad_fn in reached for t in op.outputs)
    read = {i for op in rec.ops for i in op.inputs}

    report = GradReport(mode="eager", run=run or type(inner).__name__)
    for pid, names in groups.items():
        p = tensor_of[pid]
        row = ParamRow(rank=rank, fqn=names[0], status="OK", aliases=names, shape=list(p.shape),
                       dtype=str(p.dtype).removeprefix("torch."), requires_grad=bool(p.requires_grad))
        report.rows.append(row)
        if not p.requires_grad:
            row.status, row.reason = "FROZEN", "requires_grad is False"
        elif counts.get(pid):
            row.paths = counts[pid]
            row.reason = f"gradient through {row.paths} path(s)" + (f"; tied: {', '.join(names)}" if len(names) > 1 else "")
        elif pid not in read:
            row.status = "NOT_IN_GRAPH"
            row.reason = "not read while the model ran on this batch (an unused module, or a branch not taken)"
            row.cut = Cut(kind="not_read", detail="never read in forward")
            from graphdeck.analysis.grad_graph import FIXES

            row.fix = FIXES["NOT_IN_GRAPH"]
        else:
            _explain_eager(row, flow, start_of[pid], live, rec)
        first = next((op for op in rec.ops if pid in op.inputs and op.frame), None)
        if first is not None:
            row.first_use = f'File "{first.frame[0]}", line {first.frame[1]}, in {first.frame[2]}'
    if include_buffers:
        for fqn, b in inner.named_buffers():
            report.rows.append(ParamRow(rank=rank, fqn=fqn, status="BUFFER", aliases=[fqn], shape=list(b.shape),
                                        dtype=str(b.dtype).removeprefix("torch."), requires_grad=False,
                                        reason="a buffer, not a parameter: it has no gradient to check"))
    if type(model).__name__ == "DistributedDataParallel" and not getattr(model, "find_unused_parameters", False):
        f = ddp_unused_finding(report.rows)
        if f is not None:
            report.findings.append(f)
    if numeric:
        from graphdeck.analysis.grad_numeric import numeric_check

        params = [(names[0], tensor_of[pid]) for pid, names in groups.items()]
        numeric_check(report, inner, example_inputs, loss_fn, params=params, rank=rank, backend=backend,
                      rtol=rtol, atol=atol, autocast_dtype=autocast_dtype,
                      autocast_device=autocast_device, grad_enabled=grad_enabled)
    return report


def _flow_graph(rec: _Record, tensor_of: dict[int, Any], model_outputs, reached, n_model_ops):
    """Parameters as placeholders, recorded ops, one output node for the model's outputs."""
    pids = list(tensor_of)
    start_of = {pid: k for k, pid in enumerate(pids)}
    base = len(pids)
    n = base + len(rec.ops) + 1
    out_idx = n - 1
    names = [f"param:{pid}" for pid in pids] + [f"op{k}:{op.name}" for k, op in enumerate(rec.ops)] + ["output"]
    ops = ["placeholder"] * base + ["call_function"] * len(rec.ops) + ["output"]
    targets = [""] * base + [op.name for op in rec.ops] + ["output"]
    users: list[list[int]] = [[] for _ in range(n)]
    for k, op in enumerate(rec.ops):
        for tid in op.inputs:
            src = start_of.get(tid)
            if src is None:
                j = rec.producer.get(tid)
                src = base + j if j is not None and j < k else None
            if src is not None and base + k not in users[src]:
                users[src].append(base + k)
    dead = set()
    for t in model_outputs:
        j = rec.producer.get(id(t))
        if j is not None:
            users[base + j].append(out_idx)
            if t.grad_fn is None or t.grad_fn not in reached:
                dead.add(base + j)
    flow = FlowGraph(names=names, ops=ops, targets=targets, dtypes=[None] * n, tensor=[None] * n, users=users,
                     grad_off=[False] * n, source=[None] * n, modules=[None] * n, dead=dead)
    for k, op in enumerate(rec.ops):
        i = base + k
        t0 = op.outputs[0]
        flow.dtypes[i] = str(t0.dtype).removeprefix("torch.")
        flow.grad_off[i] = not op.grad_enabled
        flow.modules[i] = op.module
        flow.source[i] = short_source(op.frame[0], op.frame[1]) if op.frame else None
        if op.requires_grad_in and not any(t.requires_grad for t in op.outputs):
            low = op.name.lower()
            flow.cut_override[i] = ("detach" if "detach" in low or low.endswith("data.__get__") else
                                    "no_grad" if not op.grad_enabled else
                                    "integer_output" if not (t0.is_floating_point() or t0.is_complex()) else
                                    "non_differentiable")
        else:
            flow.cut_override[i] = None
    return flow, start_of


def _explain_eager(row: ParamRow, flow: FlowGraph, start: int, live: list[bool], rec: _Record) -> None:
    from graphdeck.analysis.grad_graph import FIXES

    res = first_cut(flow, start, live)
    base = len(flow) - len(rec.ops) - 1
    if res is None:
        row.status = "NO_GRAD"
        row.reason = "read in forward, but autograd from the loss never reaches it (no cut was recorded)"
        return
    op = rec.ops[res.node - base]
    src = flow.source[res.node]
    code = source_line(op.frame[0], op.frame[1]) if op.frame else None
    region = None
    if res.kind == "no_grad" and op.stack:
        region = no_grad_region("\n".join(f'File "{f}", line {ln}, in {fn}' for f, ln, fn in reversed(op.stack)))
    row.cut = Cut(kind=res.kind, op=op.name, node=flow.names[res.node], source=src, code=code,
                  module_path=op.module.replace(".", "/") if op.module else None, region=region,
                  path=[flow.names[k] for k in res.path])
    row.fix = FIXES.get(res.kind)
    at = f" at {src}" if src else ""
    mod = f" in module {op.module}" if op.module else ""
    if res.kind == "dead_output":
        row.status = "DEAD_END"
        row.reason = (f"its output, made by {op.name}{mod}{at}, is returned by forward but the loss never uses "
                      "it (0 paths)")
    elif res.kind == "unused_result":
        row.status = "DEAD_END"
        row.reason = f"the result of {op.name}{mod}{at} is never used by anything that reaches the loss"
    else:
        row.status = "NO_GRAD"
        what = {"detach": "detaches it from autograd",
                "no_grad": "runs with grad mode off" + (f" (no_grad region opened at {region})" if region else ""),
                "integer_output": f"returns {flow.dtypes[res.node]}, which carries no gradient",
                "non_differentiable": "returns a tensor that does not require grad"}.get(res.kind, res.kind)
        row.reason = f"gradient flow is cut: {op.name}{mod}{at} {what}"
