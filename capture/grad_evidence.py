"""Run-time gradient evidence: on this rank, in every backward pass, which trainable parameter
received a gradient, which an all-zero one from a compiled region whose outputs the loss skipped,
which none, and which was accumulated more than once.

# NOTE: [Gradient evidence]
# Graph facts say what *can* happen; what did happen lives at run time. Per watched parameter a
# gradient hook counts accumulations (one dict update; NOTE: [Hooks stay on the tensor]). A
# *window* is one
# backward: it opens at the first event of a backward and closes when the autograd task that
# opened it finishes (a callback queued on that task). Reentrant activation checkpointing runs a
# nested backward per checkpointed call, in its own autograd task: a callback that finds itself
# inside an autograd Function's backward (``torch/autograd/function.py`` ``apply`` on the Python
# stack) is nested and does not close the window; a later task joins the open window unless an
# optimizer step or a compiled forward happened since it opened. A parameter counted twice in one
# window is what DDP calls "marked ready twice".
#
# Zero-filled gradients: a compiled region gives every output a gradient slot, and AOTAutograd
# fills the slot of an output the loss never used with zeros, so its parameters get an all-zero
# gradient instead of none (DDP's hooks fire; the rank averages zeros into the model). Each
# grad-enabled call of a compiled graph puts a pre-hook on its outputs' autograd nodes; the hook
# sees ``None`` for the skipped outputs. A parameter whose every observed output it reaches
# (forward reachability, computed once per graph at compile time) was skipped, and that no live
# output reaches, is zero-filled. Limits: an output of graph A that feeds graph B (a graph break)
# gets zeros, not None, when B's output is skipped; only the outputs of the graph the loss reads
# are seen.
#
# Cost: full mode is one hook call per parameter per backward; once backward passes repeat,
# steady mode (NOTE: [Steady mode] in ``grad_steady.py``) takes the hooks off (torch's own
# included) and looks at every ``.grad`` once per backward at C speed (and at the forward, at
# those the optimizer's own ``zero_grad`` did not clear). A window whose state
# equals the previous one only moves the row's end in memory (persisted every ``PERSIST_EVERY_S``
# s, at ``close()`` and at interpreter exit). A state that changes is written at once, so a job
# that dies loses at most the extent of the last row.
#
# FSDP2 (NOTE: [FSDP2 evidence]), compiled autograd (NOTE: [Evidence under compiled autograd]: no
# hook then, ``.grad`` read at each optimizer step) and a DDP wrapper made after ``watch()`` live in
# ``grad_fsdp.py``.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
import warnings
import weakref
from functools import partial
from typing import Any

import torch

from graphdeck.capture.callwrap import ids_key
from graphdeck.capture.grad_branch import skip_branch as _skip_branch
from graphdeck.capture.grad_fsdp import FsdpEvidence
from graphdeck.capture.grad_sites import (  # noqa: F401 - names of this module before the split
    GraphInfo,
    Read,
    _checkpoint_site,
    _nested,
    _task_id,
    _thread_site,
    compiled_autograd_active,
    compiled_autograd_coming,
    compiled_autograd_ran,
    format_frames,
    reach_of,
    task_accumulates,
    task_fills,
    user_frames,
    user_site,
)
from graphdeck.capture.grad_steady import SteadyCheck
from graphdeck.capture.grad_window import DEAD, LIVE, Window, zero_filled
from graphdeck.store.db import main_thread_section

PERSIST_EVERY_S = 30.0
PERSIST_FIRST = 8  # a row's first extensions are written at once (a job killed early loses no step)
STEADY_AFTER = 3  # identical backward passes before the hooks come off (NOTE: [Steady mode])


class GradEvidence(FsdpEvidence):
    """One rank's gradient evidence, written through ``agent.writer`` (``grad_steps`` rows)."""

    def __init__(self, agent: Any):
        self.agent = agent
        self._params: list[tuple[str, Any]] = []  # index -> (fqn, weak ref to the parameter)
        self._index: dict[int, int] = {}
        self._hooked: set[int] = set()  # trainable parameters known to the hooks
        self._handles: dict[int, Any] = {}  # idx -> hook handle (none in steady mode)
        self._steady = False  # NOTE: [Steady mode] (grad_steady.py)
        self._check: SteadyCheck | None = None  # the steady state, while steady mode lasts
        self._same = 0  # backward passes in a row with the same state
        self._fresh = False  # a compiled forward ran since the last window closed
        self._no_steady = False  # a backward without a forward of its own was seen: full mode for good
        self._fsdp: bool | None = None
        self._ca_steps = False  # read at each optimizer step (NOTE: [Evidence under compiled autograd])
        self._lock = threading.RLock()
        self._win: Window | None = None
        self._opt_steps = 0
        self._open_steps: list = []  # weak refs to the optimizers whose step runs now (NOTE: [Nested optimizer steps])
        self._fwd_gen = 0
        self._backwards = 0
        self._row: dict | None = None  # the row being extended
        self._backward_rows: list[int] = []  # rows numbered by backward before the first optimizer step
        self._last_persist = time.monotonic()
        self._failed = False
        self._fqn_cache: dict[tuple, tuple] = {}  # tensor ids -> (names, weak refs to up to 4 trainable leaves)
        self._reads: dict[tuple, Read] = {}  # (GraphInfo, names) -> its one Read
        self._calls: dict[GraphInfo, tuple] = {}  # graph -> (tensor ids, call) of its last grad-enabled call
        self._accum_by_task: dict[int, bool] = {}
        self._fills_by_task: dict[int, bool] = {}  # autograd task -> whether it accumulates (task_fills)
        self._opt_handle = self._pre_handle = None
        self._zero_seen: weakref.WeakSet = weakref.WeakSet()  # optimizers whose zero_grad is watched
        self._fsdp_params: list | None = None  # [(fqn, parameter)] live under FSDP2 (NOTE: [FSDP2 evidence])
        self._fsdp_sig: dict[str, tuple] = {}  # fqn -> (weak ref to .grad, its local version) at the last step
        self._fsdp_rows = 0
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._opt_handle = register_optimizer_step_post_hook(self._on_optimizer_step)
            self._pre_handle = register_optimizer_step_pre_hook(self._on_step_pre)
        except Exception:  # noqa: BLE001 - steps are then numbered by backward
            pass
        from graphdeck.capture.grad_prints import GradPrints

        # NOTE: [Gradient fingerprints] (grad_prints.py): at the optimizer-step hooks below
        self._prints = GradPrints.from_env(agent, self._params, getattr(agent, "grad_prints", None))
        atexit.register(self._at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ setup
    def add_model(self, model: torch.nn.Module) -> None:
        """Hook every trainable parameter of ``model`` (tied weights once, under their first name)."""
        self._set_steady(False)
        for fqn, p in self.agent.named_tensors(model):
            if id(p) in self._index:
                continue
            idx = len(self._params)
            self._index[id(p)] = idx
            self._params.append((fqn, weakref.ref(p)))
            if p.requires_grad and not self._ca_steps:  # NOTE: [Evidence under compiled autograd]
                self._hook(idx, p)
        self._fsdp_params = None  # read again at the next step (FSDP2, compiled autograd)

    def _hook(self, idx: int, p) -> None:
        """Hook parameter ``idx`` (``p``): a gradient hook on the tensor.

        # NOTE: [Hooks stay on the tensor]
        # The hook is a gradient hook on the leaf (``register_hook``: called with the gradient
        # each time its ``AccumulateGrad`` node runs, just before it accumulates; ``None`` when a
        # compiled backward returned no gradient for it), never one on the ``AccumulateGrad``
        # node: holding a leaf's accumulator holds the leaf, so a model watched before
        # ``fully_shard`` (FSDP2 swaps in sharded parameters) or a module replaced after
        # ``watch()`` would keep its old parameters alive through the step that peaks. The
        # tensor holds the hook, not the other way round
        # (``test_watching_keeps_no_replaced_parameter_alive``). Removing a hook leaves torch's
        # C++ hook on the tensor, called with an empty dict in every later backward (the GIL
        # taken per parameter: ~0.4-1 µs each on a CPU, more than a pass over every ``.grad``);
        # setting ``_backward_hooks`` to None, which torch's setter turns into clearing the
        # tensor's hooks, takes it off — done when no other Python hook is left on the tensor
        # (:meth:`_unhook`; a hook registered from C++ on a parameter would go with it).
        # ``torch.autograd.grad`` runs these hooks too, for the leaves it captures instead of
        # accumulating: a task whose accumulator the engine will not execute counts nothing
        # (:func:`~graphdeck.capture.grad_sites.task_fills`).
        """
        try:
            self._handles[idx] = p.register_hook(partial(self._on_grad, idx))
            self._hooked.add(idx)
        except Exception:  # noqa: BLE001 - a tensor that takes no hook stays unobserved
            pass

    def _unhook(self) -> None:
        """Every per-parameter hook off, and torch's hook with it where nothing else is hooked
        on the tensor (NOTE: [Hooks stay on the tensor])."""
        params = self._params
        for idx, h in self._handles.items():
            h.remove()
            p = params[idx][1]() if idx < len(params) else None
            try:
                if p is not None and p._backward_hooks is not None and not p._backward_hooks:
                    p._backward_hooks = None
            except Exception:  # noqa: BLE001 - a tensor type without the attribute keeps it
                pass
        self._handles.clear()

    def _set_steady(self, steady: bool, w: Window | None = None) -> None:
        """Enter steady mode from window ``w`` (hooks off), or leave it (hooks back on).
        NOTE: [Steady mode]."""
        if steady == self._steady:
            return
        self._steady = steady
        if steady:
            self._check = SteadyCheck.from_refs(self._params, w.counts, w.outputs, w.reads)
            self._unhook()
            return
        self._check = None
        for idx, (_fqn, ref) in enumerate(self._params):
            p = ref()
            if idx in self._hooked and p is not None and p.requires_grad:
                self._hook(idx, p)

    def _module_name(self, module) -> str | None:
        for model in self.agent._models:
            for name, m in model.named_modules():
                if m is module:
                    prefix = self.agent._prefixes.get(id(model), "")
                    return (prefix + name if name else prefix.rstrip(".")) or type(model).__name__
        return None

    @staticmethod
    def _at_exit(ref) -> None:
        self = ref()
        if self is not None:  # an uncaught exception leaves sys.last_value: the job died
            self.flush(closed=getattr(sys, "last_value", None) is None)

    # ------------------------------------------------------------------ run-time events
    def _on_optimizer_step(self, opt=None, *_a, **_k) -> None:
        if self._step_closed(opt):  # NOTE: [Nested optimizer steps]
            self._opt_steps += 1
            if self._prints is not None:
                self._prints.after_step(opt, self._opt_steps - 1)
            writer = self.agent._writer
            if writer is not None:  # the step's rows in the store when it returns (NOTE: [Writes off the compiling thread])
                writer.flush_if_behind()

    def _unseen_backward(self) -> None:
        """At an optimizer step in steady mode: a forward whose backward opened no window (it
        reached no watched graph) is judged now, from ``.grad`` alone (NOTE: [Steady mode])."""
        chk = self._check
        if chk is not None and chk.base is not None and self._win is None and not self._failed:
            with self._lock, main_thread_section():
                w = Window(self._opt_steps, self._fwd_gen)
                w.forced = True
                self._close(w)

    def _emit(self, step: int, source: str, state: dict, sites: dict) -> None:
        """Extend the current ``grad_steps`` row when ``state`` equals it, else write a new one."""
        key = json.dumps(state, sort_keys=True)
        row = self._row
        extend = row is not None and row["key"] == key and row["source"] == source and row["last"] == step - 1
        self._record(step, source, key, state, sites, extend)

    def _record(self, step: int, source: str, key: str, state: dict | None, sites: dict | None,
                extend: bool) -> int | None:
        """Move the current row's end to ``step`` (``extend``: written at once for its first
        extensions, then every ``PERSIST_EVERY_S``), or close it and write a new row of ``state``;
        returns the new row's id."""
        row = self._row
        if extend:
            row["last"], row["n"], row["dirty"] = step, row["n"] + 1, True
            if row["n"] <= PERSIST_FIRST or time.monotonic() - self._last_persist > PERSIST_EVERY_S:
                self._persist(row)
            return None
        if row is not None:
            self._persist(row, closed=True)
        rid = self.agent.writer.write_grad_step(step_first=step, step_last=step, n_backward=1, step_source=source,
                                                state={**state, "sites": sites})
        self._row = {"id": rid, "key": key, "first": step, "last": step, "n": 1, "source": source, "dirty": False}
        self._last_persist = time.monotonic()
        return rid

    def _window_for(self, t: int) -> Window:
        w = self._win
        if w is not None:
            if t in w.tasks or w.pending or (w.tasks and t < max(w.tasks)):
                return w
            if self._opt_steps == w.opt_at_open and self._fwd_gen == w.fwd_at_open:
                return w  # another nested task of the same backward
            self._close(w)
        w = self._win = Window(self._opt_steps, self._fwd_gen)
        return w

    def _join(self, w: Window, t: int) -> None:
        if t not in w.tasks:
            w.tasks.add(t)
            w.pending.add(t)
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._task_done, w, t))

    def _on_grad(self, idx: int, grad) -> None:
        """The gradient hook of parameter ``idx`` (NOTE: [Hooks stay on the tensor]); returns
        None: the gradient passes unchanged."""
        if grad is None or self._failed or compiled_autograd_active():
            return None  # None: a compiled backward gave this parameter no gradient
        try:
            t = _task_id()
            if task_fills(t, self._fills_by_task):
                self._count(idx, t)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            self._fail(exc)
        return None

    def _count(self, idx: int, t: int) -> None:
        """One accumulation into parameter ``idx``, in the window of autograd task ``t``."""
        try:
            with self._lock:
                w = self._window_for(t)
                n = w.counts.get(idx, 0) + 1
                w.counts[idx] = n
                if n == 2 and idx not in w.multi_sites:
                    w.multi_sites[idx] = _checkpoint_site(self._module_name)
                self._join(w, t)
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            self._fail(exc)

    def _task_done(self, w: Window, t: int) -> None:
        try:  # a SIGTERM meanwhile waits for the window's row (NOTE: [A SIGTERM during a dump])
            with self._lock, main_thread_section():
                w.pending.discard(t)
                if w.closed or w.pending or _nested():
                    return
                self._close(w)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def before_call(self, info: GraphInfo, key: bytes | None) -> bool:
        """Before a grad-enabled call of ``info`` on the parameters ``key`` (:func:`ids_key`): in
        steady mode, the baseline of the coming backward at the first call since the last one
        ended (NOTE: [Steady mode]), taken before the call, not after: the caller (Dynamo's
        guards, the runtime wrapper) has just read every parameter, so the pass finds them in the
        CPU's caches, not after a forward that evicted them. Returns whether :meth:`observe_call`
        will need the parameters themselves (False in steady mode for the call last seen: the
        caller can let them go while they are in cache)."""
        chk = self._check
        if chk is None:
            return True
        if chk.base is None and self._win is None and not self._failed:
            try:
                chk.snapshot()
            except Exception as exc:  # noqa: BLE001 - capture never breaks training
                self._fail(exc)
        cached = self._calls.get(info)
        return key is None or cached is None or cached[0] != key

    def observe_call(self, info: GraphInfo, out: Any, params: tuple, key: bytes | None = None) -> None:
        """After a grad-enabled call of a compiled graph (``params``: its arguments at
        ``info.positions``): put pre-hooks on its outputs' autograd nodes so the backward tells
        which outputs the loss used."""
        if not self._ca_steps and compiled_autograd_coming():
            self._to_steps()  # before the backward: no hook of ours in its graph
        if self._failed or self._fsdp or self._ca_steps:
            return
        try:
            chk = self._check
            if chk is not None:
                if info.single and chk.skip_single:
                    self._fwd_gen += 1
                    self._fresh = True
                    return  # not watched in steady mode (NOTE: [Steady mode])
            self._fwd_gen += 1
            self._fresh = True
            outs = out if isinstance(out, (list, tuple)) else [out]
            names = info.outputs
            groups: dict = {}
            for i, t in enumerate(outs):
                name = names[i] if i < len(names) else None
                if name and isinstance(t, torch.Tensor):
                    fn = t.grad_fn
                    if fn is not None:
                        groups.setdefault(fn, []).append((name, t.output_nr))
            if not groups:
                return
            if key is None:  # the binding's or the wrapper's, when it could pick the parameters
                key = ids_key(params)
            cached = self._calls.get(info) if chk is not None else None
            if cached is not None and cached[0] == key:
                call = cached[1]  # steady mode: the same graph on the same tensors, site as last seen
            else:
                fqns, leaves = self._fqns_leaves(info, key, params)
                read = self._reads.get((info, fqns))
                if read is None:
                    read = Read((info, fqns))
                    if len(self._reads) < 4096:
                        self._reads[(info, fqns)] = read
                call = (info, fqns, threading.get_ident(), user_frames(sys._getframe(1), depth=2), leaves, read)
                if len(self._calls) < 4096:
                    self._calls[info] = (key, call)
            for fn, items in groups.items():
                fn.register_prehook(partial(self._on_output_grads, call, items, id(fn)))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fqns_leaves(self, info: GraphInfo, key: tuple, params: tuple) -> tuple[tuple, tuple]:
        """(the watched names of ``params``, weak references to up to 4 of them that are
        trainable leaves, for :func:`task_accumulates`), cached per tuple of tensor ids."""
        live = bool(info.positions and self.agent._models)
        ckey = key if live else (info, key)  # the graph's own names when no model is watched
        got = self._fqn_cache.get(ckey)
        if got is not None:
            return got
        fqns = tuple(self.agent._live_name(t) for t in params) if live else info.static_fqns
        # Weak references: an accumulator node holds its parameter, and the capture holds none
        # (NOTE: [Hooks stay on the tensor]); the node is looked up in the backward that asks.
        leaves = [weakref.ref(t) for t in params if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf][:4]
        got = (fqns, tuple(leaves))
        if len(self._fqn_cache) < 4096:
            self._fqn_cache[ckey] = got
        return got

    def _on_output_grads(self, call: tuple, items: list, fid: int, grads) -> None:
        if compiled_autograd_active():
            return None
        try:
            info, fqns, thread, site, leaves, read = call
            with self._lock:
                t = _task_id()
                # torch.autograd.grad / backward(inputs=...) not reaching parameters (steady mode
                # tells at the window's end, from .grad: _close)
                if leaves and self._check is None and not task_accumulates(t, leaves, self._accum_by_task):
                    return None
                w = self._window_for(t)
                seen = w.outputs.setdefault(info.key, {})
                dead = False
                for name, nr in items:
                    live = nr < len(grads) and grads[nr] is not None
                    seen[name] = seen.get(name, 0) | (LIVE if live else DEAD)
                    if not live:
                        dead = True
                        w.dead.add((fid, nr))
                        if name not in w.output_names:
                            w.output_names.append(name)
                w.reads.setdefault(info.key, set()).add(read)
                if dead and w.output_site is None:  # formatted at close, only if it matters
                    w.output_site, w.thread = site, thread
                self._join(w, t)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        return None

    # ------------------------------------------------------------------ windows -> rows
    def _state(self, w: Window) -> tuple[dict, dict]:
        params = self._params
        counts = w.counts
        none, frozen, unobserved, multi = [], [], [], {}
        trainable = 0
        for idx, (fqn, ref) in enumerate(params):
            p = ref()
            if p is None or not p.requires_grad:
                if p is not None and idx in self._hooked:
                    frozen.append(fqn)
                continue
            trainable += 1
            if idx not in self._hooked:
                unobserved.append(fqn)
                self._hook(idx, p)
                continue
            n = counts.get(idx, 0)
            if n == 0 and self.agent._live_name(p) is None:
                unobserved.append(fqn)  # replaced in the model after watch(): its hook sees nothing
            elif n == 0:
                none.append(fqn)
            elif n > 1:
                multi[fqn] = n
        zero = zero_filled(w, self._params)
        state = {"trainable": trainable, "none": none, "zero": sorted(zero - set(none)), "multi": multi,
                 "frozen": frozen, "unobserved": unobserved}
        sites = {}
        if none or state["zero"]:  # the backward() caller: this thread (CPU), else the forward's thread
            sites["loss"] = user_site(sys._getframe(1)) or _thread_site(w.thread)
            row = self._row  # a state like the last row's extends it: its sites are not written again
            if row is None or row["key"] != json.dumps(state, sort_keys=True) \
                    or row["source"] != ("optimizer" if self._opt_steps > 0 else "backward"):
                bad = set(none)
                branch = _skip_branch(sys._getframe(1), w.dead, [r() for f, r in params if f in bad], w.output_site or ())
                if branch:  # NOTE: [The branch that skipped an output]
                    sites["branch"] = branch
        if state["zero"]:
            sites["skipped_outputs"] = w.output_names[:16]
            sites["output"] = format_frames(w.output_site)
        if multi:
            sites["multi"] = {params[i][0]: s for i, s in w.multi_sites.items() if s and params[i][0] in multi}
        return state, sites

    def _close(self, w: Window, partial_: bool = False) -> None:
        w.closed = True
        if self._win is w:
            self._win = None
        if not w.counts and not w.outputs and not w.forced:
            return
        if self._fsdp is None:
            self._fsdp = self._fsdp2()
            self._note_late_ddp()
        if self._fsdp or self._ca_steps:
            return  # read at each optimizer step instead (NOTE: [FSDP2 evidence])
        if self._prints is not None:
            self._prints.note_backward()
        chk = self._check
        if chk is not None:  # NOTE: [Steady mode]: what arrived, from .grad alone
            if compiled_autograd_ran():
                self._to_steps()
                return
            base = chk.base
            got, had_base = chk.received()
            if not partial_ and not w.forced and chk.nothing(got):
                chk.base = base  # a pass that filled no .grad (NOTE: [Backward passes that fill no .grad])
                return
        fresh, self._fresh = self._fresh, False
        by_opt = self._opt_steps > 0
        step = w.opt_at_open if by_opt else self._backwards
        source = "optimizer" if by_opt else "backward"
        self._backwards += 1
        if by_opt and self._backward_rows:
            self._renumber()
        row = self._row
        if chk is not None:
            fresh = had_base
            if fresh and not partial_ and row is not None and row["source"] == source \
                    and chk.same(got, w.outputs, w.reads):
                self._same += 1
                self._record(step, source, row["key"], None, None, True)  # the steady state again
                return
            w.counts = {i: 1 for i, x in enumerate(got) if x}
        if chk is not None:
            self._set_steady(False)  # a change (or no baseline): count accumulations again
        if not fresh:
            self._no_steady = True  # a backward without a forward of its own: no baseline, full mode
        state, sites = self._state(w)
        if partial_:  # the backward did not finish (it raised, or the job died in it)
            state["partial"] = True
        key = json.dumps(state, sort_keys=True)
        same = row is not None and row["key"] == key
        self._same = self._same + 1 if same else 0
        if same and not self._no_steady and self._same >= STEADY_AFTER and w.outputs and not state["multi"]:
            self._set_steady(True, w)
        extend = same and row["source"] == source
        rid = self._record(step, source, key, None if extend else state, None if extend else sites, extend)
        if rid is not None and source == "backward":
            self._backward_rows.append(rid)

    def _persist(self, row: dict, closed: bool = False) -> None:
        self.agent.writer.extend_grad_step(row["id"], step_last=row["last"], n_backward=row["n"],
                                           step_source=row["source"], closed=closed)
        row["dirty"] = False
        self._last_persist = time.monotonic()

    def _renumber(self) -> None:
        """Backward passes seen before the first optimizer step all belong to step 0."""
        from graphdeck.capture.writer_thread import resolve

        ids, self._backward_rows = self._backward_rows, []
        # on the writer thread, after the rows' own writes (NOTE: [Writes off the compiling thread])
        self.agent.writer.call(lambda w: w.grad_steps_at_step_zero([resolve(i) for i in ids]),
                               "the first step's gradient rows")
        if self._row is not None and self._row["id"] in ids:
            self._row.update(first=0, last=0, source="optimizer")

    def flush(self, closed: bool = False) -> None:
        """Close a window left open (a backward that ended inside nested tasks only) and persist
        the current row's extent. Never raises."""
        try:
            if not self._failed and not self._ca_steps and compiled_autograd_ran():
                self._to_steps()
            with self._lock:
                if self._win is not None:
                    w = self._win
                    self._close(w, partial_=bool(w.pending))
                if self._fsdp is None and self.agent._models and self._fsdp2():
                    self._fsdp = True
                if (self._fsdp or self._ca_steps) and not self._failed:  # a backward after the last step
                    self._fsdp_step(self._opt_steps, at_exit=True, partial_=not closed)
                if self._row is not None:
                    self._persist(self._row, closed=closed)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        if self._prints is not None:
            self._prints.flush()

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            self._failed = True
            warnings.warn(f"graphdeck: gradient evidence stopped: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.flush(closed=True)
        self._unhook()
        for name in ("_opt_handle", "_pre_handle"):
            h = getattr(self, name)
            if h is not None:
                h.remove()
                setattr(self, name, None)

