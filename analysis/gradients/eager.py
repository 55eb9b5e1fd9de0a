"""Eager mode: run a module on an example batch, walk autograd back from the loss, and explain
every parameter that the walk does not reach from the ops recorded while it ran.

* The walk: from ``loss.grad_fn`` through ``next_functions`` to the ``AccumulateGrad`` nodes;
  ``paths`` of a parameter = the number of autograd edges into its ``AccumulateGrad`` (2 for a
  tied embedding/output projection, one per use).
* The record: a ``TorchFunctionMode`` sees each torch call made on a tensor derived from a
  parameter (``F.linear``, ``Tensor.detach``, ``Tensor.data.__get__``, ``argmax``, …) with its grad
  mode, output dtype, the innermost user frame outside torch, and the module that ran it
  (forward pre/post hooks). From it a :class:`~graphdeck.analysis.gradients.cuts.FlowGraph` is built and
  the cut is searched as in graph mode; an op whose output stops requiring grad is the cut.
* The backward check: forward and backward once more on parameter aliases, counting each
  gradient's accumulations in one backward: the evidence for what the walk cannot see. Reentrant
  activation checkpointing (``use_reentrant=True``) runs ``fn`` under ``no_grad`` and recomputes it
  in a nested backward per call: a parameter two calls use accumulates twice (``READY_TWICE``).
* Numeric mode (``numeric=True``): the same batch through ``torch.compile(model, backend=...)``,
  gradient max-abs difference per parameter against eager.

Imports torch lazily (the server never imports this module).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from graphdeck.analysis.gradients.cuts import FlowGraph, first_cut, no_grad_region, short_source, source_line
from graphdeck.analysis.gradients.report import Cut, GradReport, ParamRow, ddp_unused_finding

_THIS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # analysis/, not analysis/gradients/
#: What DDP raises when a parameter's gradient hook fires twice in one backward.
DDP_READY_TWICE_ERROR = "Expected to mark a variable ready only once"


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
    ckpt: _Ckpt | None = None  # the reentrant checkpoint call it ran in
    ckpt_inner: int = 0  # how many of ``stack`` lie inside that checkpointed function


@dataclass
class _Ckpt:
    """One reentrant checkpoint call seen in forward: its checkpointed function's name and
    ``file.py:LINE``, and whether any tensor input requires grad (else it is never recomputed)."""

    fn: str
    source: str | None
    inputs_grad: bool
    ctx: Any = field(default=None, repr=False)  # kept alive, so that its id is not reused


@dataclass
class _Record:
    ops: list[_Op] = field(default_factory=list)
    producer: dict[int, int] = field(default_factory=dict)  # id(tensor) -> op index
    tracked: set[int] = field(default_factory=set)
    ckpts: dict[int, _Ckpt] = field(default_factory=dict)  # id(autograd ctx) -> call


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
            grad_on = torch.is_grad_enabled()
            op = _Op(name=name, inputs=[id(t) for t in ins], outputs=outs, grad_enabled=grad_on,
                     frame=stack[0] if stack else None, module=module_stack[-1] if module_stack else None,
                     requires_grad_in=any(t.requires_grad for t in ins), stack=stack)
            if not grad_on:
                op.ckpt, op.ckpt_inner = _reentrant_call(rec, torch_dir)
            k = len(rec.ops)
            rec.ops.append(op)
            for t in outs:
                rec.producer[id(t)] = k
                rec.tracked.add(id(t))
            return out

    return Recorder()


def _is_user(filename: str, torch_dir: str) -> bool:
    return not filename.startswith(torch_dir) and not filename.startswith(_THIS_DIR) and not filename.startswith("<")


def _ckpt_ctx(f, method: str):
    """The autograd ctx of frame ``f`` when it runs ``method`` (``forward``/``backward``) of a
    checkpoint Function holding ``ctx.run_function`` (torch's reentrant one, and look-alikes)."""
    code = f.f_code
    if code.co_name != method or "ctx" not in code.co_varnames[:code.co_argcount]:
        return None
    ctx = f.f_locals.get("ctx")
    return ctx if hasattr(ctx, "run_function") or (method == "forward" and "run_function" in code.co_varnames) else None


def _reentrant_call(rec: _Record, torch_dir: str) -> tuple[_Ckpt | None, int]:
    """The innermost reentrant checkpoint forward on the Python stack (its ``_Ckpt``, made once per
    call) and the number of user frames above it, or ``(None, 0)``."""
    import torch

    f, inner = sys._getframe(2), 0
    while f is not None:
        ctx = _ckpt_ctx(f, "forward")
        if ctx is not None:
            got = rec.ckpts.get(id(ctx))
            if got is None:
                loc = f.f_locals
                fn = loc.get("run_function", getattr(ctx, "run_function", None))
                args = loc.get("args", ())
                name, src = _describe_fn(fn)
                got = rec.ckpts[id(ctx)] = _Ckpt(fn=name, source=src, ctx=ctx, inputs_grad=any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in args))
            return got, inner
        if _is_user(f.f_code.co_filename, torch_dir):
            inner += 1
        f = f.f_back
    return None, 0


def _describe_fn(fn) -> tuple[str, str | None]:
    """``(qualname, "file.py:LINE")`` of a checkpointed function (a function, bound method,
    ``functools.partial`` or ``nn.Module``, whose ``forward`` is named)."""
    import functools
    import inspect

    while isinstance(fn, functools.partial):
        fn = fn.func
    if fn is None:
        return "?", None
    if not hasattr(fn, "__code__") and not hasattr(fn, "__func__") and hasattr(type(fn), "forward"):
        name, fn = f"{type(fn).__qualname__}.forward", type(fn).forward
    else:
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    try:
        code = inspect.unwrap(getattr(fn, "__func__", fn)).__code__
    except (AttributeError, ValueError):
        return name, None
    return name, short_source(code.co_filename, code.co_firstlineno)


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


def _accumulation_hook(seen: list, order: list | None = None, pid: int | None = None):
    """A tensor hook recording, per accumulation, the reentrant checkpoint whose nested backward
    ran it (``(name, source)``), or ``None`` for the outer backward; and in ``order`` (shared by
    every parameter) ``(pid, graph task)`` — the task: ``id`` of that checkpoint call's context,
    ``None`` for the outer backward (NOTE: [READY_TWICE under DDP])."""

    def hook(_grad):
        f = sys._getframe(1)
        while f is not None and _ckpt_ctx(f, "backward") is None:
            f = f.f_back
        ctx = _ckpt_ctx(f, "backward") if f is not None else None
        seen.append(_describe_fn(ctx.run_function) if ctx is not None else None)
        if order is not None:
            order.append((pid, id(ctx) if ctx is not None else None))

    return hook


def _backward_accumulations(inner, example_inputs, loss_fn, rng,
                            order: list | None = None) -> tuple[dict[int, list], list[str]]:
    """Forward and ``loss.backward()`` once more with every parameter of ``inner`` swapped for an
    alias (``nn.Parameter(p.detach())``: same storage, new autograd leaf), buffers and inputs that
    require grad for copies, and the recorded forward's RNG state ``rng`` (CPU, CUDA or ``None``).
    Returns per ``id(parameter)`` one entry per accumulation (see :func:`_accumulation_hook`), and
    the names whose own ``.grad`` still got one (reached through a reference the swap missed: the
    counts are short); ``order`` (a list, when given) gets every accumulation in the order it ran
    (see :func:`_accumulation_hook`). The model's ``.grad`` fields (set aside, put back), buffers and hooks (DDP's
    reducer) stay as they were. Raises whatever the forward, ``loss_fn`` or backward raises."""
    import torch
    from torch.utils._pytree import tree_map

    alias_of: dict[int, Any] = {}
    seen: dict[int, list] = {}
    swapped, handles = [], []
    grads = [(n, p, p.grad) for n, p in inner.named_parameters()]
    leaked = []
    try:
        for _n, p, _g in grads:
            p.grad = None
        for mod in inner.modules():
            for slots, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in list(slots.items()):
                    if t is None:
                        continue
                    a = alias_of.get(id(t))
                    if a is None:
                        a = alias_of[id(t)] = (torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad)
                                               if is_param else t.clone())
                        if is_param and a.requires_grad:
                            seen[id(t)] = []
                            handles.append(a.register_hook(_accumulation_hook(seen[id(t)], order, id(t))))
                    swapped.append((slots, name, t))
                    slots[name] = a
        inputs = tree_map(lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor)
                          and t.requires_grad else t, example_inputs)
        cuda = list(range(len(rng[1]))) if rng[1] is not None else []
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(rng[0])
            if cuda:
                torch.cuda.set_rng_state_all(rng[1])
            loss = (loss_fn or _default_loss)(_call(inner, inputs))
            loss.backward()
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t
        for h in handles:
            h.remove()
        for n, p, g in grads:
            if p.grad is not None:
                leaked.append(n)
            p.grad = g
    return seen, leaked


def eager_report(model, example_inputs, loss_fn: Callable | None = None, *, numeric: bool = False,
                 backend: str = "aot_eager", rank: int | None = None, run: str | None = None,
                 include_buffers: bool = False, rtol: float = 1e-4, atol: float = 1e-5,
                 autocast_dtype: str | None = None, autocast_device: str | None = None,
                 grad_enabled: bool = True, backward: bool = True, ddp: bool = False) -> GradReport:
    """The report of ``model`` on ``example_inputs`` (a tuple of positional args, a dict of keyword
    args, or one tensor) with ``loss_fn(output) -> scalar tensor`` (default: ``output.loss`` or
    the sum of the first tensor output). ``model`` may be DDP-wrapped: its ``.module`` runs (the
    wrapper's reducer is left untouched) and the DDP error a missing gradient raises is predicted.

    ``numeric``: also run ``torch.compile(model, backend=backend)`` on the same batch and store
    ``grad_max_abs_diff`` per parameter and per input that requires grad (rows ``input[0]`` or
    the keyword name); a difference over ``atol + rtol * max|g_eager|`` is a ``GRAD_MISMATCH``
    finding naming the backward node to blame (see ``numeric``). Both runs take the
    caller's context: forward and loss under ``torch.autocast(autocast_device, dtype=autocast_dtype)``
    (``autocast_dtype`` e.g. ``"bfloat16"``, ``None``: off; device default: the inputs') and
    grad mode ``grad_enabled``. The model's ``.grad`` fields are not touched (``autograd.grad``).

    ``backward``: also run forward and backward on parameter aliases (:func:`_backward_accumulations`;
    ``.grad`` fields untouched) for ``ParamRow.accumulations`` (per backward; 0 when frozen; ``None``
    when that run raised, noted in ``notes``). A parameter with a gradient only there (inside a
    reentrant checkpoint) is ``OK``; one accumulated twice is a ``READY_TWICE`` finding, an error
    when ``model`` is DDP-wrapped (without ``static_graph=True``) or ``ddp`` is set, else a warning.

    Raises:
        TypeError: the loss is not a tensor that requires grad.
        UsageError: ``autocast_dtype`` is not a floating dtype name.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model  # torch's or a subclass
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
    cuda_init = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda_init else None)
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
    acc, acc_error, order = None, None, []
    if backward:
        try:
            acc, leaked = _backward_accumulations(inner, example_inputs, loss_fn, rng, order)
            if leaked:
                acc_error = (f"the model reaches {', '.join(leaked[:5])}{' …' if len(leaked) > 5 else ''} through "
                             "references of its own, not its registered parameters")
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the forward-only verdicts stand
            acc_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    from torch.utils._pytree import tree_leaves

    model_outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    flow, start_of = _flow_graph(rec, tensor_of, model_outputs, reached, n_model_ops)
    live = [False] * len(flow)
    for k, op in enumerate(rec.ops):
        live[len(tensor_of) + k] = any(t.grad_fn is not None and t.grad_fn in reached for t in op.outputs)
    read = {i for op in rec.ops for i in op.inputs}

    report = GradReport(mode="eager", run=run or type(inner).__name__)
    accs_of: dict[str, list] = {}
    if acc_error:
        report.notes.append(f"backward check incomplete ({acc_error}): accumulation counts may be short"
                            if acc is not None else
                            f"backward check failed ({acc_error}): accumulations unknown, and parameters used "
                            "only inside reentrant activation checkpoints could not be confirmed")
    for pid, names in groups.items():
        p = tensor_of[pid]
        row = ParamRow(rank=rank, fqn=names[0], status="OK", aliases=names, shape=list(p.shape),
                       dtype=str(p.dtype).removeprefix("torch."), requires_grad=bool(p.requires_grad))
        report.rows.append(row)
        accs = acc.get(pid, []) if acc is not None else None
        if acc is not None:
            accs_of[row.fqn], row.accumulations = accs, len(accs)
        if not p.requires_grad:
            row.status, row.reason = "FROZEN", "requires_grad is False"
        elif counts.get(pid):
            row.paths = counts[pid]
            row.reason = f"gradient through {row.paths} path(s)" + (f"; tied: {', '.join(names)}" if len(names) > 1 else "")
            if accs == []:
                row.notes.append("the autograd walk reaches it, but the backward run delivered no gradient to it")
        elif accs:
            _nested_ok(row, accs)
        elif pid not in read:
            row.status = "NOT_IN_GRAPH"
            row.reason = "not read while the model ran on this batch (an unused module, or a branch not taken)"
            row.cut = Cut(kind="not_read", detail="never read in forward")
            from graphdeck.analysis.gradients.graph import FIXES

            row.fix = FIXES["NOT_IN_GRAPH"]
        else:
            _explain_eager(row, flow, start_of[pid], live, rec,
                           ckpt=next((op.ckpt for op in rec.ops if pid in op.inputs and op.ckpt), None),
                           backward_ran=acc is not None)
        first = next((op for op in rec.ops if pid in op.inputs and op.frame), None)
        if first is not None:
            row.first_use = f'File "{first.frame[0]}", line {first.frame[1]}, in {first.frame[2]}'
    if include_buffers:
        for fqn, b in inner.named_buffers():
            report.rows.append(ParamRow(rank=rank, fqn=fqn, status="BUFFER", aliases=[fqn], shape=list(b.shape),
                                        dtype=str(b.dtype).removeprefix("torch."), requires_grad=False,
                                        reason="a buffer, not a parameter: it has no gradient to check"))
    if isinstance(model, DistributedDataParallel) and not getattr(model, "find_unused_parameters", False):
        f = ddp_unused_finding(report.rows, static_graph=bool(getattr(model, "static_graph", False)))
        if f is not None:
            report.findings.append(f)
    if acc is not None:
        from graphdeck.analysis.gradients.outcome import eager_ready_twice

        eager_ready_twice(report, model, ddp, accs_of, order, {pid: names[0] for pid, names in groups.items()},
                          _fn_text, DDP_READY_TWICE_ERROR)
    if numeric:
        from graphdeck.analysis.gradients.numeric import numeric_check

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
            kind = ("detach" if "detach" in low or low.endswith("data.__get__") else
                    "no_grad" if not op.grad_enabled else
                    "integer_output" if not (t0.is_floating_point() or t0.is_complex()) else
                    "non_differentiable")
            if kind == "no_grad" and op.ckpt is not None and op.ckpt.inputs_grad and _inner_no_grad(op) is None:
                kind = None  # the reentrant checkpoint's own no_grad: backward recomputes it with grad
            flow.cut_override[i] = kind
        else:
            flow.cut_override[i] = None
    return flow, start_of


def _inner_no_grad(op: _Op) -> str | None:
    """A ``no_grad`` region opened inside the checkpointed function ``op`` ran in (``file.py:LINE``)."""
    inner = op.stack[:op.ckpt_inner]
    return no_grad_region("\n".join(f'File "{f}", line {ln}, in {fn}' for f, ln, fn in reversed(inner))) \
        if inner else None


def _fn_text(desc) -> str:
    return f"{desc[0]} ({desc[1]})" if desc[1] else desc[0]


def _nested_ok(row: ParamRow, accs: list) -> None:
    """``row`` gets its gradient only in nested backwards (reentrant checkpoint recomputes)."""
    by = Counter(accs)
    row.paths = len(accs)
    parts = [f"{k}x by the recompute of {_fn_text(d)}" if d else f"{k}x by the outer backward"
             for d, k in by.items()]
    row.reason = (f"gradient through reentrant activation checkpointing, which the autograd walk from the loss "
                  f"cannot see into (it recomputes the function in a backward of its own): accumulated "
                  f"{', '.join(parts)}")


def _explain_eager(row: ParamRow, flow: FlowGraph, start: int, live: list[bool], rec: _Record,
                   ckpt: _Ckpt | None = None, backward_ran: bool = False) -> None:
    from graphdeck.analysis.gradients.graph import FIXES

    res = first_cut(flow, start, live)
    base = len(flow) - len(rec.ops) - 1
    if res is None:
        row.status = "NO_GRAD"
        row.reason = "read in forward, but autograd from the loss never reaches it (no cut was recorded)"
        if ckpt is not None:
            row.reason = (f"read inside reentrant activation checkpointing of {_fn_text((ckpt.fn, ckpt.source))}, "
                          "which the autograd walk cannot see into; " +
                          ("the backward run gave it no gradient" if backward_ran else
                           "the backward run that would tell failed (see the report's notes)"))
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
        if res.kind == "no_grad" and op.ckpt is not None and not op.ckpt.inputs_grad and _inner_no_grad(op) is None:
            fn = _fn_text((op.ckpt.fn, op.ckpt.source))
            row.cut.detail = f"reentrant checkpoint of {fn}; no tensor input requires grad"
            row.reason = (f"gradient flow is cut: {op.name}{mod}{at} runs under the no_grad of reentrant activation "
                          f"checkpointing of {fn}, and none of the checkpoint's tensor inputs requires grad, so "
                          "backward never recomputes it")
            row.fix = ("make an input of the checkpointed call require grad (x.requires_grad_(); Hugging Face: "
                       "model.enable_input_require_grads()), or checkpoint(..., use_reentrant=False)")
