"""Recomputation at the peak: which live tensors at a backward graph's peak are activation
checkpointing's recomputations, of which checkpointed regions, and when a graph break helps.

# NOTE: [Recomputation at the peak]
An AOT backward graph holds the forward ops the partitioner recomputes there: nodes tagged
``partitioner_tag == "is_forward"`` with ``meta["ac_graph_id"]`` (one id per ``checkpoint``
call), grouped into regions by :func:`graphdeck.analysis.parallel.regions.graph_regions` (NOTE:
[Graph regions]). A storage of the memory model (:mod:`.core`) whose producing node is in such a
region and that is live at the peak is a recomputation held at the peak; its bytes are summed per
region. When one checkpointed module is recomputed by more than one region of the same backward
graph, the module was traversed more than once in one compiled graph (a loop over the same
blocks, weight-shared layers): the recomputations of every traversal are then placed in one
backward graph beside the gradients of the other traversals, where a graph break between the
traversals gives each its own backward graph (measured on a CPU ``aot_eager`` job of two
checkpointed blocks traversed twice: backward peak 13.3 MiB in one graph, 10.8 MiB per graph
with a break; ``tests/test_memory_recompute.py``). The advice says so and names the modules; it
estimates nothing (the break's own peak is what its run shows).
"""

from __future__ import annotations

import re

import numpy as np
from sqlalchemy.orm import Session


def recomputation_at_peak(session: Session, curve, backward_id: int, offset: int = 0) -> dict | None:
    """Recomputed tensors live at ``curve``'s peak, for the stored AOT backward graph
    ``backward_id`` whose nodes start at position ``offset`` of the curve (0: the curve is that
    graph alone; the forward's node count for a step curve).

    Returns None when the graph recomputes nothing, else ``{"bytes": int, "regions": [{"label":
    str, "module": str | None, "ac_graph_id": str | None, "bytes": int, "tensors": [node names], "traversals": int}],
    "repeated": [module], "advice": str | None}``: ``bytes`` the recomputed bytes live at the peak
    (0 when the peak holds none), ``regions`` those with bytes at the peak, largest first,
    ``traversals`` how many recomputed regions of this graph checkpoint the same module,
    ``advice`` the graph-break suggestion (NOTE: [Recomputation at the peak]) when a region at the
    peak is one of several traversals of its module, else None."""
    from graphdeck.analysis.parallel.regions import graph_regions

    regions = [r for r in graph_regions(session, backward_id) if r.kind == "activation_checkpoint_recomputed"]
    st = curve.storages
    if not regions or st is None or not len(st):
        return None
    modules = [r.label.split(": ", 1)[1] if ": " in r.label else None for r in regions]
    count: dict[str | None, int] = {}
    for m in modules:
        count[m] = count.get(m, 0) + 1
    of_node = {n: i for i, r in enumerate(regions) for n in r.nodes}
    at = curve.peak_index
    live = np.flatnonzero((st.birth <= at) & (st.death >= at) & (st.birth >= offset)).tolist()
    per: dict[int, list] = {}
    for k in live:
        i = of_node.get(st.name[k])
        if i is not None:
            per.setdefault(i, []).append(k)
    rows = [{"label": regions[i].label, "module": modules[i], "ac_graph_id": _ac_id(regions[i].detail),
             "bytes": int(sum(int(st.size[k]) for k in ks)),
             "tensors": [st.name[k] for k in ks], "traversals": count[modules[i]]} for i, ks in per.items()]
    rows.sort(key=lambda x: (-x["bytes"], x["label"]))
    repeated = sorted({r["module"] or "(no module)" for r in rows if r["traversals"] > 1})
    advice = None
    if repeated:
        advice = (f"the checkpointed {', '.join(repeated)} {'is' if len(repeated) == 1 else 'are'} recomputed for "
                  f"{max(r['traversals'] for r in rows)} traversals in this one backward graph, and those "
                  "recomputations are live at its peak: a graph break between the traversals "
                  "(torch._dynamo.graph_break() in straight-line code between two unrolled traversals, or "
                  "compiling each traversal on its own) gives each traversal its own backward graph, so one "
                  "traversal's recomputations are not held beside the other's gradients. Not inside a loop "
                  "over the traversals: Dynamo cannot resume after a graph break in a loop and runs the whole "
                  "function eagerly (no graph at all)")
    return {"bytes": int(sum(r["bytes"] for r in rows)), "regions": rows, "repeated": repeated, "advice": advice}


def _ac_id(detail: str) -> str | None:
    m = re.search(r"checkpointed region (\S+) ", detail)
    return m.group(1) if m else None


def recomputation_lines(rec: dict | None) -> list[str]:
    """The CLI's lines for :func:`recomputation_at_peak`'s answer (none when the peak holds no
    recomputed tensor)."""
    if not rec or not rec["bytes"]:
        return []
    out = [f"recomputed at the peak: {rec['bytes'] / 2**20:.2f} MiB (activation checkpointing's recomputations):"]
    for r in rec["regions"]:
        times = f", one of {r['traversals']} traversals" if r["traversals"] > 1 else ""
        out.append(f"  {r['module'] or '(no module)'} (checkpointed region {r['ac_graph_id']}{times}) "
                   f"{r['bytes'] / 2**20:.2f} MiB: {', '.join(r['tensors'][:8])}")
    if rec["advice"]:
        out.append(f"  advice: {rec['advice']}")
    return out
