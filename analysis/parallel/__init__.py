"""The parallel layout of a run and what is drawn from it on a graph: device meshes, DTensor
placements, FSDP2 groups, pipeline stages (``GET /api/runs/{id}/layout``, the parallel map),
activation-checkpoint and autocast regions, and per-node overlays.

Modules (none is imported by this package; import the module you need):

* ``layout``: the layout records the capture writes, read back (``load_layout``, ``build_layout``,
  ``RunLayout``; NOTE: [Parallel layout]).
* ``regions``: activation-checkpoint and autocast regions of a stored graph (``graph_regions``).
* ``overlays``: per-node overlays of a stored graph (``Overlay``, ``graph_overlay``).
* ``partition``: the N-D parallel part of the ``partition`` overlay (``parallel_partition``).

None of these is a public import path: users reach them through the CLI and the HTTP API.
"""
