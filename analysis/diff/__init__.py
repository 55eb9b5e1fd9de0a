"""Run B against run A (``graphdeck diff-runs``, ``GET /api/diff``, the dashboard's ``#/diff``
page). The graph diff (graph A against graph B) is :mod:`graphdeck.analysis.graphs.diff`.

Modules (none is imported by this package; import the module you need):

* ``runs``: the run diff and its gates (``diff_runs``, ``Gates``, ``RunDiff``; NOTE: [Run diff]).
* ``parts``: its sections other than timing: compiles, graph structure, memory, ranks, gradients.
* ``times``: node times per training step from the stored traces, compared with a noise floor.
* ``text``: the run diff as text and JUnit XML (``to_text``, ``to_junit``).

None of these is a public import path: users reach them through the CLI and the HTTP API.
"""
