"""Compile checks: graph breaks, recompiles, failed compiles and compile time of a run
(``graphdeck check-compile``, ``GET /api/runs/{id}/compile-health``, the run page's "Compile
health" panel), and the per-rank compile list (``GET /api/runs/{id}/compile-index``).

Modules (none is imported by this package; import the module you need):

* ``health``: the compile-health report of a run, per rank and in total (``compile_health``,
  ``Thresholds``, ``CompileHealth``).
* ``text``: that report as text and JUnit XML (``to_text``, ``to_junit``).
* ``rules``: how torch's compile texts are read: graph-break reasons, guard failures and failed
  compiles sorted into classes with hints.
* ``index``: the compile list of a run per rank, like tlparse's index page (``compile_index``).
* ``ddp_overlap``: compiled DDP whose gradient all-reduces cannot overlap the backward.

None of these is a public import path: users reach them through the CLI and the HTTP API.
"""
