"""The agent of ``graphdeck run`` (graphdeck/cli_run.py): installed at interpreter start-up by the
``sitecustomize`` the command puts first on ``PYTHONPATH``, configured from the environment.

    GRAPHDECK_RUN_STORE          SQLite path or SQLAlchemy URL (its presence turns this on)
    GRAPHDECK_RUN_NAME           the run's name, the same on every rank
    GRAPHDECK_RUN_PROFILE_STEPS  "A:B": profile optimizer steps A..B-1 (0-based, A >= 1); "" none
    GRAPHDECK_RUN_EVIDENCE       "0": no gradient evidence

# NOTE: [Capture without code]
# :func:`install` imports nothing of torch: it puts an import hook on ``sys.meta_path`` that,
# when torch's own modules finish loading, wraps a few of their functions (``_HOOKS``). The
# process gets an agent (the process-wide one of ``backend="graphdeck"``, ``default_agent()``)
# only when the program does one of: compile (Dynamo's backend lookup), ``init_process_group``,
# ``DistributedDataParallel(...)``, ``fully_shard``, ``parallelize_module``, a ``PipelineStage``.
# A launcher (torchrun's parent) imports torch.distributed but does none of these: it never
# registers as a rank. Then:
#   * every backend Dynamo looks up (a name, ``torch.compile``'s wrappers, a custom callable) is
#     wrapped so that its graphs go through ``Agent._compile`` with that backend as the inner one,
#     exactly as ``agent.backend(inner)`` would (the agent's own backends are left alone);
#   * the modules compiled, DDP-wrapped, fully_shard'ed, parallelize_module'd or made a pipeline
#     stage are candidates; when Dynamo hands the first graph to the backend (before any of its
#     compiles) and at the first optimizer step, the outermost candidates (none inside another)
#     are watched: a sub-module sharded before its parent, or compiled on its own before the
#     model is wrapped in DDP (regional compilation), is named as the parent names it; a DDP
#     wrapper (torch's class or a framework's subclass, ``compile_context.is_ddp``) stands for
#     the model it wraps;
#   * the optimizers' global step hooks count steps (the first optimizer that steps is the clock)
#     and open/step the profiler window of GRAPHDECK_RUN_PROFILE_STEPS (``Agent.profile``);
#   * Flight Recorder is on (``graphdeck run`` sets ``TORCH_FR_BUFFER_SIZE`` for the command, so
#     before any process group); ``destroy_process_group`` first writes the layout and the process
#     groups; at exit ``Agent.close()`` runs unless an uncaught exception ended the program (then
#     the agent's own exit flush, as for any job that dies). Signals and crashes: the Agent's.
# Every wrapper calls the real function first or last and swallows its own errors: what the job
# computes is what it computes without ``graphdeck run``.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading
import warnings

ENV_STORE, ENV_NAME = "GRAPHDECK_RUN_STORE", "GRAPHDECK_RUN_NAME"
ENV_PROFILE, ENV_EVIDENCE = "GRAPHDECK_RUN_PROFILE_STEPS", "GRAPHDECK_RUN_EVIDENCE"

_state: dict = {"agent": None, "failed": False, "candidates": [], "watched": [], "step": 0, "clock": None,
                "prof": None, "installed": False}
_lock = threading.RLock()


def _warn(what: str, exc: BaseException) -> None:
    warnings.warn(f"graphdeck run: {what}: {type(exc).__name__}: {exc}; training is not affected", stacklevel=3)


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> ``(A, B)``, the optimizer steps A..B-1 (0-based) to profile; "" / None -> None.

    Raises:
        ValueError: not two integers with ``1 <= A < B`` (step 0 ends before the first step hook
        runs, so it cannot be profiled)."""
    if not text:
        return None
    a, sep, b = text.partition(":")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        raise ValueError(f"profile steps {text!r}: expected A:B, two integers") from None
    if not sep or not 1 <= lo < hi:
        raise ValueError(f"profile steps {text!r}: expected A:B with 1 <= A < B (0-based optimizer steps)")
    return lo, hi


# ----------------------------------------------------------------------------- the agent
def agent():
    """This process's agent (``default_agent()``), made on first call with the run's settings and
    the step hooks; None when it cannot be made (warned once)."""
    with _lock:
        if _state["agent"] is not None or _state["failed"]:
            return _state["agent"]
        try:
            from graphdeck.capture.backend import default_agent

            a = default_agent()
            import atexit

            import torch.optim.optimizer as optim

            _state["hooks"] = (optim.register_optimizer_step_pre_hook(_before_step),
                               optim.register_optimizer_step_post_hook(_after_step))
            atexit.register(_close_at_exit)
            _state["agent"] = a
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            _state["failed"] = True
            _warn("no capture in this process", exc)
        return _state["agent"]


def note(module) -> None:
    """Make ``module`` a candidate for :meth:`Agent.watch` (NOTE: [Capture without code])."""
    try:
        import torch

        if isinstance(module, torch.nn.Module) and not any(m is module for m in _state["candidates"]):
            _state["candidates"].append(module)
    except Exception as exc:  # noqa: BLE001
        _warn("could not note a module", exc)


def settle() -> None:
    """Watch the outermost candidates not watched yet."""
    a = agent()
    if a is None or not _state["candidates"]:
        return
    try:
        from graphdeck.capture.compile_context import is_ddp

        cands = [getattr(m, "module", m) if is_ddp(m) else m for m in _state["candidates"]]
        inside = {id(sub) for m in cands for sub in m.modules() if sub is not m}
        for m, inner in zip(list(_state["candidates"]), cands):
            if id(inner) in inside or any(w is inner for w in _state["watched"]):
                continue
            if any(id(w) in {id(s) for s in inner.modules()} for w in _state["watched"]):
                continue  # an ancestor of a module already watched: its parameters are named already
            _state["watched"].append(inner)
            a.watch(m)
    except Exception as exc:  # noqa: BLE001
        _warn("could not watch a model", exc)


def _before_step(opt, args, kwargs) -> None:
    if _state["clock"] is None:
        settle()


def _after_step(opt, args, kwargs) -> None:
    if _state["clock"] is None:
        _state["clock"] = id(opt)
    if _state["clock"] != id(opt):
        return
    _state["step"] += 1  # steps done
    try:
        _profile_tick(_state["step"])
    except Exception as exc:  # noqa: BLE001
        _warn("the profile", exc)


def _profile_tick(done: int) -> None:
    window = parse_steps(os.environ.get(ENV_PROFILE))
    if window is None:
        return
    lo, hi = window
    warmup = 1 if lo >= 2 else 0  # step lo-1 warms the profiler up; step 0 ends before any hook
    prof = _state["prof"]
    if prof is None and done == lo - warmup:  # the next step is the first of the window
        prof = _state["agent"].profile(wait_steps=done, warmup_steps=warmup, active_steps=hi - lo)
        try:  # numbered as if entered before step 0 (ProfilerStep#N is global step N, as with Agent.profile)
            prof.step_num = done
            prof.current_action = prof._prev_schedule_action = prof.schedule(done)
        except Exception:  # noqa: BLE001 - another torch: the profiler's own numbering from 0
            prof = _state["agent"].profile(wait_steps=0, warmup_steps=warmup, active_steps=hi - lo)
        prof.__enter__()
        _state["prof"], _state["prof_left"] = prof, warmup + (hi - lo)
        return
    if prof is not None and _state.get("prof_left", 0) > 0:
        prof.step()
        _state["prof_left"] -= 1
        if _state["prof_left"] == 0:  # the window's trace was stored by that step()
            prof.__exit__(None, None, None)


def _close_at_exit() -> None:
    a = _state["agent"]
    if a is None or getattr(sys, "last_value", None) is not None:
        return  # an uncaught exception: the agent's own exit flush (closed=False) writes what there is
    prof = _state["prof"]
    if prof is not None and _state.get("prof_left", 0) > 0:
        try:
            prof.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            pass
    a.close()


# ----------------------------------------------------------------------------- wrappers
def _after(fn, then):
    """``fn`` that, once it returned, calls ``then(result, *args, **kwargs)`` (errors swallowed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        try:
            then(out, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            _warn(f"after {getattr(fn, '__name__', fn)}", exc)
        return out
    wrapper.__graphdeck_wrapped__ = fn
    return wrapper


def _is_agent_backend(fn) -> bool:
    while fn is not None:
        if getattr(fn, "__module__", "").startswith("graphdeck.capture") or hasattr(fn, "__graphdeck_captured__"):
            return True
        fn = getattr(fn, "compiler_fn", None)
    return False


_COPIED = ("compiler_name", "get_compiler_config", "reset", "backend_ctx_ctor", "_export")


def _captured_backend(real, inner, extra: dict):
    """A Dynamo backend whose graphs go through the agent with ``inner`` as the compiler, as
    ``agent.backend(inner)`` does; the real backend's attributes that Dynamo reads are copied."""

    def graphdeck_run_backend(gm, example_inputs, **kwargs):
        a = agent()
        if a is None:
            return real(gm, example_inputs, **kwargs)
        settle()
        if inner == "inductor":  # kernel -> FX node links, as Agent.backend("inductor") turns on
            try:
                from graphdeck.capture.profile import enable_cpu_kernel_profile
                from graphdeck.capture.provenance import enable_provenance

                enable_provenance()
                enable_cpu_kernel_profile()
            except Exception as exc:  # noqa: BLE001
                _warn("no kernel links", exc)
        return a._compile(gm, example_inputs, inner, **extra, **kwargs)

    for name in _COPIED:
        if hasattr(real, name):
            setattr(graphdeck_run_backend, name, getattr(real, name))
    graphdeck_run_backend.__name__ = getattr(real, "__name__", None) or getattr(real, "compiler_name", "custom")
    graphdeck_run_backend.__graphdeck_captured__ = real
    graphdeck_run_backend.graphdeck_inner, graphdeck_run_backend.graphdeck_extra = inner, extra
    return graphdeck_run_backend


_CAPTURED: dict[int, tuple] = {}  # id(real backend) -> (real, _Captured): one wrapper per backend


def captured(arg, real):
    """The backend Dynamo gets for ``arg`` (what the code named) resolved to ``real``."""
    if _is_agent_backend(real):
        return real
    hit = _CAPTURED.get(id(real))
    if hit is not None and hit[0] is real:
        return hit[1]
    kind = type(real).__name__
    inner, extra = real, {}
    if isinstance(arg, str) and arg in ("inductor", "aot_eager"):
        inner = arg
    elif kind == "_TorchCompileInductorWrapper":
        inner = "inductor"
        if real.config:
            extra["config_patches"] = dict(real.config)
        if getattr(real, "name", None) is not None:
            extra["compile_region_name"] = real.name
    elif kind == "_TorchCompileWrapper" and real.compiler_name in ("inductor", "aot_eager") and not real.kwargs:
        inner = real.compiler_name
    wrapped = _captured_backend(real, inner, extra)
    _CAPTURED[id(real)] = (real, wrapped)
    return wrapped


def _patch_torch(mod) -> None:
    real = mod.compile

    @functools.wraps(real)
    def compile(model=None, *args, **kwargs):  # noqa: A001 - torch.compile's name
        try:
            target = model if isinstance(model, mod.nn.Module) else getattr(model, "__self__", None)
            if isinstance(target, mod.nn.Module):
                if agent() is not None:
                    note(target)  # watched at its first graph: a wrapper made after this compile is known then
        except Exception as exc:  # noqa: BLE001
            _warn("torch.compile", exc)
        return real(model, *args, **kwargs)

    compile.__graphdeck_wrapped__ = real
    mod.compile = compile


def _patch_eval_frame(mod) -> None:
    real = mod.lookup_backend

    @functools.wraps(real)
    def lookup_backend(compiler_fn):
        fn = real(compiler_fn)
        try:
            return captured(compiler_fn, fn)
        except Exception as exc:  # noqa: BLE001
            _warn("backend not captured", exc)
            return fn

    mod.lookup_backend = lookup_backend


def _patch_c10d(mod) -> None:
    mod.init_process_group = _after(mod.init_process_group, lambda *_a, **_k: agent())
    real_destroy = mod.destroy_process_group

    @functools.wraps(real_destroy)
    def destroy_process_group(*args, **kwargs):
        a = _state["agent"]
        if a is not None and (not args or args[0] is None) and kwargs.get("group") is None:
            try:  # what close() writes that needs the process groups, while they exist
                from graphdeck.capture.process_groups import write_record

                a.flush_events()
                a.record_layout()
                write_record(a.writer)
            except Exception as exc:  # noqa: BLE001
                _warn("process groups not recorded", exc)
        return real_destroy(*args, **kwargs)

    mod.destroy_process_group = destroy_process_group


def _patch_ddp(mod) -> None:
    cls = mod.DistributedDataParallel
    # watched at once: DDP wraps a built model, and an eager job's first backward (step 0) comes
    # before the first optimizer step, where settle() would otherwise run (issue 40 item 5)
    cls.__init__ = _after(cls.__init__, lambda _out, self, *a, **k: (agent(), note(self), settle()))


def _patch_fully_shard(mod) -> None:
    mod.fully_shard = _after(mod.fully_shard, lambda out, module, *a, **k: (agent(), note(out)))


def _patch_parallelize(mod) -> None:
    mod.parallelize_module = _after(mod.parallelize_module, lambda out, module, *a, **k: (agent(), note(out)))


def _patch_pipeline(mod) -> None:
    def noted(_out, stage, *a, **k):
        ag = agent()
        note(getattr(stage, "submod", None))
        if ag is not None:
            ag.watch_pipeline(stage)

    for name in ("PipelineStage", "_PipelineStage"):
        cls = getattr(mod, name, None)
        if cls is not None and "__init__" in cls.__dict__:
            cls.__init__ = _after(cls.__init__, noted)


#: module -> what to patch once it has loaded (NOTE: [Capture without code]).
_HOOKS = {
    "torch": _patch_torch,
    "torch._dynamo.eval_frame": _patch_eval_frame,
    "torch.distributed.distributed_c10d": _patch_c10d,
    "torch.nn.parallel.distributed": _patch_ddp,
    "torch.distributed.fsdp._fully_shard._fully_shard": _patch_fully_shard,
    "torch.distributed.tensor.parallel.api": _patch_parallelize,
    "torch.distributed.pipelining.stage": _patch_pipeline,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, real, patch):
        self._real, self._patch = real, patch

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        try:
            self._patch(module)
        except Exception as exc:  # noqa: BLE001 - an unknown torch layout: that part is not captured
            _warn(f"{module.__name__} not hooked", exc)

    def __getattr__(self, name):  # get_source, get_resource_reader, ... of the real loader
        return getattr(self.__dict__["_real"], name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for the modules of ``_HOOKS`` it asks the other finders and wraps
    the loader so the module is patched once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, _HOOKS[name])
                return spec
        return None


def install() -> bool:
    """Put the import hook in place (once; torch not imported). Returns whether it is on."""
    if _state["installed"] or not os.environ.get(ENV_STORE):
        return _state["installed"]
    os.environ["GRAPHDECK_STORE"] = os.environ[ENV_STORE]
    if os.environ.get(ENV_NAME):
        os.environ["GRAPHDECK_RUN"] = os.environ[ENV_NAME]
    if os.environ.get(ENV_EVIDENCE) == "0":
        os.environ["GRAPHDECK_GRAD_EVIDENCE"] = "0"
    sys.meta_path.insert(0, _Finder())
    _state["installed"] = True
    return True


__all__ = ["ENV_EVIDENCE", "ENV_NAME", "ENV_PROFILE", "ENV_STORE", "agent", "captured", "install", "note",
           "parse_steps", "settle"]
