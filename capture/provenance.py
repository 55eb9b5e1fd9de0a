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
:func:`graphdeck.analysis.trace_map.link_kernels` turns them into ``kernel_nodes`` rows.
"""

from __future__ import annotations

import re


def enable_provenance() -> bool:
    """Turn Inductor's provenance tracking on (level 1) unless the user set a level already.

    Returns True when tracking is on afterwards. Never raises: a torch without the option
    just keeps its default, and kernel → node links then come from the other sources.
    """
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


def kernel_post_grad_nodes() -> str | None:
    """JSON of Inductor's live kernel → post-grad node table (``{"name:handle": [node, ...]}``).

    Read when the ``..._kernel_stack_traces`` artifact is logged, i.e. right after a graph's
    kernels were generated. The ``..._node_mappings`` artifact carries the same table only when
    the pre-grad graph is known, which is not the case for a backward graph compiled lazily at
    the first ``backward()``; this snapshot covers both. None when torch has no such table.
    """
    import json

    try:
        from torch._inductor import debug

        table = getattr(debug, "_inductor_triton_kernel_to_post_grad_node_info", None)
        if not isinstance(table, dict):
            return None
        return json.dumps({str(k): [str(n) for n in v] for k, v in table.items() if isinstance(v, list)})
    except Exception:  # noqa: BLE001 - capture never breaks training
        return None


# NOTE: [Kernel source nodes from the output code]
# Inductor's provenance table misses some kernels: the foreach/combo kernels of a compiled
# optimizer step (``triton_for_fused_N``, the fused AdamW update: ~2-3% of a GPT-2 step's GPU
# time on an H200) appear in it only for their first few calls. The generated wrapper module
# (the ``inductor_output_code`` record) comments every Triton kernel it defines with the AOT
# graph nodes it computes ("# Topologically Sorted Source Nodes: [a, b], Original ATen: [...]",
# written by ``torch/_inductor/utils.py:get_kernel_metadata``; "Unsorted" when the nodes span
# graphs), and its ``call`` function launches them as ``name.run(...)``. Reading both gives a
# table in the provenance format ("name:k" -> nodes, k = launch order) for every such kernel;
# the store keeps that (a few KB), not the code. C++ kernels carry no such comment.
_SOURCE_NODES = re.compile(r"^#\s*(?:Topologically Sorted|Unsorted) Source Nodes: \[(.*)\], Original ATen:")
_KERNEL_DEF = re.compile(r"^(\w+)\s*=\s*async_compile\.\w+\(")
_KERNEL_RUN = re.compile(r"\b(\w+)\.run\(")


def kernel_source_nodes(code: str) -> dict[str, list[str]]:
    """``{"kernel:k": [AOT graph node names]}`` for each launch of a commented Triton kernel in
    Inductor's generated wrapper ``code`` (k counts launches in code order, from 0).

    >>> kernel_source_nodes('''
    ... # Topologically Sorted Source Nodes: [add, relu], Original ATen: [aten.add, aten.relu]
    ... triton_poi_fused_add_relu_0 = async_compile.triton('triton_poi_fused_add_relu_0', \\'\\'\\'
    ... \\'\\'\\')
    ... def call(args):
    ...     triton_poi_fused_add_relu_0.run(buf0, arg0_1, 16, stream=stream0)
    ... ''')
    {'triton_poi_fused_add_relu_0:0': ['add', 'relu']}
    """
    nodes_of: dict[str, list[str]] = {}
    pending: list[str] | None = None
    calls: list[str] = []
    for line in code.splitlines():
        m = _SOURCE_NODES.match(line)
        if m:
            pending = [n.strip() for n in m.group(1).split(",") if n.strip()]
            continue
        m = _KERNEL_DEF.match(line)
        if m:
            if pending:
                nodes_of[m.group(1)] = pending
            pending = None
            continue
        if line.startswith((" ", "\t")) and ".run(" in line:
            calls.extend(name for name in _KERNEL_RUN.findall(line) if name in nodes_of)
    return {f"{name}:{k}": nodes_of[name] for k, name in enumerate(calls)}
