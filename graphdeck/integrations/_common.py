"""What the framework callbacks share: the profiled steps, and the backend a compile asked for."""

from __future__ import annotations

from typing import Any

from graphdeck.errors import UsageError


def profile_window(steps: str | tuple[int, int] | None) -> dict | None:
    """``"A:B"`` (or ``(A, B)``): profile the training steps A..B, both included, numbered from 0
    as ``check-grads`` numbers them (the optimizer steps of this process: a Trainer's
    ``global_step`` k ends step k-1). Returns :meth:`Agent.profile`'s ``wait_steps``,
    ``warmup_steps`` and ``active_steps`` (one warm-up step before A when A > 0), or None for
    ``None`` (no profile).

    Raises:
        UsageError: not ``A:B`` with 0 <= A <= B."""
    if steps is None:
        return None
    try:
        first, last = (int(x) for x in (steps.split(":") if isinstance(steps, str) else steps))
    except (TypeError, ValueError):
        raise UsageError(f"profile steps {steps!r}: expected 'A:B' (first and last step, from 0)") from None
    if not 0 <= first <= last:
        raise UsageError(f"profile steps {steps!r}: expected 0 <= A <= B")
    return {"wait_steps": max(first - 1, 0), "warmup_steps": min(first, 1), "active_steps": last - first + 1}


def inner_backend(compile_wrapper: Any) -> Any | None:
    """The backend a ``torch.compile`` was asked for, from its Dynamo context's callback (an
    ``OptimizedModule.dynamo_ctx.callback``): a registered name such as ``"aot_eager"`` or
    ``"inductor"``; Inductor's own wrapper when a ``mode`` or ``options`` configured it (so they
    still apply); the callable itself for a custom backend. None when the compile already goes
    through graphdeck (``backend="graphdeck"`` or an agent's backend) or nothing is found."""
    seen, x = 0, compile_wrapper
    while x is not None and seen < 16:  # CatchErrorsWrapper -> ConvertFrame -> WrapBackendDebug -> wrapper
        name = getattr(x, "compiler_name", None)
        if isinstance(name, str):
            fn = getattr(x, "compiler_fn", None)
            if name.startswith("graphdeck") or getattr(fn, "__name__", "").startswith("graphdeck"):
                return None
            if name == "inductor":  # mode/options: Inductor's configured wrapper compiles
                return x if getattr(x, "config", None) else name
            return name if fn is None or _registered(name) is fn else fn  # a callable: itself
        if getattr(x, "__name__", "").startswith("graphdeck"):
            return None
        nxt = getattr(x, "_torchdynamo_orig_backend", None)
        if nxt is None:
            return x if callable(x) and seen else None
        x, seen = nxt, seen + 1
    return None


def _registered(name: str) -> Any | None:
    """The backend registered under ``name``, or None."""
    try:
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(name)
    except Exception:  # noqa: BLE001 - not a registered name
        return None
