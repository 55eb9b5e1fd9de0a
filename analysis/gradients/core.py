"""Gradient-path validation: does every trainable parameter get a gradient, on every rank?

Two modes, one report (:class:`~graphdeck.analysis.gradients.report.GradReport`):

* **graph mode** — ``validate_backward(store, run)`` or :func:`gradient_report` on an open
  session: from the captured (or imported) forward/backward graphs, see ``graph``.
* **eager mode** — ``validate_backward(model, example_inputs, loss_fn)``: run the module once,
  walk autograd from the loss, record ops to find the cut, see ``eager``.

Example (eager mode; the module's own ``detach`` is the cut)::

    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.a = torch.nn.Linear(4, 4); self.b = torch.nn.Linear(4, 1)
    ...     def forward(self, x):
    ...         return self.b(self.a(x).detach())
    >>> rep = validate_backward(M(), (torch.randn(2, 4),), lambda out: out.sum())
    >>> [(r.fqn, r.status, r.cut and r.cut.kind) for r in rep]
    [('a.weight', 'NO_GRAD', 'detach'), ('a.bias', 'NO_GRAD', 'detach'), ('b.weight', 'OK', None), ('b.bias', 'OK', None)]
    >>> rep.ok
    False

The graph-mode path never imports torch (the server calls it).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.report import FAILING, STATUSES, Cut, Finding, GradReport, ParamRow
from graphdeck.store.schema import Run

__all__ = ["FAILING", "STATUSES", "Cut", "Finding", "GradReport", "ParamRow", "gradient_report",
           "validate_backward"]


def gradient_report(session: Session, run: Run, *, include_buffers: bool = False,
                    allow: tuple[str, ...] | list[str] = (), expected_params: list[str] | None = None) -> GradReport:
    """Graph-mode report of ``run`` read through ``session`` (see ``graph.graph_report``);
    ``expected_params``: parameter names every rank should have (for runs whose store lacks the
    parameter list, such as imported TORCH_TRACE logs: a name no graph reads is NOT_IN_GRAPH)."""
    from graphdeck.analysis.gradients.graph import graph_report

    return graph_report(session, run, include_buffers=include_buffers,
                        expected_params=expected_params).apply_allow(list(allow))


def validate_backward(model_or_store: Any, example_inputs_or_run: Any = None, loss_fn: Callable | None = None, *,
                      allow: tuple[str, ...] | list[str] = (), numeric: bool = False, backend: str = "aot_eager",
                      include_buffers: bool = False, rank: int | None = None,
                      expected_params: list[str] | None = None, autocast_dtype: str | None = None,
                      autocast_device: str | None = None, grad_enabled: bool = True) -> GradReport:
    """Validate gradient paths.

    ``validate_backward(model, example_inputs, loss_fn)``: eager mode on an ``nn.Module`` (DDP
    wrapped or not); ``example_inputs`` a tuple of positional args, a dict of keyword args or one
    tensor; ``loss_fn(output) -> scalar`` (default ``output.loss`` or the first output's sum).
    ``numeric=True`` also compares eager and ``torch.compile(backend=backend)`` gradients of the
    parameters and of the inputs that require grad, both run in the caller's context: forward and
    loss under ``torch.autocast(autocast_device, dtype=autocast_dtype)`` (e.g. ``"bfloat16"``;
    ``None``: no autocast; device default: the inputs') with grad mode ``grad_enabled``, backward
    outside autocast; a ``GRAD_MISMATCH`` finding names the backward node to blame.

    ``validate_backward(store, run)``: graph mode over a store (SQLite path, URL or SQLAlchemy
    engine) and a run name or id.

    ``allow``: ``fnmatch`` patterns of parameters unused on purpose (listed, not failing).
    ``expected_params`` (graph mode): parameter names each rank should have, for stores without
    the parameter list (imported logs).

    Raises:
        NotFoundError: the store or the run does not exist (graph mode).
        UsageError: neither a module nor a store was given.
        TypeError: ``loss_fn`` returned something that is not a differentiable tensor (eager mode).
        UsageError: ``autocast_dtype`` is not a floating dtype name.
    """
    from graphdeck.errors import UsageError

    if _is_store(model_or_store):
        if example_inputs_or_run is None:
            raise UsageError("validate_backward(store, run): the run name or id is missing")
        from sqlalchemy.engine import Engine

        from graphdeck.store.db import open_engine

        engine = model_or_store if isinstance(model_or_store, Engine) else open_engine(model_or_store, read_only=True)
        with Session(engine) as s:
            run = find_run(s, example_inputs_or_run)
            return gradient_report(s, run, include_buffers=include_buffers, allow=allow,
                                   expected_params=expected_params)
    if hasattr(model_or_store, "named_parameters") and callable(model_or_store):
        from graphdeck.analysis.gradients.eager import eager_report

        return eager_report(model_or_store, example_inputs_or_run, loss_fn, numeric=numeric, backend=backend,
                            rank=rank, include_buffers=include_buffers, autocast_dtype=autocast_dtype,
                            autocast_device=autocast_device, grad_enabled=grad_enabled).apply_allow(list(allow))
    raise UsageError(f"validate_backward: expected an nn.Module or a store, got {type(model_or_store).__name__}")


def find_run(session: Session, run: str | int) -> Run:
    """The run with id ``run`` (all digits) or name ``run``; raises :class:`NotFoundError`."""
    from sqlalchemy import select

    from graphdeck.errors import NotFoundError

    text = str(run)
    found = session.get(Run, int(text)) if text.isdigit() else None
    if found is None:
        found = session.scalar(select(Run).where(Run.name == text))
    if found is None:
        raise NotFoundError(f"run {text!r} not found", resource="run", id=text)
    return found


def _is_store(obj: Any) -> bool:
    if isinstance(obj, (str, os.PathLike)):
        return True
    return type(obj).__name__ == "Engine" and hasattr(obj, "url")
