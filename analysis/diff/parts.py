"""The sections of a run diff other than timing: compile records, graph structure, memory, rank
consistency and gradient paths (NOTE: [Run diff] in graphdeck/analysis/diff/runs.py). Each
function adds findings through ``add`` and records its section's status in ``out.sections``."""

from __future__ import annotations

import difflib
from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import _args_shape, _node_key, _node_rows, _ref
from graphdeck.errors import GraphdeckError
from graphdeck.store.schema import Graph, Run

AOT = ("aot_forward", "aot_backward", "aot_inference")


# ---------------------------------------------------------------------------- compile records


def compile_findings(sa: Session, run_a: Run, sb: Session, run_b: Run, out, add,
                     partner: dict[tuple[int, int], int]) -> dict[int, list[int]]:
    """New / removed user-code graph breaks (by reason class and source line) and new recompiles
    (per frame: more recompiles in B, the guards failing only in B). Returns ``{rank: [finding
    ids]}`` of new breaks and recompiles, for ``follows_from``."""
    from graphdeck.analysis.compilation.health import compile_health

    ha, hb = compile_health(sa, run_a), compile_health(sb, run_b)
    missing = [f"run A: {m}" for m in ha.missing_evidence] + [f"run B: {m}" for m in hb.missing_evidence]
    out.sections["compile"] = ({"status": "INCOMPLETE", "why": "; ".join(missing)} if missing else
                               {"status": "compared", "why": f"{len(ha.breaks)} / {len(hb.breaks)} break group(s), "
                                f"{len(ha.frames)} / {len(hb.frames)} frame(s) in A / B"})
    by_rank: dict[int, list[int]] = defaultdict(list)
    key = lambda g: (g.reason_class, g.source_line)  # noqa: E731
    user_a = {key(g): g for g in ha.breaks if not g.library}
    user_b = {key(g): g for g in hb.breaks if not g.library}
    cids_b = _dynamo_by_cid(sb, run_b.id)
    cids_a = _dynamo_by_cid(sa, run_a.id)
    for k, g in user_b.items():
        if k in user_a:
            continue
        links = [{"a": partner.get((1, gid)), "b": gid} for gid in _break_graphs(g, cids_b)]
        f = add("new_graph_break", f"new graph break at {g.source_line or '(no source line)'}: {g.headline}",
                ranks=g.ranks, links=links,
                detail={"reason_class": g.reason_class, "source_line": g.source_line, "hint": g.hint,
                        "user_frame": g.user_frame, "frames": g.frames, "compile_ids": g.compile_ids,
                        "records": g.count, "count": 1})
        for r in g.ranks:
            by_rank[r].append(f.id)
    for k, g in user_a.items():
        if k not in user_b:
            add("removed_graph_break", f"graph break gone from {g.source_line or '(no source line)'}: {g.headline}",
                ranks=g.ranks, improvement=True,
                links=[{"a": gid, "b": partner.get((0, gid))} for gid in _break_graphs(g, cids_a)],
                detail={"reason_class": g.reason_class, "source_line": g.source_line})
    frames_a = {f.frame: f for f in ha.frames}
    for fb in hb.frames:
        fa = frames_a.get(fb.frame)
        before = fa.recompiles if fa else 0
        if fb.recompiles <= before:
            continue
        old = {x["guard"] for x in (fa.guards if fa else [])}
        new_guards = [x for x in fb.guards if x["guard"] not in old]
        r0 = fb.ranks[0] if fb.ranks else 0
        gids = [cids_b.get((r0, st.get("compile_id"))) for st in fb.steps]
        f = add("new_recompiles", f"frame {fb.frame} recompiles {fb.recompiles} time(s), was {before}"
                + (f"; failing guard: {new_guards[0]['guard']}" if new_guards else ""),
                ranks=fb.ranks, links=[{"a": partner.get((1, g)), "b": g} for g in gids if g is not None][:4],
                detail={"frame": fb.frame, "before": before, "after": fb.recompiles,
                                        "added": fb.recompiles - before, "new_guards": new_guards,
                                        "limit": fb.limit, "limit_hit": fb.limit_hit, "hint": fb.hint})
        for r in fb.ranks:
            by_rank[r].append(f.id)
    for fa in ha.frames:
        if fa.recompiles and fa.frame not in {f.frame for f in hb.frames if f.recompiles >= fa.recompiles}:
            after = next((f.recompiles for f in hb.frames if f.frame == fa.frame), 0)
            add("fewer_recompiles", f"frame {fa.frame} recompiles {after} time(s), was {fa.recompiles}",
                ranks=fa.ranks, improvement=True, detail={"frame": fa.frame, "before": fa.recompiles, "after": after})
    return by_rank


def _break_graphs(g, cids: dict[tuple[int, str], int]) -> list[int]:
    """Dynamo graphs of a break group's compiles (``"rank:compile id"``), first rank only."""
    out = []
    for item in g.compile_ids:
        r, _, cid = item.partition(":")
        gid = cids.get((int(r), cid)) if r.isdigit() else None
        if gid is not None and (not out or int(r) == g.ranks[0]):
            out.append(gid)
    return out[:4]


def _dynamo_by_cid(s: Session, run_id: int) -> dict[tuple[int, str], int]:
    got: dict[tuple[int, str], int] = {}
    for gid, r, cid in s.execute(select(Graph.id, Graph.rank, Graph.compile_id).where(
            Graph.run_id == run_id, Graph.kind == "dynamo").order_by(Graph.ordinal)):
        got.setdefault((r, cid), gid)
    return got


# ---------------------------------------------------------------------------- structure


def first_difference(sa: Session, ga: int, sb: Session, gb: int) -> tuple:
    """:func:`graphdeck.analysis.ranks.core.first_node_difference` for graphs of two sessions: ``(node
    of a, node of b, "added" | "removed" | "changed")`` or ``(None, None, None)``."""
    rows_a, rows_b = _node_rows(sa, ga), _node_rows(sb, gb)
    keys_a = [(*_node_key(r), _args_shape(r)) for r in rows_a]
    keys_b = [(*_node_key(r), _args_shape(r)) for r in rows_b]
    for tag, i1, _i2, j1, _j2 in difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        ref_a = _ref(ga, rows_a[i1]) if tag != "insert" and i1 < len(rows_a) else None
        ref_b = _ref(gb, rows_b[j1]) if tag != "delete" and j1 < len(rows_b) else None
        return ref_a, ref_b, {"insert": "added", "delete": "removed"}.get(tag, "changed")
    return None, None, None


def _describe(ref) -> str:
    if ref is None:
        return "-"
    return (f"{ref.name} = {ref.target} {ref.shape or ''} {ref.dtype or ''}".rstrip()
            + (f" [{ref.module_path}]" if ref.module_path else "") + (f" at {ref.source}" if ref.source else ""))


def structure_findings(sa: Session, sb: Session, joins: dict, out, add, compile_ids: dict[int, list[int]],
                       regressions: dict[tuple[int, int], int]) -> dict[int, list[int]]:
    """``structure_changed`` / ``new_graph`` / ``removed_graph`` findings, merged over ranks when
    identical; a graph whose parent (the Dynamo graph it was split or traced from) is itself
    changed, new or removed is not reported again. Returns ``{rank: [finding ids]}``."""
    groups: dict[tuple, dict] = {}
    for r, j in joins.items():
        ra, rb = j["rows_a"], j["rows_b"]
        touched_a = {a for a, _, how in j["pairs"] if how == "changed"} | set(j["removed"])
        touched_b = {b for _, b, how in j["pairs"] if how == "changed"} | set(j["added"])

        def regressed(side: int, gid: int, rows: dict) -> list[int]:
            kids = [g for g, v in rows.items() if v[3] == gid] + [gid]
            return [regressions[(side, g)] for g in kids if (side, g) in regressions]

        items = []
        for a, b, how in j["pairs"]:
            if how != "changed" or (ra[a][3] in touched_a and rb[b][3] in touched_b):
                continue
            na, nb, change = first_difference(sa, a, sb, b)
            where = _describe(nb if nb is not None else na)
            msg = (f"{rb[b][0]} graph '{rb[b][5]}' ({rb[b][4] or '?'}) changed: first {change or 'difference'} node "
                   f"{where}")
            items.append(("structure_changed", msg, {"a": a, "b": b, "node_a": na and na.name, "node_b": nb and nb.name},
                          {"change": change, "node_a": na and na.__dict__, "node_b": nb and nb.__dict__,
                           "kind": rb[b][0]}, regressed(0, a, ra) + regressed(1, b, rb)))
        for b in j["added"]:
            if rb[b][3] in touched_b:
                continue
            items.append(("new_graph", f"new {rb[b][0]} graph '{rb[b][5]}' ({rb[b][4] or '?'})", {"a": None, "b": b},
                          {"kind": rb[b][0], "compile_id": rb[b][2]}, regressed(1, b, rb)))
        for a in j["removed"]:
            if ra[a][3] in touched_a:
                continue
            items.append(("removed_graph", f"{ra[a][0]} graph '{ra[a][5]}' ({ra[a][4] or '?'}) is gone", {"a": a, "b": None},
                          {"kind": ra[a][0], "compile_id": ra[a][2]}, regressed(0, a, ra)))
        for kind, msg, link, detail, follows in items:
            g = groups.setdefault((kind, msg), {"ranks": [], "links": [], "detail": detail, "follows": set()})
            g["ranks"].append(r)
            g["links"].append(link)
            g["follows"].update(follows + compile_ids.get(r, []))
    by_rank: dict[int, list[int]] = defaultdict(list)
    for (kind, msg), g in groups.items():
        f = add(kind, msg, ranks=g["ranks"], links=g["links"], detail=g["detail"], follows_from=g["follows"])
        for r in g["ranks"]:
            by_rank[r].append(f.id)
    total = {k: sum(j["counts"][k] for j in joins.values()) for k in ("same", "changed", "added", "removed")}
    out.sections["graphs"] = ({"status": "compared", "why": ", ".join(f"{v} {k}" for k, v in total.items())}
                              if joins else {"status": "INCOMPLETE", "why": "no rank in both runs"})
    return by_rank


# ---------------------------------------------------------------------------- memory


def _rank_memory(s: Session, run_id: int, rank: int, cache: dict) -> dict | None:
    from graphdeck.analysis.memory.core import step_memory

    rows = s.execute(select(Graph.id, Graph.kind, Graph.parent_id, Graph.compile_id, Graph.structural_hash).where(
        Graph.run_id == run_id, Graph.rank == rank, Graph.kind.in_(("aot_forward", "aot_backward")))
        .order_by(Graph.ordinal)).all()
    bwd = {(g.parent_id, g.compile_id): g for g in rows if g.kind == "aot_backward"}
    best, saved, pairs = None, 0, 0
    for fw in (g for g in rows if g.kind == "aot_forward"):
        bw = bwd.get((fw.parent_id, fw.compile_id))
        if bw is None:
            continue
        key = (fw.structural_hash, bw.structural_hash) if fw.structural_hash and bw.structural_hash else (fw.id, bw.id)
        if key not in cache:
            curve = step_memory(s, fw.id, bw.id)
            cache[key] = (curve.peak_bytes, sum(x["size_bytes"] for x in curve.saved), curve.peak_node)
        peak, sv, node = cache[key]
        pairs += 1
        saved += sv
        if best is None or peak > best["peak_bytes"]:
            best = {"peak_bytes": peak, "peak_node": node, "forward": fw.id, "backward": bw.id}
    return None if best is None else {**best, "saved_bytes": saved, "pairs": pairs}


def memory_findings(sa, run_a, sb, run_b, ranks, out, add, structure_ids: dict[int, list[int]]) -> None:
    """Per rank: the largest step peak over the forward/backward pairs and the saved bytes summed
    over them (graph-derived, :func:`graphdeck.analysis.memory.core.step_memory`)."""
    ca, cb, missing, groups = {}, {}, [], {}
    for r in ranks:
        try:
            ma, mb = _rank_memory(sa, run_a.id, r, ca), _rank_memory(sb, run_b.id, r, cb)
        except GraphdeckError as exc:
            missing.append(f"rank {r}: {exc.message}")
            continue
        if ma is None or mb is None:
            missing.append(f"rank {r}: no forward/backward graph pair in run {'A' if ma is None else 'B'}")
            continue
        out.memory[str(r)] = {"a": ma, "b": mb}
        for what, kind in (("peak_bytes", "peak_memory"), ("saved_bytes", "saved_activations")):
            va, vb = ma[what], mb[what]
            if va == vb:
                continue
            pct = round(100.0 * (vb - va) / va, 1) if va else None
            label = "graph-derived step peak" if kind == "peak_memory" else "activations saved for backward"
            msg = f"{label} {va} -> {vb} bytes ({'+' if vb > va else ''}{vb - va} bytes" + (f", {pct:+}%)" if pct is not None else ")")
            g = groups.setdefault((kind, msg, vb < va), {"ranks": [], "links": [], "pct": pct})
            g["ranks"].append(r)
            g["links"].append({"a": ma["forward"], "b": mb["forward"]})
    for (kind, msg, better), g in groups.items():
        follows = [i for r in g["ranks"] for i in structure_ids.get(r, [])]
        add(kind, msg, ranks=g["ranks"], links=g["links"], detail={"pct": g["pct"]}, follows_from=follows,
            improvement=better)
    out.sections["memory"] = ({"status": "INCOMPLETE", "why": "; ".join(missing)} if missing or not out.memory else
                              {"status": "compared", "why": "largest step peak and saved bytes per rank"})


# ---------------------------------------------------------------------------- ranks and gradients


def _uniform(s: Session, run: Run) -> bool:
    """True when nothing can diverge across the run's ranks: every rank compiled the same
    sequence (compile ids, graph kinds and structural hashes, failures), has the same DDP
    buckets, and the run has neither a parallel layout (ranks that differ by design) nor Flight
    Recorder dumps (recorded collectives to compare). Then :func:`rank_report` (which also reads
    every trace for timing) is not needed to know it finds no divergence."""
    from graphdeck.analysis.parallel.layout import load_layout
    from graphdeck.analysis.ranks.core import compile_sequence
    from graphdeck.store.fr_import import EVENT_NAME
    from graphdeck.store.schema import CompileEvent, Partition

    ranks = sorted(set(s.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct())))
    if len(ranks) < 2:
        return True
    if s.scalar(select(CompileEvent.id).where(CompileEvent.run_id == run.id, CompileEvent.name == EVENT_NAME).limit(1)):
        return False
    if load_layout(s, run.id) is not None:
        return False
    sigs = {tuple(e.signature()[1:] for e in compile_sequence(s, run.id, r)) for r in ranks}
    if len(sigs) != 1:
        return False
    buckets = defaultdict(list)
    for r, i, size in s.execute(select(Partition.rank, Partition.index, Partition.size_bytes)
                                .where(Partition.run_id == run.id).order_by(Partition.rank, Partition.index)):
        buckets[r].append((i, size))
    return len({tuple(buckets.get(r, [])) for r in ranks}) == 1


def _divergences(s: Session, run: Run) -> dict[tuple, dict]:
    from graphdeck.analysis.ranks.core import rank_report

    if _uniform(s, run):
        return {}
    rep = rank_report(s, run)
    got = {}
    for d in rep.divergences:
        if d.harmless:
            continue
        node = d.node
        got[("divergence", d.what, d.compile_id, d.kind, node and node.target, node and node.module_path)] = {
            "message": d.message, "ranks": d.ranks, "graph": d.graph_id, "reference_graph": d.reference_graph_id}
    for m in rep.collective_mismatches:
        got[("collective", m.index, m.message)] = {"message": m.message, "ranks": [], "graph": None,
                                                    "reference_graph": None}
    return got


def rank_findings(sa, run_a, sb, run_b, out, add) -> None:
    try:
        da, db = _divergences(sa, run_a), _divergences(sb, run_b)
    except GraphdeckError as exc:
        out.sections["ranks_check"] = {"status": "INCOMPLETE", "why": exc.message}
        return
    for k, d in db.items():
        if k not in da:
            add("new_rank_divergence", f"ranks diverge in run B only: {d['message']}", ranks=d["ranks"],
                links=[{"a": None, "b": d["graph"], "b_reference": d["reference_graph"]}], detail={"key": list(map(str, k))})
    out.sections["ranks_check"] = {"status": "compared", "why": f"{len(da)} / {len(db)} divergence(s) in A / B"}


def _grads(s: Session, run: Run) -> dict[tuple, tuple]:
    from graphdeck.analysis.gradients.core import validate_backward

    rep = validate_backward(s.get_bind(), run.name)
    got = {("finding", f.kind, tuple(sorted(f.params)), f.source): (f.message, f.graph_id, f.node)
           for f in rep.findings if f.severity == "error" and not f.allowed}
    for row in rep.rows:
        if row.failing:
            cut = getattr(row, "cut", None)
            got.setdefault(("param", row.fqn, row.status), (f"{row.fqn}: {row.status}", getattr(cut, "graph_id", None),
                                                            getattr(cut, "node", None)))
    return got


def grad_findings(sa, run_a, sb, run_b, out, add) -> None:
    try:
        ga, gb = _grads(sa, run_a), _grads(sb, run_b)
    except GraphdeckError as exc:
        out.sections["grads"] = {"status": "INCOMPLETE", "why": exc.message}
        return
    for k, (msg, gid, node) in gb.items():
        if k not in ga:
            add("new_grad_finding", f"gradient path, run B only: {msg}", detail={"key": list(map(str, k))},
                links=[{"a": None, "b": gid, "node_b": node}] if gid is not None else [])
    out.sections["grads"] = {"status": "compared", "why": f"{len(ga)} / {len(gb)} gradient finding(s) in A / B"}
