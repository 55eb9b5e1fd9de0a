"""Cross-rank checks: graphs, predicted and recorded collectives (Flight Recorder), hangs, compile
skew, rank heatmaps (``graphdeck check-ranks``).

Modules:

* ``compile_skew``: Rank skew at compile time: compile wall time, cache hits and recompiles compared
  across ranks.
* ``core`` (the former ``ranks`` module): Cross-rank consistency: do all ranks of a run compile the
  same graphs and issue the same collectives in the same order?
* ``cpu_collectives``: CPU-side collectives in Kineto traces (gloo and other CPU backends), and who
  waited for whom.
* ``flight``: The recorded half of a hang: each process group's first mismatched collective in the
  ranks' Flight Recorder dumps (stored by…
* ``hangs``: The hang report: Flight Recorder's first mismatch per process group
  (:mod:`graphdeck.analysis.ranks.flight`) joined to the compile records that explain it.
* ``heatmap``: Rank heatmaps (issue 26 item 2): one matrix of ranks × steps or ranks × collectives,
  for the pages that would otherwise list a row, a lane or a table per rank.
* ``mesh``: Cross-rank checks per mesh dimension: which ranks must agree, and on what (issue
  20, item 3).
* ``nway``: The N-way rank diff (issue 42): one graph across all ranks, ranks grouped by fingerprint
  into classes, the nodes where a class differs, the layout's explanation, node time per rank.
* ``predicted``: Predictions checked against the record (issue 19, item 3): per process group, the
  collective schedule :mod:`graphdeck.analysis.ranks.core` predicts from the…
* ``schedules``: The collective schedule each rank is predicted to issue, from its compiled
  graphs and the capture's records (NOTE: [Recompiles replace graphs]), and the…
* ``sequences``: Per-rank compile sequences, read for many ranks at once, and the
  device-neutral re-hash of graphs (NOTE: [Rank-local device indices]) — the inputs of…
* ``records``: The records :mod:`graphdeck.analysis.ranks.core` compares and reports: a rank's
  compiles (:class:`CompileEntry`), the nodes it names (:class:`NodeRef`),…
* ``shard_shapes``: Rank-dependent shapes in graphs that are otherwise the same program: FSDP's
  uneven shards.

Public modules (import paths users may rely on): this package's names below and ``core``
(``rank_report``, the notebook API's ``check_ranks``). The other modules are internal.

The public names below are what the rest of graphdeck imports from these modules; each is
loaded on first use (PEP 562), so importing one module of the package imports no other:
``from graphdeck.analysis.ranks import MAX_COLUMNS``.
"""

from __future__ import annotations

from graphdeck.analysis import lazy_exports

#: Public name → the module of this package that defines it.
_PUBLIC = {
    "MAX_COLUMNS": "heatmap",
    "compile_sequence": "core",
    "flight_report": "flight",
    "nway_report": "nway",
    "nway_reports": "nway",
    "rank_heatmap": "heatmap",
    "rank_report": "core",
    "run_ranks": "heatmap",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
