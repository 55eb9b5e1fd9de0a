"""Replica agreement across tensor-parallel peers: a DTensor parameter placed ``Replicate`` on a
sharding mesh dimension (``tp``, ``cp``, ...) is the same tensor on every rank along that
dimension, before and after each step (NOTE: [Replica agreement] in ``replicas.py``).

Per parameter and such dimension, the ranks that vary only along it (the layout's
``dim_groups``) are compared: the parameter after the step always, the gradient where its own
placement there says ``Replicate`` (a ``Partial`` gradient holds partial sums by design, reduced
when the optimizer's DTensor op redistributes it). A gradient marked ``Replicate`` that differs
between TP peers is a reduction missing from the backward — typically ``DTensor.to_local()``
without ``grad_placements`` on a tensor whose local gradient is a partial sum.
"""

from __future__ import annotations

from graphdeck.analysis.gradients.replicas import Prints, _ranges, _replicate, compare, first_mismatch
from graphdeck.analysis.gradients.report import Finding

_FIX = ("declare the local gradient's placement: `param.to_local(grad_placements=[Partial()])` where the local "
        "tensor's gradient is a partial sum (rank-local tokens, a shard of a reduction), or compute with the "
        "DTensor itself (or the TP style's input/output layouts) so DTensor puts the all-reduce in the backward")


def replicate_sets(layout) -> dict[tuple, set[str]]:
    """``(dim name, dim index in the parameter's mesh, group of ranks) → parameters`` placed
    ``Replicate`` on a sharding dimension (the layout's DP and pipeline dims are left to the
    data-parallel check)."""
    sharding = set(layout.sharding_dims())
    out: dict[tuple, set[str]] = {}
    groups_of: dict[str, list[list[int]]] = {}
    for rank, rec in layout.records.items():
        for p in rec.get("params") or []:
            if not isinstance(p, dict) or not isinstance(p.get("placements"), list):
                continue
            dims = layout.mesh_dims_of(rank, p)
            for k, (d, pl) in enumerate(zip(dims, p["placements"])):
                if d not in sharding or not _replicate([pl], None):
                    continue
                if d not in groups_of:
                    groups_of[d] = layout.dim_groups(d)
                for g in groups_of[d]:
                    if rank in g and len(g) > 1:
                        out.setdefault((d, k, tuple(g)), set()).add(str(p.get("fqn")))
    return out


def tp_findings(prints: Prints, report, layout) -> list[Finding]:
    """``REPLICA_DIVERGENCE`` per (mesh dimension, group of TP peers) whose Replicate parameters differ."""
    out: list[Finding] = []
    checked: list[dict] = []
    for (dim, k, group), params in sorted(replicate_sets(layout).items()):
        ranks = [r for r in group if r in prints.values]
        if len(ranks) < 2:
            continue
        checked.append({"dim": dim, "ranks": list(group), "params": sorted(params)})
        bad = compare(prints, ranks, only=params, dim=k)
        if not bad:
            continue
        first, names, wname, worst = first_mismatch(bad)
        (na, wa), (nb, wb) = worst["values"]
        ra, rb = worst["ranks"]
        what = "gradient (as the optimizer consumed it)" if worst["what"] == "grad" else "value after the step"
        msg = (f"{', '.join(names)}: placed Replicate on mesh dimension {dim!r}, but the TP peers on ranks "
               f"{list(group)} hold different values from step {first}: {wname}'s {what}: norm {na:.4g} on rank "
               f"{ra} vs {nb:.4g} on rank {rb}, position-weighted sum {wa:.4g} vs {wb:.4g} (difference "
               f"{worst['diff']:.2g} of the norm). ")
        if worst["what"] == "grad":
            msg += (f"Its gradient is marked {', '.join(worst['placement'] or ['Replicate'])} yet differs between "
                    "the peers: the all-reduce that makes a Replicate parameter's gradient whole is missing from the "
                    "backward — a DTensor.to_local() (or an op on the local tensor) without grad_placements handed "
                    "autograd a rank-local partial gradient as the Replicate one. ")
            fix = _FIX
        else:
            msg += ("Its gradients agree (or are Partial, reduced by the optimizer's DTensor op) but the parameter "
                    "differs after the step: the update differs per TP rank (rank-local optimizer state or learning "
                    "rate, or a parameter changed outside the optimizer). ")
            fix = "update Replicate parameters identically on every TP rank (through DTensor ops on the parameter)"
        msg += (f"The TP ranks train different copies of a parameter that must be one from step {first}; nothing "
                "raises and the loss still looks right.")
        out.append(Finding(kind="REPLICA_DIVERGENCE", severity="error", message=msg, params=names,
                           ranks=list(group), fix=fix))
        for r in report.rows:
            if r.fqn in bad and r.rank in group:
                r.notes.append(f"differs from its TP peers on ranks {list(group)} from step {bad[r.fqn]['step']}")
    if checked:
        cov = report.coverage.setdefault("replicas", {})
        cov["tp"] = checked
        steps = sorted({s for c in checked for r in c["ranks"] for s in prints.values.get(r, {})})
        if not cov.get("fingerprinted_steps"):
            cov["fingerprinted_steps"] = _ranges(steps)
    return out
