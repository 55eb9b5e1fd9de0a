"""One stored graph as a model to draw and compare: the graph view (what the SVG renderer, the
dashboard and :class:`graphdeck.visualize.GraphVisualizer` draw) and the graph diff.

Modules (none is imported by this package; import the module you need):

* ``view``: the graph view model (``GraphView``, ``ViewNode``, ``ViewEdge``, ``graph_view``);
  formerly ``graphdeck.server.views``, moved here so the analysis never imports the server.
* ``diff``: which nodes of two graphs correspond, and which were added, removed or changed
  (``diff_views``; NOTE: [Node matching]).
* ``merge``: N versions of one graph folded into one drawable view over a base (``merge_views``;
  NOTE: [Merged N-way graph]), for the N-way rank diff.

None of these is a public import path: users reach them through :mod:`graphdeck.visualize`, the
CLI and the HTTP API.
"""
