"""Profiler traces on graph nodes: kernels and CPU ops mapped to FX nodes, trace analysis,
collectives in traces, export.

Modules:

* ``comm_map``: Communication kernels → graph nodes: a DDP all-reduce or an FSDP2 all-gather /
  reduce-scatter is tied to the nodes that produce or read the parameters it…
* ``cpu_mapping``: CPU traces on graph nodes: the ATen ops and C++ kernels of a CPU-only trace
  mapped to FX nodes.
* ``kernel_source_nodes``: Kernel → node tables read from Inductor's output code, and the
  low-coverage warning.
* ``analyze``: Per-rank trace analyses: steps, GPU busy/idle, scheduling-delay hotspots,
  comm/compute overlap.
* ``collectives``: Collectives across ranks: matching, clock alignment, who arrived last,
  stragglers.
* ``data``: Reading stored trace events back for the trace analyses (one trace at a time, as
  tuples).
* ``export``: Export a run's traces as one Chrome Trace Event Format file, clocks aligned, for
  Perfetto.
* ``idle``: Idle time by cause: GPU stream idle as host wait / kernel wait / other (HTA's rule), a
  CPU step's time by cause (compiled, data loader, collectives, optimizer, eager ops, Python).
* ``links``: GPU event → launching runtime call → enclosing CPU operator, for one stored
  trace.
* ``mapping``: Kernel → FX node mapping: ``kernel_nodes`` rows from compile records, and GPU time
  per node.
* ``window``: Level of detail for timelines: which events of a time window to draw, fast on
  big traces.

Public modules (import paths users may rely on): this package's names below and ``mapping``
(``node_time_ns``); ``trace_map`` is the deprecated old path of ``mapping``. The other modules are
internal.

The public names below are what the rest of graphdeck imports from these modules; each is
loaded on first use (PEP 562), so importing one module of the package imports no other:
``from graphdeck.analysis.traces import CommRule``.
"""

from __future__ import annotations

from graphdeck.analysis import lazy_exports

#: Public name → the module of this package that defines it.
_PUBLIC = {
    "CommRule": "analyze",
    "ExportPlan": "export",
    "INDEX_KEY": "collectives",
    "IndexCache": "window",
    "TraceData": "analyze",
    "align_and_match": "collectives",
    "analyze_trace": "analyze",
    "build_index": "collectives",
    "coverage_warning": "kernel_source_nodes",
    "export_trace": "export",
    "fetch_rows": "window",
    "cpu_time": "idle",
    "gpu_idle": "idle",
    "idle_breakdown": "idle",
    "idle_by_cause": "idle",
    "gpu_busy": "analyze",
    "hotspots": "analyze",
    "iter_export": "export",
    "link_gpu_events": "links",
    "link_kernels": "kernel_links",
    "load_events": "data",
    "map_trace": "mapping",
    "node_time_ns": "mapping",
    "overlap": "analyze",
    "plan_export": "export",
    "run_traces": "collectives",
    "step_times": "analyze",
    "store_index": "collectives",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
