"""graphdeck.analysis: the checks and analyses, grouped by concern in packages; module names do not
repeat the package's (``gradients/eager.py``, not ``gradients/grad_eager.py``).

* ``gradients`` — gradient paths (``check-grads``), replica agreement, reference parity.
* ``ranks`` — cross-rank checks (``check-ranks``): graphs, collectives, Flight Recorder, hangs.
* ``traces`` — profiler traces on graph nodes, trace analyses, collectives in traces, export.
* ``memory`` — graph-derived memory, what-ifs, measured memory.
* ``compilation`` — compile health (``check-compile``) and the compile index.
* ``diff`` — run diff (``diff-runs``).
* ``graphs`` — one stored graph as a model to draw (the graph view) and to compare (graph diff).
* ``parallel`` — the parallel layout, graph regions and per-node overlays.
* ``summary`` (a module) — the run overview: the one place that combines the checks.

``gradients``, ``traces``, ``ranks`` and ``memory`` re-export their public names lazily
(:func:`lazy_exports`). Public import paths (named in docs/ or used by the notebook API,
``graphdeck/notebook.py``); everything else may move between releases:

* ``graphdeck.analysis.gradients`` (its re-exported names), ``graphdeck.analysis.gradients.core``
  (``validate_backward``, also ``graphdeck.validate_backward``), ``graphdeck.analysis.gradients.report``
  (``GradReport``, ``combine``);
* ``graphdeck.analysis.ranks.core`` (``rank_report``);
* ``graphdeck.analysis.traces.mapping`` (``node_time_ns``);
* ``graphdeck.analysis.memory.core`` (``read_memory_timeline_raw``).

Old paths of public modules renamed in issue 37 stay importable as deprecated aliases:
``gradients.grad_report`` → ``gradients.report``, ``traces.trace_map`` → ``traces.mapping``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, public: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` (PEP 562): each name of ``public`` (name → the
    package's module that defines it) is imported from that module on first use, so importing the
    package loads none of them. Raises ``AttributeError`` for any other name."""

    def __getattr__(name: str):
        if name in public:
            return getattr(importlib.import_module(f"{package}.{public[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
