"""Replica agreement: ranks that must hold the same value hold it (``REPLICA_DIVERGENCE``).

Reads the ``graphdeck_grad_prints`` records (NOTE: [Gradient fingerprints] in
``capture/grad_prints.py``): per rank and fingerprinted optimizer step, ``[norm, weighted sum]``
of each parameter's gradient as the optimizer consumed it and of the parameter after the step,
and under DDP whether each backward was all-reduced.

# NOTE: [Replica agreement]
# Which ranks must agree: the DDP process groups the capture recorded (``groups``), else the
# layout's replica peers (same stage, same coordinate on every sharding dimension), else — a DDP
# run without either — every rank with fingerprints. After DDP's all-reduce every replica holds
# the same gradient bits, and the same update on the same parameter gives the same parameter
# bits, so the fingerprints of replicas are equal; a difference beyond the tolerance of the
# tensor's dtype (:data:`RTOL`, relative to the larger norm) is a divergence. A gradient that
# differs is the cause at that step; a parameter that differs while the gradients agree
# says the replicas were already apart (an earlier step not fingerprinted, a rank-local update).
# The likely cause comes from the recorded DDP sync state: the steps whose last backward before
# ``optimizer.step()`` ran under ``no_sync()`` consumed a gradient that was never all-reduced.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.report import Finding, ParamRow

EVENT = "graphdeck_grad_prints"
#: Relative tolerance per dtype name (of the larger of the two norms): replicas are bitwise equal,
#: so this only absorbs a reduction order that differs between ranks (thread counts).
RTOL = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
DEFAULT_RTOL = 1e-3


@dataclass
class Prints:
    """One run's fingerprints: ``values[rank][step] = {"names", "dtypes", "grad", "param"}``,
    ``unsynced[rank]`` = steps whose last backward before the optimizer step was not reduced by
    DDP, ``synced_known[rank]`` = steps with a recorded DDP sync state, ``micro[rank][step]`` =
    per-backward sync flags of that step, ``groups``: DDP process groups recorded."""

    values: dict[int, dict[int, dict]] = field(default_factory=dict)
    unsynced: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    synced_known: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    micro: dict[int, dict[int, list]] = field(default_factory=lambda: defaultdict(dict))
    groups: list[list[int]] = field(default_factory=list)
    ignored: set[str] = field(default_factory=set)  # DDP's parameters_to_ignore: not reduced, not compared

    def __bool__(self) -> bool:
        return bool(self.values)


def load(session: Session, run_id: int) -> Prints:
    """The run's fingerprint records (an unreadable payload is skipped)."""
    out = Prints()
    names: dict[int, list[str]] = {}
    for rank, payload in session.execute(text(
            "SELECT rank, payload FROM compile_events WHERE run_id = :r AND name = :n ORDER BY rank, id"),
            {"r": run_id, "n": EVENT}):
        try:
            p = json.loads(payload or "{}")
            first, last = int(p["first"]), int(p["last"])
        except (ValueError, KeyError, TypeError):
            continue
        out.ignored.update(str(x) for x in p.get("ddp_ignored") or [])
        for g in p.get("groups") or []:
            g = sorted(int(x) for x in g)
            if g not in out.groups:
                out.groups.append(g)
        if p.get("last_synced") is not None:
            out.synced_known[rank].update(range(first, last + 1))
            if p["last_synced"] is False:
                out.unsynced[rank].update(range(first, last + 1))
            if p.get("synced"):
                for s in range(first, min(last, first + 64) + 1):
                    out.micro[rank][s] = list(p["synced"])
        if "names" in p:
            names[rank] = list(p["names"])
        if "grad" in p and rank in names:
            out.values.setdefault(rank, {})[first] = {"names": names[rank], "dtypes": p.get("dtypes") or [],
                                                       "grad": p.get("grad") or [], "param": p.get("param"),
                                                       "gplace": p.get("gplace") or {}}
    return out


def peer_groups(prints: Prints, layout=None, *, ddp: bool) -> list[list[int]]:
    """The groups of ranks that must agree (NOTE: [Replica agreement]), each of 2+ ranks with prints."""
    have = set(prints.values)
    if prints.groups:
        groups = prints.groups
    elif layout is not None and layout.meshes:
        groups = layout.replica_peers()
    elif ddp:
        groups = [sorted(have)]
    else:
        groups = []
    return [g for g in ([r for r in grp if r in have] for grp in groups) if len(g) > 1]


def _differs(a, b, rtol: float) -> float | None:
    """The relative difference of two ``[norm, wsum]`` pairs when beyond ``rtol``, else None."""
    if a is None or b is None:
        return None
    scale = max(abs(a[0]), abs(b[0]), 1e-30)
    d = max(abs(a[0] - b[0]), abs(a[1] - b[1]) / 2) / scale  # wsum is bounded by ~2·sqrt(n)·norm
    return d if d > rtol else None


def _ranges(steps) -> str:
    """Steps as runs: ``{0, 1, 2, 5}`` → ``"0–2, 5"``."""
    from graphdeck.analysis.traces.collectives import rank_spans

    return rank_spans(sorted(steps), sep=", ", dash="–")


def compare(prints: Prints, group: list[int], only: set[str] | None = None, dim: int | None = None) -> dict[str, dict]:
    """Per diverging parameter: ``{"step", "what": "grad"|"param", "ranks": [a, b], "diff",
    "values": [[norm, wsum] of a, of b], "agreed": last step it agreed or None, "placement"}`` (its
    first fingerprinted step where the ranks of ``group`` differ). ``only``: the parameters to
    compare (None: all); ``dim``: the mesh-dimension index along which ``group`` varies — a
    DTensor gradient is compared only where its placement there is ``Replicate`` (a ``Partial``
    one holds rank-local partial sums by design; its parameter after the step is still compared)."""
    base = group[0]
    out: dict[str, dict] = {}
    agreed: dict[str, int] = {}
    for step in sorted(prints.values.get(base, {})):
        a = prints.values[base][step]
        idx_a = {n: i for i, n in enumerate(a["names"]) if only is None or n in only}
        for other in group[1:]:
            b = prints.values.get(other, {}).get(step)
            if b is None:
                continue
            idx_b = {n: i for i, n in enumerate(b["names"])}
            for name, i in idx_a.items():
                j = idx_b.get(name)
                if j is None or name in out:
                    continue
                rtol = RTOL.get(a["dtypes"][i] if i < len(a["dtypes"]) else "", DEFAULT_RTOL)
                place = a.get("gplace", {}).get(str(i))
                for what in ("grad", "param"):
                    if what == "grad" and place is not None and not _replicate(place, dim):
                        continue
                    va, vb = a.get(what), b.get(what)
                    if not va or not vb or i >= len(va) or j >= len(vb):
                        continue
                    d = _differs(va[i], vb[j], rtol)
                    if d is not None:
                        out[name] = {"step": step, "what": what, "ranks": [base, other], "diff": d,
                                     "values": [va[i], vb[j]], "agreed": agreed.get(name), "placement": place}
                        break
                else:
                    agreed[name] = step
    return out


def first_mismatch(bad: dict[str, dict]) -> tuple[int, list[str], str, dict]:
    """Of :func:`compare`'s mismatches: (first step, parameter names by step then size of the
    difference, the worst parameter at the first step, its mismatch)."""
    first = min(v["step"] for v in bad.values())
    names = sorted(bad, key=lambda n: (bad[n]["step"], -bad[n]["diff"]))
    worst = max((bad[n] for n in names if bad[n]["step"] == first), key=lambda v: v["diff"])
    return first, names, next(n for n in names if bad[n] is worst), worst


def _replicate(placements: list[str], dim: int | None) -> bool:
    """Whether a gradient's placements say Replicate along mesh dim ``dim`` (None: every dim)."""
    sel = placements if dim is None else placements[dim:dim + 1]
    return all(str(p).startswith(("Replicate", "R")) and not str(p).startswith("_") for p in sel)


def replica_findings(prints: Prints, rows: list[ParamRow], groups: list[list[int]],
                     skip: set[str] = frozenset(), existing: list[Finding] = ()) -> list[Finding]:
    """``REPLICA_DIVERGENCE`` per group of replicas whose fingerprints differ (one finding per
    group, its parameters listed; the rows of those parameters get a note); ``skip``: parameters
    not compared (DDP's ``parameters_to_ignore``); ``existing``: the report's findings so far — a
    silent ``READY_TWICE`` (a second accumulation that stayed local) already states the divergence
    of its parameters: it gets the measured size instead of a second finding."""
    out: list[Finding] = []
    for group in groups:
        bad = {n: v for n, v in compare(prints, group).items() if n not in skip}
        for f in existing:  # one fact, one finding: a divergence READY_TWICE already states gets its size
            if f.kind == "READY_TWICE" and f.raises_at is None and "silently diverge" in f.message \
                    and set(f.params) & set(bad):
                hit = sorted(set(f.params) & set(bad), key=lambda n: bad[n]["step"])
                v = bad[hit[0]]
                (na, _), (nb, _) = v["values"]
                f.message = f.message.rstrip().rstrip(".") + "." + (f" Measured: {hit[0]}'s {'gradient' if v['what'] == 'grad' else 'value'} differs "
                              f"between ranks {v['ranks'][0]} and {v['ranks'][1]} from step {v['step']} (norm "
                              f"{na:.4g} vs {nb:.4g}): the replicas train different models from step {v['step']}.")
                for n in hit:
                    del bad[n]
        if not bad:
            continue
        first, params, wname, worst = first_mismatch(bad)
        ra, rb = worst["ranks"]
        (na, wa), (nb, wb) = worst["values"]
        unsynced = sorted(set().union(*(prints.unsynced.get(r, set()) for r in group)))
        known = set().union(*(prints.synced_known.get(r, set()) for r in group))
        size = (f"{wname}'s {'gradient (as the optimizer consumed it)' if worst['what'] == 'grad' else 'parameter'}: "
                f"norm {na:.4g} on rank {ra} vs {nb:.4g} on rank {rb}, position-weighted sum {wa:.4g} vs {wb:.4g} "
                f"(difference {worst['diff']:.2g} of the norm)")
        agreed = [bad[n]["agreed"] for n in params if bad[n]["agreed"] is not None]
        since = f" (they agreed at step {max(agreed)})" if agreed and max(agreed) < first else ""
        msg = (f"the replicas on ranks {group} hold different values of {len(params)} parameter(s) "
               f"({', '.join(params[:6])}{' …' if len(params) > 6 else ''}) from step {first}{since}: {size}. "
               f"The data-parallel replicas train different models from step {first}; nothing raises and each "
               "rank's loss still looks right. ")
        cause_steps = [s for s in unsynced if s <= first]
        if unsynced:
            micro = _micro_text(prints, group, unsynced)
            msg += (f"Likely cause: the last backward before optimizer.step() ran under DDP's no_sync() at step(s) "
                    f"{_ranges(unsynced)}{micro}, so the optimizer consumed gradients that were never all-reduced"
                    + ("" if cause_steps else f" (the first of them after step {first}: an earlier unsynchronised "
                                               "step was not recorded)") + ".")
            fix = ("enter no_sync() only for the non-final micro-batches of an accumulation (e.g. `ctx = "
                   "model.no_sync() if i < accum_steps - 1 else contextlib.nullcontext()`), so the last backward "
                   "before optimizer.step() all-reduces the accumulated gradients on every step")
        elif known and worst["what"] == "grad":
            msg += ("Every backward before these steps was all-reduced by DDP (none under no_sync()): the gradient "
                    "was changed on one rank after DDP's reduction (a rank-local clip, scale or hook) or not "
                    "reduced by it at all.")
            fix = "change gradients only identically on every rank after the reduction, or before DDP reduces them"
        elif worst["what"] == "param":
            msg += ("Their gradients agree but their parameters differ: the replicas were already apart (they did "
                    "not start from the same values, or an update differs per rank, e.g. a rank-dependent learning "
                    "rate or a parameter changed outside the optimizer).")
            fix = ("start every replica from the same parameters (DDP broadcasts rank 0's at construction: change "
                   "none afterwards on one rank only) and update them identically")
        else:
            msg += "No DDP sync state was recorded: the gradient was not reduced across these ranks."
            fix = "reduce the gradient across the replicas before the optimizer step (wrap the model in DDP)"
        out.append(Finding(kind="REPLICA_DIVERGENCE", severity="error", message=msg, params=params,
                           ranks=list(group), fix=fix, raises_at=None))
        for r in rows:
            if r.fqn in bad and r.rank in group:
                r.notes.append(f"differs from its replicas on ranks {group} from step {bad[r.fqn]['step']}")
    return out


def _micro_text(prints: Prints, group: list[int], steps: list[int]) -> str:
    """`` (micro-batches of step 3: no_sync, no_sync, no_sync, no_sync)`` for the first such step."""
    for r in group:
        flags = prints.micro.get(r, {}).get(steps[0])
        if flags:
            words = ", ".join("reduced" if f else "no_sync" for f in flags[:16])
            return f" (its {len(flags)} backward(s) at step {steps[0]}: {words})"
    return ""


def coverage(prints: Prints, groups: list[list[int]]) -> dict:
    """What the replica check compared, for the report's coverage."""
    steps = sorted({s for g in groups for r in g for s in prints.values.get(r, {})})
    return {"groups": groups, "fingerprinted_steps": _ranges(steps) if steps else "",
            "unsynced_steps": {r: _ranges(s) for r, s in sorted(prints.unsynced.items()) if s}}


def replica_check(session: Session, run_id: int, report, wrap, *, ddp: bool) -> list[Finding]:
    """The replica findings of a run, its ``coverage["replicas"]`` set on ``report``
    (``wrap``: :class:`~graphdeck.analysis.gradients.mesh.Wrapping`). FSDP2 shards differ by
    design: without a recorded DDP group, an FSDP2 run's ranks are not compared."""
    prints = load(session, run_id)
    if not prints:
        return []
    layout = None if wrap.fsdp2 else wrap.layout
    if not prints.groups and layout is not None:
        _drop_sharded(prints, layout)
    groups = peer_groups(prints, layout, ddp=ddp and not wrap.fsdp2)
    report.coverage["replicas"] = coverage(prints, groups)
    out = replica_findings(prints, report.rows, groups, skip=prints.ignored, existing=report.findings)
    if wrap.layout is not None:
        from graphdeck.analysis.gradients.replicas_tp import tp_findings

        out += tp_findings(prints, report, wrap.layout)
    return out


def _drop_sharded(prints: Prints, layout) -> None:
    """Leave out DTensor parameters a placement shards (their local shards differ by design)."""
    for rank, steps in prints.values.items():
        for v in steps.values():
            keep = [i for i, n in enumerate(v["names"])
                    if not any(str(p).startswith(("Shard", "S(", "_S")) for p in layout.placements(n, rank) or [])]
            if len(keep) < len(v["names"]):
                v["names"] = [v["names"][i] for i in keep]
                v["dtypes"] = [v["dtypes"][i] for i in keep if i < len(v["dtypes"])]
                for what in ("grad", "param"):
                    if v.get(what):
                        v[what] = [v[what][i] for i in keep if i < len(v[what])]
