"""The capture reads symbolic shapes without deciding anything about them.

# NOTE: [The capture adds no guard]
# Dynamo hands the backend a graph whose sizes may be symbolic (``SymInt``: automatic dynamic
# after a recompile, ``mark_dynamic``, ``dynamic=True``). Any Python decision on a symbolic size
# — ``int(s)``, ``s == 4``, ``if s:`` — asks the graph's ``ShapeEnv`` to *guard* on it, and a
# guard on ``Eq(s0, 4)`` specialises the size: the compiled code is then valid for 4 only, the
# next length recompiles, and after ``torch._dynamo.config.recompile_limit`` compiles the frame
# falls back to eager. Everything Dynamo installs is taken from the ``ShapeEnv`` after the
# backend returns, so work the capture does inside the backend call (recording the Dynamo graph,
# the shadow AOT trace, writing the AOT graphs, the lazily compiled backward) would change what
# torch decides. Two defences:
#   1. readers never force a symbolic value (:func:`dim_value` gives an ``int`` only when the
#      size is already a constant, else the symbolic expression as text);
#   2. all of the capture's compile-time work runs under :func:`no_new_guards`, the ShapeEnv's
#      own ``suppress_guards()``: no guard, no replacement, no refined range is recorded, so a
#      reader we missed still cannot specialise (tests/test_capture_matrix.py pins the
#      number of compiles, guards, dynamic dimensions and recompile reasons per frame).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


def dim_value(d: Any) -> int | str:
    """A size or stride read without a guard: the ``int`` when ``d`` is an int or a constant
    ``SymInt``, else its symbolic expression as text (e.g. ``"s77"``, ``"2*s77"``)."""
    if isinstance(d, int):
        return d
    node = getattr(d, "node", None)
    if node is not None:
        try:
            v = node.maybe_as_int()  # a constant SymInt: no guard
        except Exception:  # noqa: BLE001 - an unknown SymNode layout: the text is safe
            v = None
        return int(v) if v is not None else str(d)
    try:
        return int(d)  # a plain number type (numpy, torch.Size entry)
    except Exception:  # noqa: BLE001
        return str(d)


def shape_env_of(example_inputs: Any = None):
    """The ``ShapeEnv`` of the compile in progress (the tracing context's fake mode, else the
    fake mode of ``example_inputs``), or ``None`` when there is none (eager, static shapes)."""
    try:
        from torch._guards import TracingContext, detect_fake_mode

        ctx = TracingContext.try_get()
        mode = getattr(ctx, "fake_mode", None) if ctx is not None else None
        if mode is None and example_inputs is not None:
            mode = detect_fake_mode(example_inputs)
        return getattr(mode, "shape_env", None)
    except Exception:  # noqa: BLE001 - capture never breaks the compile
        return None


@contextlib.contextmanager
def no_new_guards(shape_env=None, example_inputs: Any = None) -> Iterator[Any]:
    """Run the block with ``shape_env`` (or the current compile's) recording no guard
    (NOTE: [The capture adds no guard]); yields the ShapeEnv, ``None`` when there is none."""
    env = shape_env if shape_env is not None else shape_env_of(example_inputs)
    if env is None or not hasattr(env, "suppress_guards"):
        yield env
        return
    with env.suppress_guards():
        yield env
