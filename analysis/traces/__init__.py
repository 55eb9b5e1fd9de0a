"""Profiler traces on graph nodes: kernels and CPU ops mapped to FX nodes, trace analysis,
collectives in traces, export.

Modules:

* ``comm_map``: Communication kernels → graph nodes: a DDP all-reduce or an FSDP2 all-gather /
  reduce-scatter is tied to the nodes that produce or read the parameters it…
* ``cpu_trace_map``: CPU traces on graph nodes: the ATen ops and C++ kernels of a CPU-only trace
  mapped to FX nodes.
* ``kernel_source_nodes``: Kernel → node tables read from Inductor's output code, and the
  low-coverage warning.
* ``trace_analysis``: Per-rank trace analyses: steps, GPU busy/idle, scheduling-delay hotspots,
  comm/compute overlap.
* ``trace_collectives``: Collectives across ranks: matching, clock alignment, who arrived last,
  stragglers.
* ``trace_data``: Reading stored trace events back for the trace analyses (one trace at a time, as
  tuples).
* ``trace_export``: Export a run's traces as one Chrome Trace Event Format file, clocks aligned, for
  Perfetto.
* ``trace_links``: GPU event → launching runtime call → enclosing CPU operator, for one stored
  trace.
* ``trace_map``: Kernel → FX node mapping: ``kernel_nodes`` rows from compile records, and GPU time
  per node.
* ``trace_window``: Level of detail for timelines: which events of a time window to draw, fast on
  big traces.

The public names below are what the rest of graphdeck imports from these modules; each is
loaded on first use (PEP 562), so importing one module of the package imports no other:
``from graphdeck.analysis.traces import CommRule``.
"""

from __future__ import annotations

from graphdeck.analysis import lazy_exports

#: Public name → the module of this package that defines it.
_PUBLIC = {
    "CommRule": "trace_analysis",
    "ExportPlan": "trace_export",
    "INDEX_KEY": "trace_collectives",
    "IndexCache": "trace_window",
    "TraceData": "trace_analysis",
    "align_and_match": "trace_collectives",
    "analyze_trace": "trace_analysis",
    "build_index": "trace_collectives",
    "coverage_warning": "kernel_source_nodes",
    "export_trace": "trace_export",
    "fetch_rows": "trace_window",
    "gpu_busy": "trace_analysis",
    "hotspots": "trace_analysis",
    "iter_export": "trace_export",
    "link_gpu_events": "trace_links",
    "link_kernels": "trace_map",
    "load_events": "trace_data",
    "map_trace": "trace_map",
    "node_time_ns": "trace_map",
    "overlap": "trace_analysis",
    "plan_export": "trace_export",
    "run_traces": "trace_collectives",
    "step_times": "trace_analysis",
    "store_index": "trace_collectives",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
