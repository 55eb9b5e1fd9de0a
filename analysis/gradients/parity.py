"""Reference parity: one optimizer step of a sharded run against its unsharded reference
(``graphdeck parity``; the evidence is NOTE: [Parity evidence] in capture/parity.py).

Per watched parameter the sharded gradient is made whole from every rank's local tensor and its
recorded placements (``Shard``: placed at the shard's global offset; ``Partial``: summed, or
averaged; ``Replicate``: one copy; a plain tensor: one copy when every rank holds the same value)
and compared with the reference's. The backward nodes of the two runs are matched as the numeric
mode matches a compiled backward to eager: by what they are — here the autograd node names in
execution order, aligned (``difflib``) after dropping the nodes only a sharded graph has
(redistributions, ``from_local``/``to_local``) — and the first node of the reference's order
whose computed gradient differs is named, with the forward line that made it and whether the
gradient it received still matched (then the difference starts at that node).

Tolerance by dtype (the value's dtype in the run): ``max|sharded - reference| <= atol + rtol *
max|reference|`` with ``TOLERANCE`` (float64 rtol 1e-7, float32 1e-4, float16 2e-3, bfloat16
1.6e-2; atol 1e-12 / 1e-7 / 1e-6 / 1e-5): a sharded step reduces in another order than the
unsharded one, so bit-equality is not expected.

Verdict: FAIL when a parameter's gradient differs (or exists in one run only); INCOMPLETE when a
run carries no parity evidence, the runs recorded different steps, or a parameter could not be
compared (missing from a run, stored as a norm only: over the element cap, a placement that
cannot be made whole); PASS when every parameter was compared and agrees. The node
localisation explains a FAIL; it never decides the verdict.
"""

from __future__ import annotations

import base64
import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

EVENT = "graphdeck_parity"
TOLERANCE = {"float64": (1e-7, 1e-12), "float32": (1e-4, 1e-7), "float16": (2e-3, 1e-6),
             "bfloat16": (1.6e-2, 1e-5)}
# Autograd nodes that only a sharded graph has: skipped when the two backward orders are aligned.
_SHARDING_NODES = re.compile(r"Redistribute|FromTorchTensor|ToTorchTensor|AllGather|AllReduce|ReduceScatter"
                             r"|AllToAll|Broadcast|Wait|AccumulateGrad")
_LOSS_PARALLEL_NODES = {"LogSoftmaxBackward0", "NllLossBackward0", "NllLoss2DBackward0"}


def tolerance(dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` for a dtype name (float32's for one not listed)."""
    return TOLERANCE.get(dtype, TOLERANCE["float32"])


@dataclass
class ParamParity:
    """One parameter: ``status`` MATCH, DIFFER, NOT_COMPARED or MISSING; ``diff`` max
    ``|sharded - reference|`` and ``scale`` max ``|reference|`` (float, the gradient's units)."""

    name: str
    status: str
    dtype: str | None = None
    shape: list[int] | None = None
    placements: list[str] | None = None
    diff: float | None = None
    scale: float | None = None
    reason: str = ""


@dataclass
class NodeParity:
    """The first backward node whose computed gradient differs (``index``: position in the
    reference's execution order of backward ``backward``; ``of``: nodes in that backward)."""

    backward: int
    index: int
    of: int
    name: str
    source: str | None
    diff: float
    scale: float
    incoming: str  # "match" | "differ" | "not compared"
    unmatched_before: int  # reference nodes before it that could not be compared
    unmatched_nodes: list[str] = field(default_factory=list)  # the first of them: "Name (file:line)"

    def meaning(self) -> str:
        """What ``incoming`` says about where the difference starts (one sentence, shown by the
        text, the JSON's ``first_node.meaning`` and the page alike)."""
        if self.incoming == "match":
            return ("the gradient it receives matches the reference's and the one it computes does not: "
                    "the difference starts at this node")
        if self.incoming == "differ":
            return ("the gradient it receives already differs: the difference starts before it"
                    + (", among the nodes that could not be compared" if self.unmatched_before else ""))
        return "the gradient it receives could not be compared"


@dataclass
class ParityReport:
    run_a: str
    run_b: str
    verdict: str = "INCOMPLETE"
    step: int | None = None
    worlds: tuple[int | None, int | None] = (None, None)
    params: list[ParamParity] = field(default_factory=list)
    loss: dict | None = None
    first_node: NodeParity | None = None
    nodes_compared: int = 0
    notes: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    fix: str | None = None

    def consequence(self) -> str | None:
        """The FAIL told in the job's terms (None unless FAIL)."""
        if self.verdict != "FAIL":
            return None
        bad = [p.name for p in self.params if p.status == "DIFFER"]
        loss_ok = bool(self.loss) and self.loss["status"] == "MATCH"
        return (f"the sharded job does not train the model the unsharded one trains (gradients of "
                f"{', '.join(bad)} differ at step {self.step})" + ("; its loss still looks right" if loss_ok else ""))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["consequence"] = self.consequence()
        if self.first_node is not None:
            d["first_node"]["meaning"] = self.first_node.meaning()
        d["tolerance"] = {k: {"rtol": r, "atol": a} for k, (r, a) in TOLERANCE.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        from graphdeck.analysis.gradients.parity_text import render

        return render(self)


# ---------------------------------------------------------------------------------- loading
def load_evidence(session, run) -> dict[int, dict]:
    """``rank -> payload`` of ``run``'s parity records (the last one per rank)."""
    from sqlalchemy import select

    from graphdeck.store.schema import CompileEvent

    out: dict[int, dict] = {}
    rows = session.execute(select(CompileEvent.rank, CompileEvent.payload)
                           .where(CompileEvent.run_id == run.id, CompileEvent.name == EVENT)
                           .order_by(CompileEvent.id)).all()
    for rank, payload in rows:
        try:
            out[int(rank)] = json.loads(payload or "{}")
        except ValueError:
            continue
    return out


def _tensor(rec: dict):
    """A record's stored values as a numpy array of the local shape (float32, or float64)."""
    import numpy as np

    dt = np.float64 if rec.get("vdtype") == "float64" else np.float32
    arr = np.frombuffer(base64.b64decode(rec["data"]), dtype=dt).copy()
    return arr.reshape(rec.get("local") or rec["shape"])


_SHARD = re.compile(r"^Shard\(dim=(-?\d+)\)$")


def assemble(recs: list[dict | None]) -> tuple[Any, str]:
    """The whole value of one gradient from every rank's record of it: ``(numpy array, "")``,
    ``(None, "none")`` when no rank has a gradient, else ``(None, why it cannot be made whole)``.
    numpy only: the analysis runs where torch is not installed (the server)."""
    import numpy as np

    present = [r for r in recs if r is not None]
    if not present:
        return None, "none"
    if len(present) != len(recs):
        return None, "a gradient on some ranks only"
    if any("data" not in r for r in present):
        return None, (f"values not stored (over the element cap; {present[0].get('local') or present[0]['shape']} "
                      "local elements): compared by norm only")
    if present[0].get("place") is None:
        vals = [_tensor(r) for r in present]
        rtol, atol = tolerance(present[0]["dtype"])
        if all(v.shape == vals[0].shape and _diff(v, vals[0]) <= atol + rtol * _amax(vals[0]) for v in vals[1:]):
            return vals[0], ""
        return None, "a plain tensor that differs between ranks (rank-local, no placement says how to combine it)"
    mesh = present[0]["mesh"]
    places = present[0]["place"]
    kinds = []
    for p in places:
        m = _SHARD.match(p)
        if m or p == "Replicate()" or p in ("Partial(sum)", "Partial(avg)"):
            kinds.append(p)
        else:
            return None, f"placement {p} is not made whole by graphdeck"
    full = np.zeros(present[0]["shape"], dtype=_tensor(present[0]).dtype)
    seen: set[tuple] = set()
    for r in present:
        coord = tuple(r.get("coord") or ())
        if len(coord) != len(mesh) or r.get("place") != places or coord in seen:
            continue  # not in the mesh, or a replica of this coordinate on another mesh
        if any(k == "Replicate()" and c != 0 for k, c in zip(kinds, coord)):
            continue
        seen.add(coord)
        local = _tensor(r)
        idx = tuple(slice(o, o + s) for o, s in zip(r["offset"], local.shape))
        full[idx] += local
    need = 1
    for k, n in zip(kinds, mesh):
        need *= 1 if k == "Replicate()" else n
    if len(seen) != need:
        return None, f"{len(seen)} of the {need} shards recorded"
    for k, n in zip(kinds, mesh):
        if k == "Partial(avg)":
            full /= n
    return full, ""


def whole_norm(recs: list[dict | None]) -> float | None:
    """The L2 norm of the whole value from the ranks' local norms, where placements allow it
    (plain replicas, ``Shard``/``Replicate``; not ``Partial``); None otherwise."""
    present = [r for r in recs if r is not None]
    if not present or len(present) != len(recs) or any(r.get("norm") is None for r in present):
        return None
    places = present[0].get("place")
    if places is None:
        norms = [r["norm"] for r in present]
        return norms[0] if max(norms) - min(norms) <= 1e-6 * max(max(norms), 1e-30) else None
    if any(not (_SHARD.match(p) or p == "Replicate()") for p in places):
        return None
    seen, total = set(), 0.0
    for r in present:
        coord = tuple(r.get("coord") or ())
        if len(coord) != len(places) or coord in seen or any(p == "Replicate()" and c != 0
                                                             for p, c in zip(places, coord)):
            continue
        seen.add(coord)
        total += r["norm"] ** 2
    need = 1
    for p, n in zip(places, present[0].get("mesh") or ()):
        need *= 1 if p == "Replicate()" else n
    return total ** 0.5 if len(seen) == need else None


def _amax(t) -> float:
    return float(abs(t).max()) if t.size else 0.0


def _diff(a, b) -> float:
    import numpy as np

    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0


def compare(recs_a: list[dict | None], rec_b: list[dict | None]) -> tuple[str, float | None, float | None, str]:
    """``(status, diff, scale, reason)`` of one value: sharded records of every rank against the
    reference's. Status MATCH, DIFFER or NOT_COMPARED."""
    a, why_a = assemble(recs_a)
    b, why_b = assemble(rec_b)
    if why_a == "none" and why_b == "none":
        return "MATCH", 0.0, 0.0, "no gradient in either run"
    if why_a == "none" or why_b == "none":
        if (a if why_b == "none" else b) is None:
            return "NOT_COMPARED", None, None, why_a or why_b
        return "DIFFER", None, None, f"a gradient in the {'reference' if why_a == 'none' else 'sharded'} run only"
    if a is None or b is None:
        why = f"{'sharded' if a is None else 'reference'}: {why_a or why_b}"
        na, nb = whole_norm(recs_a), whole_norm(rec_b)
        if na is not None and nb is not None:
            rtol, atol = tolerance(next(r for r in rec_b if r is not None)["dtype"])
            if abs(na - nb) > atol + rtol * nb:
                return "DIFFER", None, nb, f"norms differ: sharded {na:.6g}, reference {nb:.6g} ({why})"
            why += f"; the norms agree ({nb:.6g})"
        return "NOT_COMPARED", None, None, why
    if tuple(a.shape) != tuple(b.shape):
        return "NOT_COMPARED", None, None, f"shapes differ: sharded {list(a.shape)}, reference {list(b.shape)}"
    rec = next(r for r in rec_b if r is not None)
    rtol, atol = tolerance(rec["dtype"])
    diff, scale = _diff(a, b), _amax(b)
    return ("MATCH" if diff <= atol + rtol * scale else "DIFFER"), diff, scale, ""


# ---------------------------------------------------------------------------------- the report
def parity_report(session, run_a, run_b) -> ParityReport:
    """Compare the sharded run ``run_a`` with the reference ``run_b`` (store ``Run`` rows)."""
    rep = ParityReport(run_a=run_a.name, run_b=run_b.name)
    ev_a, ev_b = load_evidence(session, run_a), load_evidence(session, run_b)
    for name, ev in ((run_a.name, ev_a), (run_b.name, ev_b)):
        if not ev:
            rep.incomplete.append(f"run {name!r} has no parity evidence (run it under `graphdeck parity`, or with "
                                  "GRAPHDECK_PARITY=STEP)")
    if rep.incomplete:
        return rep
    first_a, first_b = ev_a[min(ev_a)], ev_b[min(ev_b)]
    rep.worlds = (first_a.get("world"), first_b.get("world"))
    rep.step = first_a.get("step")
    if first_a.get("step") != first_b.get("step"):
        rep.incomplete.append(f"the runs recorded different optimizer steps ({first_a.get('step')} and "
                              f"{first_b.get('step')}): their gradients are not the same step's")
        return rep
    world_a = first_a.get("world") or len(ev_a)
    if len(ev_a) < world_a:
        rep.incomplete.append(f"run {run_a.name!r}: parity records of {len(ev_a)} of {world_a} ranks "
                              f"(missing: {sorted(set(range(world_a)) - set(ev_a))})")
    if (first_b.get("world") or 1) > 1:
        rep.notes.append(f"the reference {run_b.name!r} ran at world size {first_b.get('world')}: it is itself "
                         "sharded (its gradients are made whole the same way)")
    for ev, name in ((ev_a, run_a.name), (ev_b, run_b.name)):
        if any(p.get("at") == "exit" for p in ev.values()):
            rep.notes.append(f"run {name!r}: no optimizer step {rep.step} was seen; gradients read at exit")
    ranks_a, ranks_b = [ev_a[r] for r in sorted(ev_a)], [ev_b[r] for r in sorted(ev_b)]
    _params(rep, ranks_a, ranks_b)
    _loss(rep, ranks_a, ranks_b)
    if any(p.status == "DIFFER" for p in rep.params):
        _first_node(rep, ranks_a, ranks_b)
    rep.verdict = ("FAIL" if any(p.status == "DIFFER" for p in rep.params)
                   else "INCOMPLETE" if rep.incomplete or any(p.status != "MATCH" for p in rep.params) or not rep.params
                   else "PASS")
    if not rep.params:
        rep.incomplete.append("no watched trainable parameter in the runs (call agent.watch(model))")
    return rep


def _params(rep: ParityReport, ranks_a: list[dict], ranks_b: list[dict]) -> None:
    names = list(dict.fromkeys([n for p in ranks_a for n in p.get("params", {})]
                               + [n for p in ranks_b for n in p.get("params", {})]))
    for name in names:
        recs_a = [p.get("params", {}).get(name, "absent") for p in ranks_a]
        recs_b = [p.get("params", {}).get(name, "absent") for p in ranks_b]
        any_rec = next((r for r in recs_b + recs_a if isinstance(r, dict)), None)
        row = ParamParity(name=name, status="MISSING", dtype=any_rec and any_rec["dtype"],
                          shape=any_rec and any_rec["shape"],
                          placements=next((r.get("place") for r in recs_a if isinstance(r, dict)), None))
        if "absent" in recs_a or "absent" in recs_b:
            row.reason = f"not a watched parameter of the {'sharded' if 'absent' in recs_a else 'reference'} run"
            rep.incomplete.append(f"{name}: {row.reason}")
        else:
            row.status, row.diff, row.scale, row.reason = compare(recs_a, recs_b)
            if row.status == "NOT_COMPARED":
                rep.incomplete.append(f"{name}: {row.reason}")
        rep.params.append(row)


def _loss(rep: ParityReport, ranks_a: list[dict], ranks_b: list[dict]) -> None:
    roots_a = [(p.get("backwards") or [{}])[0].get("root") for p in ranks_a]
    roots_b = [(p.get("backwards") or [{}])[0].get("root") for p in ranks_b]
    if not any(roots_a) or not any(roots_b):
        rep.notes.append("no backward of the step was recorded in one run: no loss or node comparison")
        return
    a, _ = assemble(roots_a)
    b, _ = assemble(roots_b)
    status, diff, scale, why = compare(roots_a, roots_b)
    rep.loss = {"status": status, "diff": diff, "sharded": _scalar(a), "reference": _scalar(b), "reason": why}
    if a is None and all(r is not None and r.get("place") is None and "data" in r for r in roots_a):
        per_rank = [_scalar(_tensor(r)) for r in roots_a]
        if all(v is not None for v in per_rank):  # data parallel: each rank's loss of its own batch
            rep.loss["per_rank"] = per_rank
            rep.loss["reason"] = ("each rank's loss is its own (data parallel: each rank its own batch); the "
                                  "gradients, reduced across ranks, are compared")


def _scalar(t) -> float | None:
    return float(t.reshape(-1)[0]) if t is not None and t.size == 1 else None


def _first_node(rep: ParityReport, ranks_a: list[dict], ranks_b: list[dict]) -> None:
    """The first reference-order backward node whose computed gradient differs (module doc)."""
    nb = min(min(len(p.get("backwards") or []) for p in ranks_a), len(ranks_b[0].get("backwards") or []))
    if nb == 0:
        return
    for bi in range(nb):
        nodes_a = [p["backwards"][bi]["nodes"] for p in ranks_a]
        nodes_b = ranks_b[0]["backwards"][bi]["nodes"]
        names_a = [n["name"] for n in nodes_a[0]]
        if any([n["name"] for n in other] != names_a for other in nodes_a[1:]):
            rep.notes.append(f"backward {bi}: the ranks of the sharded run ran different backward nodes; "
                             "nodes not compared")
            continue
        keep_a = [i for i, n in enumerate(names_a) if not _SHARDING_NODES.search(n)]
        keep_b = [i for i, n in enumerate(nodes_b) if not _SHARDING_NODES.search(n["name"])]
        sm = difflib.SequenceMatcher(None, [names_a[i] for i in keep_a], [nodes_b[i]["name"] for i in keep_b],
                                     autojunk=False)
        pairs = {keep_b[j + k]: keep_a[i + k] for i, j, n in sm.get_matching_blocks() for k in range(n)}
        unmatched: list[str] = []
        for ib, node_b in enumerate(nodes_b):
            if _SHARDING_NODES.search(node_b["name"]):
                continue
            ia = pairs.get(ib)
            status, diff, scale = _node_status(nodes_a, ia, node_b, "grad") if ia is not None else ("NOT_COMPARED",
                                                                                                    None, None)
            if status == "NOT_COMPARED":
                unmatched.append(node_b["name"] + (f" ({node_b['source']})" if node_b.get("source") else ""))
                continue
            rep.nodes_compared += 1
            if status == "DIFFER":
                incoming = _node_status(nodes_a, ia, node_b, "incoming")[0]
                rep.first_node = NodeParity(backward=bi, index=ib, of=len(nodes_b), name=node_b["name"],
                                            source=node_b.get("source"), diff=diff, scale=scale,
                                            incoming={"MATCH": "match", "DIFFER": "differ"}.get(incoming,
                                                                                                "not compared"),
                                            unmatched_before=len(unmatched), unmatched_nodes=unmatched[:8])
                rep.fix = _fix(rep.first_node, rep.loss)
                return


def _node_status(nodes_a: list[list[dict]], ia: int, node_b: dict, key: str) -> tuple[str, float | None, float | None]:
    """DIFFER when a compared slot differs, MATCH when one was compared and none differs."""
    slots_b = node_b.get(key) or []
    worst: tuple[str, float | None, float | None] = ("NOT_COMPARED", None, None)
    for j, rb in enumerate(slots_b):
        recs_a = [ranks[ia].get(key, [])[j] if j < len(ranks[ia].get(key, [])) else None for ranks in nodes_a]
        if rb is None and all(r is None for r in recs_a):
            continue
        status, diff, scale, _ = compare(recs_a, [rb])
        if status == "DIFFER":
            if worst[0] != "DIFFER" or (diff or 0) > (worst[1] or 0):
                worst = (status, diff, scale)
        elif status == "MATCH" and worst[0] == "NOT_COMPARED":
            worst = (status, diff, scale)
    return worst


def _fix(node: NodeParity, loss: dict | None) -> str:
    """What to change, from where the difference starts (the node, or before it) and the loss."""
    starts_here = node.incoming == "match"
    if starts_here and node.name == "CompiledFunctionBackward":
        return ("the difference is made inside a compiled region's backward (torch.compile): autograd sees the "
                "region as one node. Run the pair with the model eager (without torch.compile) to name the node "
                "inside it; when eager agrees and compiled does not, `graphdeck check-grads --numeric` names the "
                "compiled node at fault")
    if starts_here and node.name in _LOSS_PARALLEL_NODES:
        return ("under loss_parallel() only F.cross_entropy / F.nll_loss on the vocab-sharded log_softmax get a right "
                "gradient: loss_parallel's log_softmax backward returns the incoming gradient unchanged, relying on "
                "nll_loss's backward to apply the softmax Jacobian (pytorch/pytorch#190746). Compute the per-token "
                "loss with F.cross_entropy(..., reduction='none') and weight it, or make the logits whole "
                "(redistribute to Replicate) before a hand-written loss")
    hint = ("a reduction or normalisation over a sharded dimension done on the local slice (a logsumexp, softmax, "
            "mean or max after to_local()), a to_local() without grad_placements, or a rank-local constant")
    if starts_here:
        return f"the node computes another gradient when sharded: look at its forward line for {hint}"
    where = ("the forward already computes another loss, so " if loss and loss.get("status") == "DIFFER" else "")
    start = "before this node" if node.incoming == "differ" else "at this node or before it"
    before = (", where values are rank-local and were not compared: look at those nodes' forward lines"
              if node.unmatched_before else ": look at the forward lines")
    return (f"{where}the difference starts {start}{before} for {hint}; under loss_parallel() use F.cross_entropy "
            "on the sharded logits")
