"""Text rendering of a :class:`~graphdeck.analysis.gradients.parity.ParityReport` (``graphdeck parity``)."""

from __future__ import annotations


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def render(rep) -> str:
    from graphdeck.analysis.gradients.parity import TOLERANCE

    wa, wb = rep.worlds
    head = (f"parity: sharded run {rep.run_a!r}" + (f" ({wa} ranks)" if wa else "")
            + f" vs reference {rep.run_b!r}" + (f" ({wb} rank{'s' if wb != 1 else ''})" if wb else "")
            + (f", optimizer step {rep.step}" if rep.step is not None else "") + f": {rep.verdict}")
    lines = [head]
    tol = ", ".join(f"{k} rtol {r:g} atol {a:g}" for k, (r, a) in TOLERANCE.items())
    lines.append(f"  tolerance: max|sharded - reference| <= atol + rtol * max|reference| ({tol})")
    if rep.loss:
        ls = rep.loss
        mine = _g(ls["sharded"]) if not ls.get("per_rank") else "per rank " + ", ".join(_g(v) for v in ls["per_rank"])
        lines.append(f"  loss: sharded {mine}, reference {_g(ls['reference'])}: {ls['status']}"
                     + (f" ({ls['reason']})" if ls.get("reason") else ""))
        if ls["status"] == "DIFFER":
            lines.append("  the loss itself differs: the forward or the batch differ (both runs must draw the same "
                         "batch: the script's seed decides), so every gradient below differs too")
    for p in rep.params:
        where = f" [{', '.join(p.placements)}]" if p.placements else ""
        what = (f"max |sharded - reference| {_g(p.diff)}, max |reference| {_g(p.scale)}"
                if p.diff is not None else p.reason)
        lines.append(f"  {p.status:<12} {p.name} {p.shape or ''} {p.dtype or ''}{where}: {what}"
                     + (f" ({p.reason})" if p.diff is not None and p.reason else ""))
    n = rep.first_node
    if n is not None:
        lines.append(f"  first differing backward node: {n.name} (backward {n.backward}, node {n.index + 1} of {n.of} "
                     f"in the reference's order" + (f"; made by {n.source}" if n.source else "") + f"): max "
                     f"|sharded - reference| {_g(n.diff)}, max |reference| {_g(n.scale)}")
        lines.append(f"    {n.meaning()}")
        if n.unmatched_before:
            more = n.unmatched_before - len(n.unmatched_nodes)
            lines.append(f"    {n.unmatched_before} node(s) before it could not be compared (rank-local values or no "
                         f"counterpart): {', '.join(n.unmatched_nodes)}" + (f" and {more} more" if more > 0 else ""))
    elif any(p.status == "DIFFER" for p in rep.params):
        lines.append(f"  no backward node localised ({rep.nodes_compared} compared): see the notes")
    for why in rep.incomplete:
        lines.append(f"  INCOMPLETE: {why}")
    for note in rep.notes:
        lines.append(f"  note: {note}")
    if rep.fix:
        lines.append(f"  fix: {rep.fix}")
    if rep.consequence():
        lines.append(f"  consequence: {rep.consequence()}")
    return "\n".join(lines)
