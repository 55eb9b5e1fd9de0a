"""Reference-parity evidence: one optimizer step's gradients and backward-node values, recorded so
that ``graphdeck parity`` can compare a sharded run with its unsharded reference.

# NOTE: [Parity evidence]
# Off unless ``GRAPHDECK_PARITY`` is set (``graphdeck parity`` sets it for the two runs it
# launches): ``"STEP"`` or ``"STEP,MAX_ELEMENTS"``. At optimizer step ``STEP`` (numbered as
# ``grad_steps`` numbers them: optimizer steps taken before; 0 is the first) the agent records
#
# * per backward of the step (at most ``MAX_BACKWARDS``): the value of its root (the loss), and
#   for every node of the autograd graph in execution order its name, the forward source line
#   (anomaly mode with ``check_nan=False`` is on from the previous step's end to this step's
#   backward: it records where each node was made and checks nothing), the gradients it
#   received (``incoming``) and those it computed (``grad``);
# * at the optimizer-step pre-hook: every watched trainable parameter's gradient.
#
# A value is stored as this rank's local tensor (a ``DTensor``'s ``_local_tensor``) with what
# makes it whole again offline: the global shape, the placements, the mesh shape, this rank's
# mesh coordinate and the shard's global offset. Values (float32, float64 kept) are stored only
# when the local tensor has at most ``MAX_ELEMENTS`` elements (default ``DEFAULT_MAX_ELEMENTS``)
# and the rank's total stays under ``max(TOTAL_ELEMENTS, MAX_ELEMENTS)`` (the nodes' values and the
# parameters' each have that budget); past that only the norm is kept (compared as a norm), and the
# analysis says the value was not compared. Nothing is written to a gradient (hooks read,
# copies go to the CPU), and nothing is recorded outside the one step.
#
# Reference mode (``GRAPHDECK_PARITY_ROLE=reference``, world size 1): every mesh has one rank, so
# each collective is an identity and a DTensor's local tensor is the whole value. The
# ``loss_parallel()`` handlers (``aten._log_softmax``, its backward, ``nll_loss`` forward and
# backward) are replaced by the ops' own single-device kernels on those whole values, so the
# reference computes what the unsharded model computes, not what the distributed handlers do.
#
# ``GRAPHDECK_PARITY_STORE`` / ``GRAPHDECK_PARITY_RUN`` override the store and run the script
# passes to ``Agent`` (the command owns the two runs' names).
#
# Records: one ``compile_events`` row per rank, ``name = "graphdeck_parity"``, payload
# ``{"version": 1, "role", "step", "world", "rank", "max_elements", "reference_ops": [op],
# "backwards": [{"root": value, "nodes": [{"name", "source", "grad": [value|null],
# "incoming": [value|null]}], "truncated": bool}], "params": {fqn: value | null},
# "at": "optimizer_step" | "exit"}``; ``value``: ``{"shape", "dtype", "norm", "place":
# [repr] | null, "mesh": [n], "coord": [i], "offset": [o], "local": [s], "data": base64 | absent}``.
"""

from __future__ import annotations

import base64
import json
import os
import warnings
import weakref
from typing import Any

import torch

ENV = "GRAPHDECK_PARITY"
EVENT = "graphdeck_parity"
DEFAULT_MAX_ELEMENTS = 1 << 16
TOTAL_ELEMENTS = 1 << 22  # per rank: the backward nodes' values together, and the parameters' apart
MAX_BACKWARDS = 8
MAX_NODES = 20000
_PLUMBING = ("torch::autograd::AccumulateGrad",)


def parse_spec(spec: str | None) -> tuple[int, int] | None:
    """``"STEP"`` or ``"STEP,MAX_ELEMENTS"`` → ``(step, max_elements)``; None/empty → None.
    Raises ``ValueError`` on anything else."""
    if spec is None or not str(spec).strip():
        return None
    step, _, cap = str(spec).strip().partition(",")
    out = (int(step), int(cap) if cap.strip() else DEFAULT_MAX_ELEMENTS)
    if out[0] < 0 or out[1] < 0:
        raise ValueError(f"{ENV}={spec!r}: expected STEP[,MAX_ELEMENTS], non-negative")
    return out


class ParityCapture:
    """One rank's parity evidence for one step (NOTE: [Parity evidence])."""

    def __init__(self, agent: Any, step: int, max_elements: int, role: str | None):
        self.agent = agent
        self.step = step
        self.max_elements = max_elements
        self.role = role
        self._steps = 0  # optimizer steps completed (of the first optimizer seen)
        self._opt: Any = None
        budget = max(TOTAL_ELEMENTS, max_elements)
        self._budget = {"node": budget, "param": budget}
        self._backwards: list[dict] = []
        self._written = False
        self._failed = False
        self._anomaly: tuple | None = None
        self._orig_backward = None
        self.reference_ops: list[str] = []
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        self._patch_backward()
        if role == "reference":
            self._reference_handlers()
        if step == 0:
            self._anomaly_on()

    @classmethod
    def from_env(cls, agent: Any) -> "ParityCapture | None":
        parsed = parse_spec(os.environ.get(ENV))
        if parsed is None:
            return None
        if os.environ.get("GRAPHDECK_PARITY_STORE"):
            agent.store = os.environ["GRAPHDECK_PARITY_STORE"]
        if os.environ.get("GRAPHDECK_PARITY_RUN"):
            agent.run = os.environ["GRAPHDECK_PARITY_RUN"]
        return cls(agent, parsed[0], parsed[1], os.environ.get("GRAPHDECK_PARITY_ROLE") or None)

    # ------------------------------------------------------------------ values
    def value(self, t: Any, kind: str = "node") -> dict | None:
        """One gradient as stored (see the module note); None for None or a non-tensor."""
        if not isinstance(t, torch.Tensor):
            return None
        rec: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "place": None}
        local = t
        spec = getattr(t, "_spec", None)
        if spec is not None and hasattr(t, "_local_tensor"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = t._local_tensor
            mesh = spec.mesh
            rec["place"] = [repr(p) for p in spec.placements]
            rec["mesh"] = list(mesh.shape)
            rec["coord"] = list(mesh.get_coordinate() or [])
            rec["local"] = list(local.shape)
            rec["offset"] = list(compute_local_shape_and_global_offset(t.shape, mesh, spec.placements)[1])
        with torch.no_grad():
            local = local.detach()
            if not local.is_floating_point():
                return rec
            cpu = local.to("cpu", torch.float64 if local.dtype == torch.float64 else torch.float32).contiguous()
            rec["norm"] = float(cpu.norm()) if cpu.numel() else 0.0
            if cpu.numel() <= self.max_elements and cpu.numel() <= self._budget[kind]:
                self._budget[kind] -= cpu.numel()
                rec["vdtype"] = str(cpu.dtype).removeprefix("torch.")
                rec["data"] = base64.b64encode(cpu.numpy().tobytes()).decode("ascii")
        return rec

    # ------------------------------------------------------------------ backward
    def _patch_backward(self) -> None:
        orig = torch.autograd.backward
        ref = weakref.ref(self)

        def backward(tensors, *args, **kwargs):
            me = ref()
            if me is None or not me._due():
                return orig(tensors, *args, **kwargs)
            return me._recorded_backward(orig, tensors, *args, **kwargs)

        backward._graphdeck_parity = True
        self._orig_backward = orig
        torch.autograd.backward = backward

    def _due(self) -> bool:
        return (not self._failed and not self._written and self._steps == self.step
                and len(self._backwards) < MAX_BACKWARDS and not torch.compiler.is_compiling())

    def _recorded_backward(self, orig, tensors, *args, **kwargs):
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        entry: dict[str, Any] = {"nodes": [], "truncated": False}
        handles = []
        try:
            entry["root"] = self.value(roots[0].detach()) if roots and isinstance(roots[0], torch.Tensor) else None
            seen, stack = set(), [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
            while stack:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                stack += [f for f, _ in node.next_functions]
                if node.name() in _PLUMBING:
                    continue
                if len(seen) > MAX_NODES:
                    entry["truncated"] = True
                    break
                handles.append(node.register_hook(self._node_hook(entry, node)))
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            self._fail(exc)
        self._backwards.append(entry)
        try:
            return orig(tensors, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            self._anomaly_off()

    def _node_hook(self, entry: dict, node):
        def hook(grad_inputs, grad_outputs):
            try:
                entry["nodes"].append({"name": node.name(), "source": _source(node),
                                       "grad": [self.value(g) for g in grad_inputs],
                                       "incoming": [self.value(g) for g in grad_outputs]})
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

        return hook

    def _anomaly_on(self) -> None:
        if self._anomaly is None:
            self._anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(True, check_nan=False)

    def _anomaly_off(self) -> None:
        if self._anomaly is not None:
            torch.autograd.set_detect_anomaly(self._anomaly[0], check_nan=self._anomaly[1])
            self._anomaly = None

    # ------------------------------------------------------------------ optimizer step
    def _pre(self, opt, *_a, **_k) -> None:
        if self._opt is None:
            self._opt = weakref.ref(opt)
        if self._opt() is opt and self._steps == self.step and not self._written:
            self._write("optimizer_step")

    def _post(self, opt, *_a, **_k) -> None:
        if self._opt is not None and self._opt() is opt:
            self._steps += 1
            if self._steps == self.step and not self._written:
                self._anomaly_on()  # the next forward is the recorded step's

    def _params(self) -> dict:
        out: dict = {}
        for model in list(getattr(self.agent, "_models", ())):
            for fqn, p in self.agent.named_tensors(model):
                if p.requires_grad and fqn not in out:
                    out[fqn] = self.value(p.grad, "param")
        return out

    def _write(self, at: str) -> None:
        if self._written or self._failed:
            return
        self._written = True
        self._anomaly_off()
        try:
            from graphdeck.capture.agent import _dist_info

            rank, world, _ = _dist_info()
            payload = {"version": 1, "role": self.role, "step": self.step, "world": world, "rank": rank,
                       "max_elements": self.max_elements, "reference_ops": self.reference_ops,
                       "backwards": self._backwards, "params": self._params(), "at": at}
            self.agent.writer.write_records(EVENT, [json.dumps(payload)])
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        self._backwards = []

    def flush(self) -> None:
        """At close/exit: write what was recorded when the step's optimizer step never came."""
        if not self._written and (self._backwards or self._steps >= self.step):
            self._write("exit")

    def close(self) -> None:
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(torch.autograd.backward, "_graphdeck_parity", False) and self._orig_backward is not None:
            torch.autograd.backward = self._orig_backward

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self._anomaly_off()
            warnings.warn(f"graphdeck: parity evidence stopped: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ reference mode
    def _reference_handlers(self) -> None:
        """World size 1: ``loss_parallel()`` installs the single-device ops instead of its handlers."""
        try:
            import torch.distributed.tensor.parallel.loss as lp
        except Exception:  # noqa: BLE001 - no DTensor: nothing to replace
            return
        ops = list(lp.customized_loss_ops)
        from torch.distributed.tensor import DTensor

        def enable():
            from graphdeck.capture.agent import _dist_info

            if _dist_info()[1] != 1:  # a reference must run at world size 1: keep DTensor's own handlers
                if self.reference_ops:
                    warnings.warn("graphdeck: the parity reference runs at world size > 1: loss_parallel's own "
                                  "handlers are kept")
                    self.reference_ops = []
                DTensor._op_dispatcher._custom_op_handlers.update(lp.customized_loss_ops)
                return
            DTensor._op_dispatcher._custom_op_handlers.update({op: _single_device_handler for op in ops})

        def disable():
            for op in ops:
                DTensor._op_dispatcher._custom_op_handlers.pop(op, None)

        lp._enable_custom_loss_ops, lp._disable_custom_loss_ops = enable, disable
        self.reference_ops = [str(op) for op in ops]


def _single_device_handler(op_call, args, kwargs):
    """An op on 1-rank DTensors computed by its own kernel on the whole values; an output takes the
    placements of the first DTensor argument of its shape (the logits' for the log_softmax and the
    nll_loss backward), else Replicate."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.utils._pytree import tree_leaves, tree_map

    dts = [a for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    spec = dts[0]._spec
    if spec.mesh.size() != 1:
        raise RuntimeError("graphdeck parity reference handlers run at world size 1 only")

    def local(a):
        return a._local_tensor if isinstance(a, DTensor) else a

    out = op_call(*tree_map(local, args), **tree_map(local, kwargs))

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        like = next((d for d in dts if tuple(d.shape) == tuple(t.shape)), None)
        place = like._spec.placements if like is not None else (Replicate(),) * spec.mesh.ndim
        meta = TensorMeta(t.shape, t.stride(), t.dtype)
        return DTensor(t, DTensorSpec(spec.mesh, tuple(place), tensor_meta=meta), requires_grad=t.requires_grad)

    return tree_map(wrap, out)


def _source(node) -> str | None:
    """``file:line`` of the user frame that made ``node`` in the forward (anomaly mode's record)."""
    tb = (getattr(node, "metadata", None) or {}).get("traceback_")
    if not tb:
        return None
    text = "".join(tb) if isinstance(tb, (list, tuple)) else str(tb)
    from graphdeck.analysis.gradients.cuts import frames, short_source

    here = os.path.dirname(os.path.abspath(__file__))
    user = [f for f in frames(text) if "/torch/" not in f[0].replace("\\", "/") and not f[0].startswith(here)]
    return short_source(user[-1][0], user[-1][1]) if user else None
