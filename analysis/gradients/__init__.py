"""Gradient-path checks: does every trainable parameter get a gradient, on every rank and step
(``graphdeck check-grads``, the grads page).

Modules:

* ``core`` (the former ``gradients`` module): Gradient-path validation: does every trainable
  parameter get a gradient, on every rank?
* ``collectives``: Collectives inside captured graphs: is every collective waited on, and does
  every gradient of a backward graph that reduces gradients in-graph (compiled…
* ``compiles``: Per-compile gradient state of each parameter: was it trainable in the compile
  that ran?
* ``cuts``: Cut-point search on a forward data-flow graph: where does gradient flow from a
  parameter stop?
* ``eager``: Eager mode: run a module on an example batch, walk autograd back from the loss,
  and explain every parameter that the walk does not reach from the ops…
* ``evidence``: Run-time gradient evidence in the gradient report: per step and rank, what
  arrived.
* ``flags``: Graph-only flags: patterns in a captured Dynamo graph that silently change
  gradients, seen from the graph alone (no run-time facts needed).
* ``graph``: Graph mode: the gradient-path report of a captured (or imported) run, from the
  store alone.
* ``inputs``: Command-line specs for eager mode: ``module:attr`` references and example-input
  specs.
* ``mesh``: Gradient findings in the words of the job's parallel wrapper: FSDP2 groups,
  tensor-parallel placements, pipeline stages (issue 20, item 3).
* ``nodes``: Node-level gradient check: every differentiable output of a forward graph either
  reaches the loss through the backward graph or is reported as a dangling…
* ``numeric``: Numeric mode: eager vs compiled gradients of one step, run in the caller's
  context.
* ``parity``: Reference parity: one optimizer step of a sharded run against its unsharded
  reference (``graphdeck parity``); ``parity_text`` renders its report.
* ``replicas``: Replica agreement: ranks that must hold the same value hold it
  (``REPLICA_DIVERGENCE`` from the capture's gradient fingerprints; DDP replicas).
* ``replicas_tp``: Replica agreement across tensor-parallel peers of a Replicate parameter.
* ``report``: The gradient-path report: one object for graph mode (from the store) and eager
  mode (from a live module), with text, JSON and JUnit XML renderings.

Public modules (import paths users may rely on): this package's names below, ``core``
(``validate_backward``) and ``report`` (``GradReport``, ``combine``); ``grad_report`` is the deprecated
old path of ``report``. The other modules are internal.

The public names below are what the rest of graphdeck imports from these modules; each is
loaded on first use (PEP 562), so importing one module of the package imports no other:
``from graphdeck.analysis.gradients import GradReport``.
"""

from __future__ import annotations

from graphdeck.analysis import lazy_exports

#: Public name → the module of this package that defines it.
_PUBLIC = {
    "GradReport": "report",
    "STATUSES": "report",
    "caller_context": "numeric",
    "combine": "report",
    "context_options": "numeric",
    "gradient_report": "core",
    "load_ref": "inputs",
    "parse_inputs": "inputs",
    "validate_backward": "core",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
