"""Memory: graph-derived liveness and what-ifs, measured series from traces and CUDA snapshots.

Modules:

* ``core`` (the former ``memory`` module): Memory from the graph: tensor lifetimes, the running live
  total, the peak and who holds it.
* ``estimates``: What-if estimates over a training step's graph-derived memory (split from
  :mod:`graphdeck.analysis.memory.core`, which re-exports them): activation…
* ``inductor``: Graph-derived memory of an Inductor run, from the buffers its generated code
  allocates and frees.
* ``measured``: Measured memory: a CUDA memory snapshot replayed, its peak, and the bytes at
  the peak put on the graph nodes whose generated code allocated them.
* ``snapshots``: CUDA memory snapshot pickles given to ``graphdeck import``: recognised
  by content, replayed (:mod:`graphdeck.analysis.memory.measured`), attributed…
* ``step``: One training step's graph-derived memory: a forward graph chained with its
  backward graph (:func:`step_memory`), the pair found from either…
* ``profiler``: Measured memory from profiler output (split from
  :mod:`graphdeck.analysis.memory.core`, which re-exports it): a Kineto trace's ``[memory]`` events
  and…

Public modules (import paths users may rely on): this package's names below and ``core``
(``read_memory_timeline_raw``, named in docs/memory.md). The other modules are internal.

The public names below are what the rest of graphdeck imports from these modules; each is
loaded on first use (PEP 562), so importing one module of the package imports no other:
``from graphdeck.analysis.memory import checkpoint_estimate``.
"""

from __future__ import annotations

from graphdeck.analysis import lazy_exports

#: Public name → the module of this package that defines it.
_PUBLIC = {
    "checkpoint_estimate": "core",
    "dtype_estimate": "core",
    "forward_backward_pair": "core",
    "graph_memory": "core",
    "import_snapshot": "snapshots",
    "inductor_step_memory": "inductor",
    "is_snapshot": "snapshots",
    "load_snapshot": "measured",
    "measure": "measured",
    "measured_from_trace": "core",
    "output_code_files": "measured",
    "step_memory": "core",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
