"""Numeric mode: eager vs compiled gradients of one step, run in the caller's context.

:func:`numeric_check` runs the module twice on the same batch and the same RNG state, eagerly
and through ``torch.compile(module, backend=...)``, each time as a training step does: the forward
and the loss under the caller's ``torch.autocast`` and grad mode, the backward outside autocast.
It compares the gradients of every trainable parameter and of every input that requires grad
(rows ``input[0]`` …, or the keyword name). A difference over ``atol + rtol * max|g_eager|`` is a
``GRAD_MISMATCH`` finding that names the backward node responsible:

1. The AOT forward and backward graphs of the compiled run are recorded (the backend's own
   ``fw_compiler``/``bw_compiler`` are wrapped when it is AOTAutograd-based, as ``aot_eager`` is;
   any other backend, e.g. ``inductor``, gets an ``aot_eager`` re-run for the graphs). Each
   backward output is the gradient of one Dynamo graph input, matched to a parameter or input by
   tensor identity.
2. On the ancestors of that output, the first computing node (not a cast or a view) whose dtype
   differs from its forward counterpart (the forward node of the same ``seq_nr``) is named:
   "backward node mm_1 (aten.mm) computes in bfloat16 while its forward counterpart mm (aten.mm)
   ran in float32; source: file.py:LINE" (case N2 of ../shared/cases/gradient-paths.md).
3. Else the backward graph is run again in Python on the inputs the compiled code received: when
   its outputs differ from the compiled code's, the backend's code generation is at fault;
   otherwise the graph itself computes the gradient: its output and producing node are named.

Why the caller's context matters: a region that disables autocast inside an outer autocast runs
its forward in float32, but AOTAutograd traces its backward under the forward's ambient autocast
(``torch._functorch.config.backward_pass_autocast == "same_as_forward"``), so the backward mm runs
in bfloat16. Compiling the module alone, or the whole step including the autocast, hides it.

:func:`caller_context` reads the context the capture agent recorded on the run's Dynamo graphs
(``graphs.meta_json``: ``"autocast": [{"device", "dtype", "enabled"}, ...]``, ``"grad_enabled"``).
Imports torch lazily; :func:`caller_context` needs only the store.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from graphdeck.analysis.gradients.cuts import frames, short_source
from graphdeck.analysis.gradients.report import Finding, GradReport, ParamRow

# Ops that move, reshape or cast a value but compute nothing: never the "computing" node.
_NOT_COMPUTE = frozenset("""
_to_copy to convert_element_type view _unsafe_view reshape t permute transpose expand squeeze unsqueeze
clone detach alias slice select as_strided contiguous copy copy_ lift_fresh_copy split split_with_sizes
unbind view_as expand_as flatten unflatten getitem full zeros ones empty zeros_like ones_like full_like
empty_like scalar_tensor new_zeros new_ones new_empty new_full empty_strided fill sym_size sym_stride
sym_numel cat stack
""".split())
_CASTS = frozenset({"_to_copy", "to", "convert_element_type"})


@dataclass
class CallerContext:
    """The ambient state a compiled region ran under, as the capture recorded it.

    ``autocast``: one ``{"device": "cpu", "dtype": "bfloat16"}`` per device type where autocast was
    on (empty: off); ``grad_enabled``: grad mode (``None``: not recorded); ``origin``: where it was
    read; ``notes``: what the reader saw (graphs without the record, graphs that disagree).
    """

    autocast: list[dict] = field(default_factory=list)
    grad_enabled: bool | None = None
    origin: str = ""
    notes: list[str] = field(default_factory=list)


def caller_context(session, run) -> CallerContext | None:
    """The context recorded on ``run``'s Dynamo graphs (all ranks, capture order), or ``None``
    when no graph carries an ``"autocast"`` or ``"grad_enabled"`` key. The first graph's record
    is used; graphs that disagree with it are listed in ``notes``."""
    from sqlalchemy import select

    from graphdeck.store.schema import Graph

    rows = session.execute(select(Graph.rank, Graph.name, Graph.meta_json)
                           .where(Graph.run_id == run.id, Graph.kind == "dynamo")
                           .order_by(Graph.rank, Graph.ordinal)).all()
    seen: list[tuple[str, list[dict], bool | None]] = []
    missing = 0
    for rank, name, meta_json in rows:
        try:
            meta = json.loads(meta_json or "{}")
        except ValueError:
            meta = {}
        if "autocast" not in meta and "grad_enabled" not in meta:
            missing += 1
            continue
        entries = meta.get("autocast") or []
        entries = [entries] if isinstance(entries, dict) else list(entries)
        on = [{"device": str(e.get("device")), "dtype": str(e.get("dtype")).removeprefix("torch.")}
              for e in entries if isinstance(e, dict) and e.get("enabled", True)]
        grad = meta.get("grad_enabled")
        seen.append((f"rank {rank} graph {name!r}", on, None if grad is None else bool(grad)))
    if not seen:
        return None
    where, autocast, grad = seen[0]
    ctx = CallerContext(autocast=autocast, grad_enabled=grad, origin=f"run {run.name!r}, {where}")
    differ = [w for w, a, g in seen[1:] if (a, g) != (autocast, grad)]
    if differ:
        ctx.notes.append(f"{len(differ)} other Dynamo graph(s) ran under a different context "
                         f"(first: {differ[0]}); using {where}'s")
    if missing:
        ctx.notes.append(f"{missing} Dynamo graph(s) of the run carry no context record")
    return ctx


def context_options(ctx: CallerContext | None, example_inputs: Any, *, autocast: str | None = None,
                    autocast_device: str | None = None, run: str | None = None) -> tuple[dict, list[str]]:
    """Keyword arguments for :func:`numeric_check` (``autocast_dtype``, ``autocast_device``,
    ``grad_enabled``) from explicit options and a recorded context: ``autocast`` (a dtype name,
    or ``"off"``/``"none"``) wins over the record; without either autocast is off. The autocast
    entry of the record whose device is ``autocast_device`` (default: the inputs' device) is used,
    else its first. Returns ``(kwargs, notes)``, the notes saying where each value came from."""
    notes: list[str] = []
    kwargs: dict[str, Any] = {"autocast_device": autocast_device}
    if ctx is None and run is not None:
        notes.append(f"run {run!r} records no autocast/grad mode on its Dynamo graphs; using "
                     + ("--autocast" if autocast else "the defaults (no autocast, grad enabled)"))
    if ctx is not None:
        notes += ctx.notes
    if autocast is not None:
        kwargs["autocast_dtype"] = None if autocast.lower() in ("off", "none", "") else autocast
    elif ctx is not None and ctx.autocast:
        device = autocast_device or _device_of(example_inputs)
        entry = next((e for e in ctx.autocast if e["device"] == device), ctx.autocast[0])
        kwargs["autocast_dtype"], kwargs["autocast_device"] = entry["dtype"], entry["device"]
        notes.append(f"autocast({entry['device']}, {entry['dtype']}) from {ctx.origin}")
    else:
        kwargs["autocast_dtype"] = None
        if ctx is not None:
            notes.append(f"autocast off, as recorded in {ctx.origin}")
    if ctx is not None and ctx.grad_enabled is not None:
        kwargs["grad_enabled"] = ctx.grad_enabled
        notes.append(f"grad mode {'on' if ctx.grad_enabled else 'off'} from {ctx.origin}")
    return kwargs, notes


def _device_of(example_inputs: Any, model=None) -> str:
    import torch
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(example_inputs):
        if isinstance(t, torch.Tensor):
            return t.device.type
    for p in (model.parameters() if model is not None else ()):
        return p.device.type
    return "cpu"


def _autocast_dtype(name: str):
    import torch

    from graphdeck.errors import UsageError

    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name.lower().removeprefix("torch."), name.lower().removeprefix("torch."))
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(f"autocast dtype {name!r}: expected a floating dtype such as bfloat16 or float16")
    return dtype


@contextmanager
def _context(device: str, dtype, grad_enabled: bool):
    import torch

    with torch.set_grad_enabled(grad_enabled):
        if dtype is None:
            yield
        else:
            with torch.autocast(device, dtype=dtype):
                yield


def _named_inputs(example_inputs: Any, prefix: str | None = None) -> list[tuple[str, Any]]:
    """Tensor leaves of the inputs with names: ``input[0]``, ``input[1][2]``, the keyword name
    (``x``), ``x[0]`` inside it."""
    import torch

    if isinstance(example_inputs, torch.Tensor):
        return [(prefix or "input[0]", example_inputs)]
    if isinstance(example_inputs, dict):
        items = [(str(k) if prefix is None else f"{prefix}[{k!r}]", v) for k, v in example_inputs.items()]
    elif isinstance(example_inputs, (list, tuple)):
        items = [(f"{prefix or 'input'}[{i}]", v) for i, v in enumerate(example_inputs)]
    else:
        return []
    out = []
    for name, value in items:
        if isinstance(value, (torch.Tensor, list, tuple, dict)):
            out += _named_inputs(value, name)
    return out


def _run_step(model, example_inputs, loss_fn, ctx_args, rng, targets):
    """Forward + loss in the caller's context, backward outside it: (loss, outputs, gradients)."""
    import torch

    from graphdeck.analysis.gradients.eager import _call, _default_loss

    torch.set_rng_state(rng)
    with _context(*ctx_args):
        out = _call(model, example_inputs)
        loss = (loss_fn or _default_loss)(out)
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad) or not targets:
        return loss, out, None
    return loss, out, torch.autograd.grad(loss, targets, allow_unused=True)


def numeric_check(report: GradReport, model, example_inputs, loss_fn: Callable | None, *,
                  params: list[tuple[str, Any]], rank: int = 0, backend: Any = "aot_eager",
                  rtol: float = 1e-4, atol: float = 1e-5, autocast_dtype: str | None = None,
                  autocast_device: str | None = None, grad_enabled: bool = True) -> None:
    """Compare eager and ``torch.compile(model, backend=backend)`` gradients of one step and add
    the result to ``report`` (its ``notes``, ``grad_max_abs_diff`` of the rows, one row per input
    that requires grad, ``GRAD_MISMATCH`` findings naming the backward node; see the module doc).

    ``params``: ``(row name, parameter)`` of each parameter storage (the row's ``fqn``);
    ``example_inputs``: a tuple of positional args, a dict of keyword args or one tensor;
    ``autocast_dtype``: e.g. ``"bfloat16"`` (``None``: no autocast) on ``autocast_device``
    (a device type, default: the inputs' device); ``grad_enabled``: the caller's grad mode (off:
    there is no backward, the forward outputs are compared instead and only noted).
    Gradients are in the parameters' dtypes; diffs are max absolute differences in float32.
    The module's ``.grad`` fields and the CPU RNG state are left as found; Dynamo's caches are
    reset before and after.

    Raises:
        UsageError: ``autocast_dtype`` is not a floating dtype name.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    dtype = _autocast_dtype(autocast_dtype) if autocast_dtype else None
    device = autocast_device or _device_of(example_inputs, model)
    ctx_args = (device, dtype, bool(grad_enabled))
    where = (f"autocast({device}, {str(dtype).removeprefix('torch.')})" if dtype is not None else "no autocast") \
        + f", grad {'enabled' if grad_enabled else 'disabled'}"
    backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    report.notes.append(f"numeric mode: eager vs torch.compile(backend={backend_name!r}) on the same batch, "
                        f"forward and loss under {where}" + (", backward outside autocast" if grad_enabled else ""))
    targets = [(n, p) for n, p in params if p.requires_grad]
    inputs = [(n, t) for n, t in _named_inputs(example_inputs) if t.requires_grad]
    names = [n for n, _ in targets + inputs]
    tensors = [t for _, t in targets + inputs]
    by_id = {id(t): n for n, t in reversed(targets + inputs)}
    rng = torch.get_rng_state()

    rec = _Recorder(by_id, backend)
    torch._dynamo.reset()
    try:
        _, eager_out, eager = _run_step(model, example_inputs, loss_fn, ctx_args, rng, tensors)
        compiled = torch.compile(model, backend=rec.backend)
        _, comp_out, comp = _run_step(compiled, example_inputs, loss_fn, ctx_args, rng, tensors)
    finally:
        torch._dynamo.reset()
        torch.set_rng_state(rng)  # the check leaves the caller's RNG where it found it
    if eager is None or comp is None:
        e_leaves = [t for t in tree_leaves(eager_out) if isinstance(t, torch.Tensor)]
        c_leaves = [t for t in tree_leaves(comp_out) if isinstance(t, torch.Tensor)]
        diffs = [_amax(a.float() - b.float()) for a, b in zip(e_leaves, c_leaves) if a.shape == b.shape]
        report.notes.append(f"numeric mode: no gradients to compare under {where} (no backward); forward outputs "
                            f"max |eager - compiled| = {max(diffs, default=0.0):.3g}")
        return

    rows = {r.fqn: r for r in report.rows if r.status != "BUFFER"}
    input_names = {n for n, _ in inputs}
    bad: dict[str, tuple[float, float]] = {}  # name -> (diff, max |g_eager|)
    for (name, t), e, c in zip(targets + inputs, eager, comp):
        if e is None and c is None:
            if name in input_names:
                report.notes.append(f"{name} requires grad but no gradient reaches it (eager or compiled)")
            continue
        row = rows.get(name)
        if row is None and name in input_names:
            row = rows[name] = ParamRow(rank=rank, fqn=name, status="OK", aliases=[name], shape=list(t.shape),
                                        dtype=str(t.dtype).removeprefix("torch."), requires_grad=True, paths=1,
                                        reason="a model input that requires grad (numeric mode compares its "
                                               "gradient)")
            report.rows.append(row)
        if e is None or c is None:
            diff, scale = _amax(c if e is None else e), 0.0
            if row is not None:
                row.notes.append(f"{'eager' if e is None else 'compiled'} gives no gradient, the other "
                                 f"{'zeros' if diff == 0 else f'max |g| {diff:.3g}'}")
            failed = diff > atol
        else:
            diff, scale = _amax(e.float() - c.float()), _amax(e)
            failed = diff > atol + rtol * scale
        if row is not None:
            row.grad_max_abs_diff = diff
        if failed:
            bad[name] = (diff, scale)
    if not bad:
        return

    graphs_note, backend_at_fault, diag_rec = None, False, rec
    if not rec.wrapped:  # e.g. inductor: the AOT graphs come from an aot_eager re-run
        diag_rec = _Recorder(by_id, "aot_eager")
        torch._dynamo.reset()
        try:
            _, _, again = _run_step(torch.compile(model, backend=diag_rec.backend), example_inputs, loss_fn,
                                    ctx_args, rng, tensors)
        finally:
            torch._dynamo.reset()
            torch.set_rng_state(rng)
        same = sorted(n for n, e, a in zip(names, eager, again or [None] * len(names))
                      if n in bad and not _close(e, a, rtol, atol))
        if same:
            graphs_note = f"an aot_eager re-run shows the same difference for {', '.join(same)}"
        else:
            graphs_note = (f"an aot_eager re-run matches eager: the difference comes from {backend_name!r}'s "
                           "code, not from the AOT graphs")
            backend_at_fault, diag_rec.graphs = True, []
    _add_findings(report, bad, diag_rec, where, dtype, rtol, atol, graphs_note, backend_at_fault)


def _amax(t) -> float:
    """max |t| as a Python float (0.0 for an empty tensor)."""
    return t.float().abs().max().item() if t.numel() else 0.0


def _close(a, b, rtol, atol) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return _amax(a.float() - b.float()) <= atol + rtol * _amax(a)


# ---------------------------------------------------------------------------------- recording
@dataclass
class _AotGraphs:
    index: int  # Dynamo graph, in compile order
    names: list[str | None]  # per Dynamo graph input: the parameter/input it is, if any
    fw: Any = None
    bw: Any = None
    bw_args: list | None = None  # what the compiled backward received on its first call
    bw_outs: list | None = None  # and returned


class _Recorder:
    """A backend that compiles with ``backend`` and records the AOT graphs of each Dynamo graph.
    ``wrapped`` is false when ``backend`` is not AOTAutograd-based (it then compiles unrecorded)."""

    def __init__(self, names_by_id: dict[int, str], backend: Any):
        from torch._dynamo.backends.registry import lookup_backend

        self.names_by_id = names_by_id
        self.graphs: list[_AotGraphs] = []
        self.inner = lookup_backend(backend) if isinstance(backend, str) else backend
        self.aot_eager = backend == "aot_eager" or self.inner is lookup_backend("aot_eager")
        self.aot_kwargs = getattr(self.inner, "kwargs", None) if type(self.inner).__name__ == "AotAutograd" else None
        self.wrapped = self.aot_eager or self.aot_kwargs is not None

    def backend(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        if not self.wrapped:
            return self.inner(gm, example_inputs)
        rec = _AotGraphs(len(self.graphs), [self.names_by_id.get(id(t)) for t in example_inputs])
        self.graphs.append(rec)

        def keep(slot: str, compiler, calls: bool):
            def compile_(g, ex):
                setattr(rec, slot, g)
                fn = compiler(g, ex) if compiler is not None else make_boxed_func(g.forward)
                return _recording_call(fn, rec) if calls else fn

            return compile_

        if self.aot_eager:
            return self.inner(gm, example_inputs, fw_compiler=keep("fw", None, False),
                              bw_compiler=keep("bw", None, True))
        kw = dict(self.aot_kwargs)
        if kw.get("inference_compiler") is kw.get("fw_compiler"):
            kw.pop("inference_compiler", None)
        bw = kw.get("bw_compiler") or kw["fw_compiler"]
        kw["fw_compiler"], kw["bw_compiler"] = keep("fw", kw["fw_compiler"], False), keep("bw", bw, True)
        return aot_autograd(**kw)(gm, example_inputs)


def _snap(v):
    import torch

    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _recording_call(fn, rec: _AotGraphs):
    boxed = getattr(fn, "_boxed_call", False)

    def run(args):
        if rec.bw_args is None:
            rec.bw_args = [_snap(a) for a in args]
        out = fn(args) if boxed else fn(*args)
        if rec.bw_outs is None:
            rec.bw_outs = [_snap(o) for o in out]
        return out

    run._boxed_call = True
    return run


# ---------------------------------------------------------------------------------- diagnosis
def _op(node) -> str:
    if node.op != "call_function":
        return node.op
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))


def _qual(node) -> str:
    t = node.target
    return str(t).rsplit(".", 1)[0] if getattr(t, "overloadpacket", None) is not None else _op(node)


def _dtype(node):
    import torch

    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        v = next((x for x in v if isinstance(x, torch.Tensor)), None)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _computes(node) -> bool:
    d = _dtype(node)
    return node.op == "call_function" and _op(node) not in _NOT_COMPUTE and d is not None and d.is_floating_point


def _source(*nodes) -> str | None:
    for n in nodes:
        fr = frames(n.meta.get("stack_trace")) if n is not None else []
        if fr:
            return short_source(fr[-1][0], fr[-1][1])
    return None


def _ancestors(out_node) -> list:
    seen, stack = {out_node}, [out_node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _outputs(gm) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]


@dataclass
class _Diag:
    key: tuple
    detail: str
    node: str | None = None
    source: str | None = None
    kind: str = "graph"  # "dtype" | "compiler" | "graph" | "none"
    lower: bool = False  # the backward computes in a lower precision than the forward


def _diagnose(rec: _Recorder, name: str, rtol: float, atol: float) -> _Diag:
    """The backward node to blame for ``name``'s gradient (see the module doc, steps 2 and 3)."""
    import torch

    hits = [(g, k) for g in rec.graphs if g.bw is not None for k in range(len(g.names)) if g.names[k] == name
            and len(_outputs(g.bw)) == len(g.names)]
    produced = []
    for g, k in hits:
        out = _outputs(g.bw)[k]
        if not isinstance(out, torch.fx.Node):
            continue
        fw_by_seq: dict[int, list] = {}
        fw_by_trace: dict[str, list] = {}
        for f in (g.fw.graph.nodes if g.fw is not None else ()):
            if f.meta.get("seq_nr") is not None:
                fw_by_seq.setdefault(f.meta["seq_nr"], []).append(f)
            if f.meta.get("stack_trace"):
                fw_by_trace.setdefault(f.meta["stack_trace"], []).append(f)
        anc = _ancestors(out)
        for n in g.bw.graph.nodes:
            if n not in anc or not _computes(n):
                continue
            # The forward node of the same autograd sequence number; else one of the same op and source.
            cands = [f for f in fw_by_seq.get(n.meta.get("seq_nr"), []) if _computes(f)] or [
                f for f in fw_by_trace.get(n.meta.get("stack_trace") or "", []) if _computes(f) and _op(f) == _op(n)]
            f = next((c for c in cands if _op(c) == _op(n)), cands[-1] if cands else None)
            if f is None or _dtype(f) == _dtype(n):
                continue
            bw_t, fw_t = (str(_dtype(x)).removeprefix("torch.") for x in (n, f))
            fw_named = {f.name: f for f in g.fw.graph.nodes}
            casts = [a.name if a.op != "placeholder" else f"{a.name} (in the forward, saved)"
                     for a in n.all_input_nodes if _dtype(a) == _dtype(n)
                     and _op(a if a.op != "placeholder" else fw_named.get(a.name, a)) in _CASTS]
            src = _source(f, n)
            detail = (f"backward node {n.name} ({_qual(n)}) computes in {bw_t} while its forward counterpart "
                      f"{f.name} ({_qual(f)}) ran in {fw_t}"
                      + (f" (its inputs are cast to {bw_t} by {', '.join(casts)})" if casts else "")
                      + (f"; source: {src}" if src else ""))
            return _Diag(key=("dtype", g.index, n.name), detail=detail, node=n.name, source=src, kind="dtype",
                         lower=_dtype(n).itemsize < _dtype(f).itemsize)
        # Follow casts and views back to the node that computes the gradient.
        prod = out
        while not _computes(prod) and prod.op == "call_function" and prod.all_input_nodes:
            prod = prod.all_input_nodes[0]
        produced.append((g, k, out, prod))
    for g, k, out, prod in produced:
        if g.bw_args is None or g.bw_outs is None or k >= len(g.bw_outs) or g.bw_outs[k] is None:
            continue
        with torch.no_grad():
            ref = _outputs_of(g.bw(*g.bw_args))
        if k < len(ref) and ref[k] is not None and not _close(ref[k], g.bw_outs[k], rtol, atol):
            d = _amax(ref[k].float() - g.bw_outs[k].float())
            return _Diag(key=("compiler", g.index), kind="compiler", node=prod.name, source=_source(prod),
                         detail=f"the backend's compiled code for backward graph {g.index} returns other values than "
                                f"the graph itself computes (first: output {k}, made by {prod.name} ({_qual(prod)}), "
                                f"max |compiled - graph| {d:.3g})")
    if produced:
        g, k, out, prod = produced[0]
        src = _source(prod)
        return _Diag(key=("graph", g.index, prod.name), node=prod.name, source=src,
                     detail=f"dtypes of backward graph {g.index} match the forward; its output {k} ({out.name}) "
                            f"is computed by {prod.name} ({_qual(prod)})" + (f"; source: {src}" if src else ""))
    return _Diag(key=("none",), kind="none", detail="no recorded backward graph output is its gradient")


def _outputs_of(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _add_findings(report: GradReport, bad: dict[str, tuple[float, float]], rec: _Recorder, where: str,
                  autocast_dtype, rtol: float, atol: float, graphs_note: str | None,
                  backend_at_fault: bool = False) -> None:
    import torch

    groups: dict[tuple, tuple[_Diag, list[str]]] = {}
    for name in bad:
        diag = (_diagnose(rec, name, rtol, atol) if rec.graphs else
                _Diag(key=("none",), kind="compiler" if backend_at_fault else "none", detail=""))
        groups.setdefault(diag.key, (diag, []))[1].append(name)
    mode = getattr(torch._functorch.config, "backward_pass_autocast", None)
    for diag, names in groups.values():
        diff = max(bad[n][0] for n in names)
        scale = max(bad[n][1] for n in names)
        severity, detail = "error", diag.detail
        if diag.kind == "dtype" and diag.lower and autocast_dtype is not None and mode == "same_as_forward":
            fix = ("the compiled backward is traced under the forward's ambient autocast "
                   "(torch._functorch.config.backward_pass_autocast == 'same_as_forward'), which ignores the "
                   "region's own autocast setting: set torch._functorch.config.backward_pass_autocast = 'off', "
                   "compile the whole step including the outer autocast, or cast explicitly inside the region")
        elif diag.kind == "dtype":
            fix = "make the forward and backward dtypes agree (an explicit cast in the region), then re-check"
        elif diag.kind == "compiler":
            fix = "the AOT graph is right and the backend's code is not: report it against the backend"
        else:
            fix = ("compare the AOT backward graph of the compiled region with eager; "
                   "try backend='aot_eager' to separate AOTAutograd from Inductor")
            low = autocast_dtype is not None and autocast_dtype.itemsize < 4
            if low and diag.kind != "compiler" and diff <= 8 * torch.finfo(autocast_dtype).eps * max(scale, 1e-12):
                severity = "warning"
                detail += (f"; within 8 {str(autocast_dtype).removeprefix('torch.')} rounding steps of max|g|: "
                           "possibly reduced-precision rounding")
        if graphs_note:
            detail = f"{graphs_note}; {detail}" if detail else graphs_note
        message = (f"compiled gradients differ from eager for {', '.join(names)} under {where} "
                   f"(max |eager - compiled| {diff:.3g}, above {atol} + {rtol}·max|g| {scale:.3g})"
                   + (f": {detail}" if detail else ""))
        report.findings.append(Finding(kind="GRAD_MISMATCH", severity=severity, params=names, message=message,
                                       source=diag.source, node=diag.node, fix=fix))
