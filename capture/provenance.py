"""Inductor provenance tracking: which FX nodes each generated kernel computes.

Inductor (``torch._inductor.config.trace.provenance_tracking_level``, torch >= 2.9; the older
boolean ``trace.provenance_tracking``) records, for every kernel it generates, the post-grad FX
nodes fused into it and, for each post-grad node, the pre-grad (Dynamo) nodes it came from. It
emits them as the structured-trace artifacts ``inductor_provenance_tracking_node_mappings``
(JSON: ``cppCodeToPost`` kernel ``"name:handle"`` → post-grad node names, ``postToPre`` /
``preToPost``, ``version``) and ``inductor_provenance_tracking_kernel_stack_traces`` — see
``torch/_inductor/debug.py`` (``dump_inductor_provenance_info``,
``set_kernel_post_grad_provenance_tracing``) and ``torch/_inductor/compile_fx.py``.

The agent's structured-log handler keeps those artifacts as ``compile_events`` rows;
:func:`graphdeck.analysis.traces.mapping.link_kernels` turns them into ``kernel_nodes`` rows.
"""

from __future__ import annotations


def enable_provenance() -> bool:
    """Turn Inductor's provenance tracking on (level 1) unless the user set a level already.

    Returns True when tracking is on afterwards. Never raises: a torch without the option
    just keeps its default, and kernel → node links then come from the other sources.
    ``GRAPHDECK_PROVENANCE=0`` leaves it as it is (links then come from the output code's
    source-node comments and stack traces alone).
    """
    import os

    if os.environ.get("GRAPHDECK_PROVENANCE", "1") == "0":
        return False
    try:
        from torch._inductor import config
    except Exception:  # noqa: BLE001 - capture never breaks training
        return False
    trace = getattr(config, "trace", None)
    if trace is None:
        return False
    if hasattr(trace, "provenance_tracking_level"):
        if not trace.provenance_tracking_level:
            trace.provenance_tracking_level = 1
        return bool(trace.provenance_tracking_level)
    if hasattr(trace, "provenance_tracking"):
        trace.provenance_tracking = True
        return True
    return False


def kernel_post_grad_nodes():
    """JSON of Inductor's live kernel → post-grad node table (``{"name:handle": [node, ...]}``),
    as a zero-argument callable returning that text: the table is copied now (it grows with every
    graph), the JSON is made when the record is written (on the graphdeck-writer thread, NOTE:
    [Writes off the compiling thread]).

    Read when the ``..._kernel_stack_traces`` artifact is logged, i.e. right after a graph's
    kernels were generated. The ``..._node_mappings`` artifact carries the same table only when
    the pre-grad graph is known, which is not the case for a backward graph compiled lazily at
    the first ``backward()``; this snapshot covers both. None when torch has no such table.
    """
    import functools
    import json

    try:
        from torch._inductor import debug

        table = getattr(debug, "_inductor_triton_kernel_to_post_grad_node_info", None)
        if not isinstance(table, dict):
            return None
        snapshot = {str(k): [str(n) for n in v] for k, v in table.items() if isinstance(v, list)}
        return functools.partial(json.dumps, snapshot)
    except Exception:  # noqa: BLE001 - capture never breaks training
        return None
