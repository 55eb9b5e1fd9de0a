"""Gradient evidence under FSDP2 and compiled autograd, and the DDP wrapper a watched model got after
``watch()`` — the optimizer-step side of :class:`graphdeck.capture.grad_evidence.GradEvidence` (a mixin: it reads and
writes that class's state; see NOTE: [Gradient evidence] there)."""

from __future__ import annotations

import weakref

import torch

from graphdeck.capture.grad_sites import compiled_autograd_ran
from graphdeck.capture.grad_steady import watch_zero_grad


class FsdpEvidence:
    """``GradEvidence``'s methods for FSDP2 and compiled autograd (read at each optimizer step) and a
    late DDP wrapper."""

    # NOTE: [FSDP2 evidence]
    # FSDP2 assigns each sharded parameter's ``.grad`` (a DTensor) after its reduce-scatter
    # (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`` ``foreach_reduce``), or adds
    # into its local tensor when one is already there: the watched parameter's gradient hook
    # never fires. What arrived is read where the optimizer reads it: a global optimizer-step
    # pre-hook looks, per watched trainable parameter (the live, sharded ones), at ``.grad``: None,
    # or the same tensor at the same version (of its local shard) as at the previous step, is
    # ``none``; else ``ok``. Nothing is synchronised or copied (``.grad`` and ``._version`` only).
    # A backward after the last step is read once more at ``close()``/exit. Limits: zero-filled
    # gradients (a compiled backward's zeros) and gradients accumulated twice cannot be told from
    # real ones here (said in the state as ``"limits"``); steps are optimizer steps (a job that
    # never steps gives its one read at exit); several optimizers read at each of their steps.
    def _on_step_pre(self, opt=None, *_a, **_k) -> None:
        nested = False
        try:
            nested = self._step_pre(opt)
        finally:  # NOTE: [Gradient fingerprints]: after a backward closed here was noted
            if self._prints is not None and not nested:  # the outermost step only (NOTE: [Nested optimizer steps])
                self._prints.before_step(opt, self._opt_steps)

    def _step_pre(self, opt) -> bool:
        """The pre-hook's evidence work; True when ``opt`` steps inside another optimizer's step."""
        if self._failed:
            return False
        try:
            if opt is not None and opt not in self._zero_seen:  # NOTE: [Steady mode]: the baseline's shortcut
                self._zero_seen.add(opt)
                watch_zero_grad(opt, weakref.WeakMethod(self._on_zero_grad))
            if self._step_opened(opt):
                return True  # an optimizer stepped by another one's step: the outer step is the step
            if not self._ca_steps and compiled_autograd_ran():
                self._to_steps()  # its first backward is read here (NOTE: [Evidence under compiled autograd])
            if self._check is not None:
                self._unseen_backward()
                return
            if self._fsdp is None:
                self._fsdp = self._fsdp2()
                if not self._fsdp:
                    self._note_late_ddp()  # as _close does when it first asks
            if self._fsdp or self._ca_steps:
                with self._lock:
                    self._fsdp_step(self._opt_steps, at_exit=False, partial_=False)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            self._fail(exc)

    # NOTE: [Nested optimizer steps]
    # An optimizer whose ``step`` steps other optimizers (torchtitan's ``OptimizersContainer``, an
    # ``Optimizer`` subclass holding one optimizer per model part) fires torch's global step hooks
    # once for itself and once per member: one training step, counted as the trainer counts it, is
    # the outermost ``step``. The steps open now are kept in order (pre-hook: push; post-hook: pop
    # to it); a step hook inside another step is neither counted nor read. An optimizer found open
    # again at its own pre-hook is a step that raised (no post-hook ran): what was open is dropped.
    def _step_opened(self, opt) -> bool:
        """Push ``opt``'s step; True when it runs inside another optimizer's step."""
        if opt is None:  # an old hook signature: every step counted
            return False
        stack = self._open_steps
        if any(ref() is opt for ref in stack):
            stack.clear()
        nested = bool(stack)
        try:
            stack.append(weakref.ref(opt))
        except TypeError:  # not weak-referenceable (None from an old hook signature): counted
            return False
        return nested

    def _step_closed(self, opt) -> bool:
        """Pop ``opt``'s step; True when it was the outermost one (a training step ended)."""
        stack = self._open_steps
        if opt is None:
            return True
        for i in range(len(stack) - 1, -1, -1):
            if stack[i]() is opt:
                del stack[i:]
                break
        return not stack

    def note_ddp(self, ddp) -> None:
        """A ``DistributedDataParallel`` wrapper of a watched model (its sync state is read at each
        backward and step: NOTE: [Gradient fingerprints] in grad_prints.py)."""
        if self._prints is not None:
            self._prints.note_ddp(ddp)

    def _on_zero_grad(self, opt) -> None:
        """``opt.zero_grad(set_to_none=True)`` returned (:func:`watch_zero_grad`)."""
        chk = self._check
        if chk is not None and not self._failed:
            try:
                chk.cleared(opt)
            except Exception as exc:  # noqa: BLE001 - capture never breaks training
                self._fail(exc)

    def _fsdp_step(self, step: int, at_exit: bool, partial_: bool) -> None:
        """Read which watched trainable parameters hold a new ``.grad`` (NOTE: [FSDP2 evidence])
        and write it as step ``step``'s ``grad_steps`` row; at exit, only when something is new
        (``partial_``: the job is dying, perhaps inside that backward)."""
        if self._fsdp_params is None:
            self._fsdp_off_hooks()
            self._fsdp_params = [(fqn, p) for model in self.agent._models for fqn, p in self.agent.named_tensors(model)]
        sig, wref = self._fsdp_sig, weakref.ref
        none, frozen, trainable, new = [], [], 0, False
        for fqn, p in self._fsdp_params:
            if not p.requires_grad:
                frozen.append(fqn)
                continue
            trainable += 1
            g = p.grad
            if g is None:
                sig.pop(fqn, None)
                none.append(fqn)
                continue
            v = getattr(g, "_local_tensor", g)._version
            prev = sig.get(fqn)
            if prev is not None and prev[0]() is g and prev[1] == v:
                none.append(fqn)  # the gradient of an earlier step, untouched since
                continue
            new = True
            sig[fqn] = (wref(g), v)
        if at_exit and not new:
            return
        state = {"trainable": trainable, "none": none, "zero": [], "multi": {}, "frozen": frozen, "unobserved": [],
                 "limits": ["zero", "multi"]}
        if self._fsdp:
            state["fsdp2"] = True
        if self._ca_steps:
            state["compiled_autograd"] = True
        if at_exit:
            state["at_exit"] = True
        if partial_:
            state["partial"] = True
        self._emit(step, "optimizer", state, {})
        self._fsdp_rows += 1

    # NOTE: [Evidence under compiled autograd]
    # Compiled autograd collects every hook on the autograd graph when a backward starts (the
    # per-parameter gradient hooks, the pre-hooks on compiled outputs' nodes) and traces them into
    # its graph: with them it compiles another graph (more guards) than the job without graphdeck,
    # and once steady mode took them off, once more. So where a backward may run under compiled
    # autograd (:func:`~graphdeck.capture.grad_sites.compiled_autograd_coming`, asked at each
    # grad-enabled compiled call, before its backward: the job turned
    # ``torch._dynamo.config.compiled_autograd`` on, the forward runs inside
    # ``compiled_autograd._enable`` — torch's documented use —, or compiled autograd already ran a
    # backward) the capture puts no hook on the autograd graph for good: the parameters' hooks come
    # off (torch's with them) and no compiled call's outputs get a pre-hook (nor the
    # ``OutputGradNote``: the graph's ``outputs_without_grad`` stay unrecorded). What is recorded
    # then is read where FSDP2's is (NOTE: [FSDP2 evidence]): at each optimizer step, per watched
    # trainable parameter, whether ``.grad`` is a new gradient (another tensor, or the same one at
    # another version, than at the last step) or none; the rows say ``"compiled_autograd": true``
    # and the same limits (a zero-filled gradient, one accumulated twice, cannot be told from a real
    # one). A ``graphdeck_evidence_mode`` record says so at once (a job ended by ``os._exit`` before
    # its first step still tells why it has no row). Limit: ``_enable`` around ``backward()`` alone,
    # the forward outside it, shows nothing before the first backward — that one's graph has the
    # hooks in it (they stand down at run time), and the next compiles again without them
    # (tests/test_capture_matrix.py, variant ``compiled_autograd_backward_only``, strict xfail).
    def _to_steps(self) -> None:
        """Compiled autograd runs (or may run) the backward passes: no hook of the capture on the
        autograd graph from now on, ``.grad`` read at each optimizer step instead (NOTE: [Evidence
        under compiled autograd])."""
        if self._ca_steps or self._failed:
            return
        with self._lock:
            w = self._win
            if w is not None and not w.closed:
                self._close(w, partial_=bool(w.pending))
            self._ca_steps, self._steady, self._check = True, False, None
            self._fsdp_off_hooks()
        self.agent.writer.write_compile_events([{"name": "graphdeck_evidence_mode", "compile_id": None, "metadata": {},
                                                 "payload": '{"mode": "compiled_autograd"}'}])

    def _fsdp_off_hooks(self) -> None:
        """Under FSDP2 the per-parameter hooks never fire: take them off (nothing else changes)."""
        self._unhook()
        self._hooked.clear()

    def _fsdp2(self) -> bool:
        """Whether a watched model is under FSDP2 now: it assigns sharded gradients after its
        reduce-scatter instead of accumulating them, so the hooks see nothing (evidence off)."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except Exception:  # noqa: BLE001
            return False
        return any(isinstance(m, FSDPModule) for model in self.agent._models for m in model.modules())

    def _note_late_ddp(self) -> None:
        """A model watched before ``DistributedDataParallel(model)`` wrapped it (the agent then never
        saw the wrapper): find the wrapper among the model's referrers, once, and record how DDP runs
        (a new ``graphdeck_watch`` record), so the report names DDP's consequences."""
        agent = self.agent
        if agent._watch_info.get("ddp"):
            return
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return  # no DDP without a process group; the heap walk below costs ~1-2 s of the first step
        import gc

        from graphdeck.capture.compile_context import is_ddp, parallel_info

        def is_wrapper(obj, model) -> bool:
            return is_ddp(obj) and getattr(obj, "module", None) is model

        for model in agent._models:  # model <- DDP._modules <- DDP.__dict__ <- DDP
            for modules in gc.get_referrers(model):
                if not isinstance(modules, dict):
                    continue
                for attrs in gc.get_referrers(modules):
                    owners = [attrs] + (gc.get_referrers(attrs) if isinstance(attrs, dict) else [])
                    owner = next((o for o in owners if is_wrapper(o, model)), None)
                    if owner is not None:
                        if self._prints is not None:
                            self._prints.note_ddp(owner)
                        agent._watch_info.update(parallel_info(owner))
                        agent._write_params()
                        return
