"""Graph mode: the gradient-path report of a captured (or imported) run, from the store alone.

Facts used, per rank (all written by ``capture/`` or an importer):

* ``params``: every parameter/buffer name, ``requires_grad``, ``storage_key`` (tied weights share one).
* ``graph_io``: placeholders that read a parameter (``in``) and backward outputs that are its
  gradient (``grad``, AOTAutograd's ``GradAOTOutput`` descriptor; ``has_grad`` false for ``None``).
* Dynamo graphs (``kind="dynamo"``; with DDP the unsplit one): nodes and edges, for paths and
  cut points (see ``cuts``). Their ``meta_json["outputs_without_grad"]`` (and that of their
  DDP bucket graphs) names outputs that got no gradient in the first backward (capture records
  it with a multi-grad hook), which is how an output unused by the loss is seen.
* ``partitions``: DDP buckets and their parameters. Collectives: ``collectives``.

Cost: one pass over each Dynamo graph's nodes and edges (``O(nodes + edges)``), the backward
graphs only where they hold collectives; everything else is read from ``graph_io``.
"""

from __future__ import annotations

import gc
import json
import re
from collections import defaultdict, namedtuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.cuts import FlowGraph, first_cut, frames, no_grad_region, short_source, source_line
from graphdeck.analysis.gradients.flows import (  # noqa: F401 (re-exported: public here before)
    LoadedGraph,
    Strings,
    fetch,
    users_of,
)
from graphdeck.analysis.gradients.report import (
    Cut,
    Finding,
    GradReport,
    ParamRow,
    ddp_unused_finding,
    divergence_findings,
)
from graphdeck.store.schema import CompileEvent, Run

READ_KINDS = ("dynamo", "ddp_partition")

FIXES = {
    "NOT_IN_GRAPH": "remove the module or freeze it (requires_grad_(False)); if it is unused on purpose, "
                    "pass --allow for it (and find_unused_parameters=True under DDP)",
    "detach": "remove the .detach()/.data at the cut if this parameter should train; otherwise freeze it",
    "no_grad": "call it outside the no_grad region if it should train; otherwise freeze it",
    "integer_output": "integer/bool outputs (argmax, comparisons, .long()) carry no gradient: weight the "
                      "result by a differentiable function of the values before the cut (e.g. softmax "
                      "probabilities gathered at the chosen index), or freeze the parameter",
    "non_differentiable": "the op at the cut has no derivative for this input; freeze the parameter or "
                          "compute the value differently",
    "dead_output": "use that output in the loss, or do not compute it while training (or freeze the parameter)",
    "unused_result": "its result is never used: remove the computation or use it in the loss",
}


def _imported(session: Session, run_id: int) -> bool:
    """Whether every rank of the run came from an imported log (``ranks.meta_json`` source)."""
    from graphdeck.store.schema import Rank

    metas = session.scalars(select(Rank.meta_json).where(Rank.run_id == run_id)).all()
    return bool(metas) and all('"source": "torch_trace"' in (m or "") for m in metas)


def _eager_fallbacks(session: Session, run_id: int) -> dict[int, list[str]]:
    """Frames whose compile failed, by rank (``compilation_metrics`` records with a
    ``fail_type``: Dynamo gave up on the frame and ran it eagerly), as
    ``"compile_id co_name (file:line): fail_type"``."""
    out: dict[int, list[str]] = defaultdict(list)
    for rank, cid, meta in fetch(session, "SELECT rank, compile_id, metadata_json FROM compile_events "
                                          "WHERE run_id = ? AND name = 'compilation_metrics'", (run_id,)):
        m = _json(meta).get("compilation_metrics") or {}
        if not m.get("fail_type"):
            continue
        where = f"{str(m.get('co_filename') or '?').rsplit('/', 1)[-1]}:{m.get('co_firstlineno')}"
        reason = str(m.get("fail_reason") or m.get("fail_type")).strip().splitlines()[0][:120]
        out[rank].append(f"{cid} {m.get('co_name')} ({where}): {reason}")
    return dict(out)


def _grads_observed(session: Session, run_id: int) -> dict[int, set[str]]:
    """Parameters that held a gradient at the end of the first backward, by rank (the agent's
    ``graphdeck_grads_observed`` record; empty for runs captured without it)."""
    out: dict[int, set[str]] = {}
    for rank, payload in fetch(session, "SELECT rank, payload FROM compile_events "
                                        "WHERE run_id = ? AND name = 'graphdeck_grads_observed'", (run_id,)):
        out.setdefault(rank, set()).update(_json(payload).get("with_grad") or [])
    return out


def _json(text: str | None) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def graph_report(session: Session, run: Run, *, include_buffers: bool = False,
                 expected_params: list[str] | None = None) -> GradReport:
    """The report of ``run`` (every rank with a parameter list), see the module docstring.

    Raises nothing for incomplete stores: missing facts lower precision (an imported run without
    parameter rows lists the parameters its graphs read; a run without backward facts cannot see
    unused outputs) and are listed in ``notes``.

    # NOTE: [GC pause] The analysis allocates ~10^6 small tuples and lists that live until it
    # returns; the cyclic collector would walk them again and again (a third of the time on a
    # 10^5-node graph). It is paused for the call and restored after.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _graph_report(session, run, include_buffers=include_buffers, expected_params=expected_params)
    finally:
        if was_enabled:
            gc.enable()


def _graph_report(session: Session, run: Run, *, include_buffers: bool,
                  expected_params: list[str] | None) -> GradReport:
    # Plain SQL into namedtuples: attribute access on SQLAlchemy rows costs more than the
    # analysis itself on runs with 10^4 parameters.
    params = [_P(*r) for r in fetch(
        session, "SELECT rank, fqn, kind, storage_key, shape_json, dtype, requires_grad FROM params "
                 "WHERE run_id = ? ORDER BY rank, id", (run.id,))]
    graphs = [_G(*r) for r in fetch(
        session, "SELECT id, rank, kind, parent_id, partition_index, meta_json FROM graphs WHERE run_id = ?",
        (run.id,))]
    io = fetch(session, "SELECT g.rank, g.id, g.kind, io.direction, io.param_fqn, io.has_grad, io.node_name "
                        "FROM graph_io io JOIN graphs g ON g.id = io.graph_id "
                        "WHERE g.run_id = ? AND io.param_fqn IS NOT NULL", (run.id,))
    parts = fetch(session, "SELECT rank, \"index\", graph_id, params_json FROM partitions WHERE run_id = ?",
                  (run.id,))
    report = GradReport(mode="graph", run=run.name, run_id=run.id)
    from graphdeck.analysis.gradients import evidence as GE

    ev = GE.load(session, run.id)
    had_params = bool(params)
    if not params and not expected_params:
        # A gate that checked nothing must not pass: a run holding only a trace, or imported
        # logs without parameter records, has no parameter to give a verdict on.
        report.findings.append(Finding(
            kind="NOTHING_CHECKED", severity="error",
            message=f"run {run.name!r} has no parameter records ({len(graphs)} graphs): nothing was checked",
            fix="capture the run with graphdeck's agent (Agent.watch(model)), or pass the expected "
                "parameter names (--expect-params / expected_params=)"))
        return report
    strings = Strings(session)
    kind_of = {g.id: g.kind for g in graphs}
    has_backward = {g.parent_id for g in graphs if g.kind == "aot_backward"}
    split_parents = {g.parent_id for g in graphs if g.kind == "ddp_partition"}
    ddp = bool(parts) or bool(split_parents) or any(_json(g.meta_json).get("ddp") for g in graphs
                                                      if g.kind == "dynamo")

    # Outputs that got no gradient in the first backward, by Dynamo graph (a bucket's facts go
    # to its unsplit parent: DDPOptimizer's split keeps node names).
    dead: dict[int, set[str]] = defaultdict(set)
    seen_backward_fact = False
    for g in graphs:
        meta = _json(g.meta_json)
        if "outputs_without_grad" in meta:
            seen_backward_fact = True
            target = g.parent_id if g.kind == "ddp_partition" else g.id
            dead[target].update(meta.get("outputs_without_grad") or [])
    if not seen_backward_fact and graphs and not ev and not ev.off:
        # A note must be true of the run it is on (issue 24.1): say what is missing, and why.
        n_bw = sum(1 for g in graphs if g.kind == "aot_backward")
        imported = _imported(session, run.id)
        what = ("this run was imported from compile logs: they hold the compiled graphs"
                + (f" ({n_bw} backward)" if n_bw else "") + " but not which outputs got a gradient at run time"
                if imported else
                f"the capture compiled {n_bw} backward graph(s) but recorded no run-time gradient facts"
                if n_bw else "no backward graph was compiled and no run-time gradient facts were recorded")
        report.notes.append(f"{what}: outputs unused by the loss (DEAD_END) cannot be told from graphs alone; "
                            "eager mode (--model) or a capture with Agent.watch(model) can")

    if not graphs and _compile_tried(session, run.id) and not _compiled_without_capture(session, run.id):
        # torch.compile ran and compiled nothing on any rank (NOTE: [No graph produced]): say
        # eager, not graph mode. A job that never called torch.compile (no compile record) keeps
        # the store report's header, which says "eager job, run-time evidence" (report.to_text)
        report.mode = "eager"
        report.notes.append("no compiled graph in this run: the job ran eagerly (see check-compile); the verdict "
                            "rests on the run-time gradient evidence alone, with no graph path to explain a cut")
    eager_frames = _eager_fallbacks(session, run.id)
    observed = _grads_observed(session, run.id)
    for rank_, fallen in sorted(eager_frames.items()):
        report.notes.append(f"rank {rank_}: {len(fallen)} frame(s) failed to compile and ran eagerly "
                            f"(first: {fallen[0]}); parameters read only there are not in any graph")
    storage = {(p.rank, p.fqn): p.storage_key for p in params}
    known = set(storage)
    ranks = sorted({g.rank for g in graphs} | {p.rank for p in params})
    if not params and graphs:
        report.notes.append("the store has no parameter list for this run (an imported log?): parameters "
                            "that no graph reads cannot be listed unless expected parameters are given")
    # Names the caller expects (an imported log lists only parameters its graphs read).
    for fqn in expected_params or []:
        for rank in ranks:
            if (rank, fqn) not in known:
                known.add((rank, fqn))
                storage[(rank, fqn)] = f"fqn:{fqn}"
                params.append(_AutoParam(rank, fqn))
    # Parameters a graph reads that the parameter list lacks (model not watched, imported logs).
    # A buffer is none (NOTE: [Buffers read by graphs]).
    buffers = _buffer_inputs(io)
    for rank, _gid, _kind, direction, fqn, _has, _node in io:
        if direction == "in" and (rank, fqn) not in known and (rank, fqn) not in buffers:
            known.add((rank, fqn))
            storage[(rank, fqn)] = f"fqn:{fqn}"
            params.append(_AutoParam(rank, fqn))
    reads: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    grads: dict[tuple[int, str], list[tuple[int, bool]]] = defaultdict(list)
    for rank, gid, kind, direction, fqn, has_grad, node_name in io:
        key = (rank, storage.get((rank, fqn), fqn))
        if direction == "in" and kind in READ_KINDS:
            reads[key].append((gid, node_name))
        elif direction == "grad":
            grads[key].append((gid, bool(has_grad)))
    bucket_of: dict[tuple[int, str], int] = {}
    for p_rank, p_index, _gid, p_params in parts:
        for fqn in json.loads(p_params or "[]"):
            bucket_of.setdefault((p_rank, fqn), p_index)

    # Forward analysis on every Dynamo graph that reads a parameter (unsplit graphs included).
    loaded: dict[int, LoadedGraph] = {}

    def flow_of(gid: int) -> LoadedGraph:
        if gid not in loaded:
            loaded[gid] = LoadedGraph(session, strings, gid, dead.get(gid, set()))
        return loaded[gid]

    groups: dict[tuple[int, str], list] = defaultdict(list)
    for p in params:
        if p.kind == "buffer" and not include_buffers:
            continue
        groups[(p.rank, p.storage_key if p.kind == "parameter" else f"buffer:{p.fqn}")].append(p)

    first_uses: list[tuple[ParamRow, int | None]] = []
    shapes: dict[str | None, list] = {}
    for (rank, skey), members in groups.items():
        head = members[0]
        aliases = [m.fqn for m in members]
        shape = shapes.get(head.shape_json)
        if shape is None:
            shape = shapes[head.shape_json] = json.loads(head.shape_json or "[]")
        row = ParamRow(rank=rank, fqn=head.fqn, status="OK", aliases=aliases, shape=list(shape), dtype=head.dtype,
                       requires_grad=bool(head.requires_grad),
                       bucket=next((bucket_of[(rank, a)] for a in aliases if (rank, a) in bucket_of), None))
        report.rows.append(row)
        if head.kind == "buffer":
            row.status, row.reason = "BUFFER", "a buffer, not a parameter: it has no gradient to check"
            continue
        read_by = reads.get((rank, skey), [])
        grad_by = grads.get((rank, skey), [])
        row.graphs = sorted({g for g, _ in read_by})
        row.grad_graphs = sorted({g for g, _ in grad_by})
        n_grads = sum(1 for _, ok in grad_by if ok)
        if not head.requires_grad:
            row.status, row.reason = "FROZEN", "requires_grad is False"
            continue
        if not read_by:
            row.status = "NOT_IN_GRAPH"
            row.reason = "no compiled graph reads it (an unused module, or a branch not taken on this rank)"
            row.fix = FIXES["NOT_IN_GRAPH"]
            if eager_frames.get(rank):
                first = f"{eager_frames[rank][0]}{' and others' if len(eager_frames[rank]) > 1 else ''}"
                if head.fqn in observed.get(rank, ()):
                    # NOTE: [Gradients observed at the end of the first backward] (capture/agent.py)
                    row.status, row.fix, row.cut = "OK", None, None
                    row.reason = (f"read by no compiled graph, but it held a gradient at the end of the first "
                                  f"backward: an eager frame computes it ({first})")
                    continue
                row.reason += f"; or a frame that fell back to eager on this rank reads it ({first})"
                row.fix = ("if an eager frame reads it, it gets its gradient outside the graphs: check it in eager "
                           "mode (--model) or --allow it; else " + FIXES["NOT_IN_GRAPH"])
            row.cut = Cut(kind="not_read", detail="never read by a compiled graph")
            continue
        # Forward paths in the Dynamo graphs (a DDP bucket's graph is analysed through its parent).
        analysed = [(g, node) for g, node in read_by if kind_of.get(g) == "dynamo"]
        if not analysed:
            analysed = list(read_by)
        paths, cut, first = 0, None, None
        for gid, node_name in analysed:
            lg = flow_of(gid)
            start = lg.by_name.get(node_name)
            if start is None:
                continue
            users = lg.flow.users[start]
            paths += sum(1 for u in users if (lg.live[u] if lg.flow.ops[u] != "output" else start not in lg.flow.dead))
            consumers = [u for u in users if lg.flow.ops[u] != "output"]
            if consumers and first is None:
                first = (lg, min(consumers))
        if paths == 0:
            for gid, node_name in analysed:
                lg = flow_of(gid)
                start = lg.by_name.get(node_name)
                res = first_cut(lg.flow, start, lg.live) if start is not None else None
                if res is not None:
                    cut = (lg, res)
                    break
        if first is not None:
            first_uses.append((row, first[0].stack_ids[first[1]]))
        backward_ok = n_grads > 0
        if backward_ok and paths:
            row.status, row.paths = "OK", paths
            row.reason = f"gradient through {paths} path(s)" + (f"; tied: {', '.join(aliases)}" if len(aliases) > 1 else "")
        elif backward_ok and cut is not None and cut[1].kind == "dead_output":
            row.status, row.paths = "DEAD_END", 0
        elif backward_ok:
            # The backward returns a gradient though no forward path was found (facts missing).
            row.status, row.paths = "OK", n_grads
            row.reason = f"gradient from {n_grads} backward output(s)"
        else:
            row.status, row.paths = "NO_GRAD", 0
            no_bw = [g for g in row.graphs if g not in has_backward and kind_of.get(g) != "dynamo"
                     or (kind_of.get(g) == "dynamo" and g not in has_backward and g not in split_parents)]
            row.reason = ("read by graph(s) " + ", ".join(map(str, row.graphs)) + ", but "
                          + (f"backward graph(s) {', '.join(map(str, row.grad_graphs))} return None for its gradient"
                             if grad_by else "no backward graph returns a gradient for it"
                             + (f" (no backward at all for {no_bw})" if no_bw else "")))
        if row.status in ("NO_GRAD", "DEAD_END") and cut is not None:
            row.cut = _explain(cut[0], cut[1], strings)
            row.fix = FIXES.get(row.cut.kind)
            row.reason = _reason(row, cut[0].flow, cut[1])
        elif row.status == "NO_GRAD":
            row.fix = "the compiler gave no gradient and no cut was found in the forward graph; run eager mode " \
                      "(validate_backward(model, inputs, loss_fn)) to find it"

    strings.load(sid for _, sid in first_uses)
    for row, sid in first_uses:
        row.first_use = _frame_text(strings.get(sid))
    from graphdeck.analysis.traces.comm_map import ddp_find_unused

    report.coverage, report.incomplete = GE.coverage(
        ev, world_size=run.world_size, ranks=ranks, params_known=had_params, expected_params=bool(expected_params))
    if ev:
        GE.apply_evidence(report.rows, ev)
        GE.mark_unobserved_ranks(report.rows, ev)
    watched = list(ev.watch.values())
    ddp = ddp or any(w.get("ddp") for w in watched)
    from graphdeck.analysis.gradients.mesh import mesh_findings, wrapping

    wrap = wrapping(session, run.id, watched)  # FSDP2 groups, layout (NOTE: [Wrapper words])
    fsdp = wrap.fsdp2
    find_unused = ddp_find_unused(session, run.id) if ddp else None
    if find_unused is None and any("find_unused_parameters" in w for w in watched):
        find_unused = all(w.get("find_unused_parameters") for w in watched if "find_unused_parameters" in w)
    # Ranks without run-time evidence are judged from the graphs; the others from what arrived.
    graph_rows = [r for r in report.rows if r.rank not in ev.by_rank and not r.allowed]
    if ddp and not fsdp and find_unused is not True and graph_rows:  # True: DDP marks unused ones ready
        # None: the record does not say which options ran; static_graph: DDP finds them in its first iteration
        f = ddp_unused_finding(graph_rows, find_unused, static_graph=_ddp_static(session, run.id, watched))
        if f is not None:
            report.findings.append(f)
    if len(ranks) > 1 and not (ev and set(ranks) <= set(ev.by_rank)):
        report.findings += divergence_findings([r for r in report.rows if r.status not in ("BUFFER", "UNKNOWN")], ddp=ddp,
                                               find_unused=bool(find_unused), compiled=True, fsdp=wrap)
    if ev:
        report.findings += GE.evidence_findings([r for r in report.rows if not r.allowed], ev, ddp=ddp,
                                                find_unused=find_unused, fsdp=wrap if fsdp else False)
    report.findings += mesh_findings(session, run.id, report.rows, wrap)  # TP Partial, PP cut
    from graphdeck.analysis.gradients.replicas import replica_check

    report.findings += replica_check(session, run.id, report, wrap, ddp=ddp)  # NOTE: [Replica agreement]
    for gid, lg in sorted(loaded.items()):
        report.findings += _intermediate_outputs(lg, strings)
    from graphdeck.analysis.gradients.compiles import compile_findings
    from graphdeck.analysis.gradients.nodes import node_findings

    report.findings += compile_findings(session, run.id, report.rows)  # per-compile requires_grad (N1)
    report.findings += node_findings(session, run.id, flow_of, strings, report.rows)  # dangling outputs, flags
    from graphdeck.analysis.gradients.collectives import collective_findings

    report.findings += collective_findings(session, run.id, report.rows, wrap)
    return report


def _ddp_static(session: Session, run_id: int, watched: list[dict]) -> bool:
    """Every DDP wrapper the run recorded (``graphdeck_watch`` or ``graphdeck_comm_groups``) had
    ``static_graph=True``: DDP then never raises for parameters unused on every rank."""
    from graphdeck.analysis.traces.comm_map import EVENT_NAME, load_record

    flags = {bool(w["static_graph"]) for w in watched if w.get("ddp") and "static_graph" in w}
    for (rank,) in session.execute(select(CompileEvent.rank).where(
            CompileEvent.run_id == run_id, CompileEvent.name == EVENT_NAME).distinct()):
        flags |= {bool(d["static_graph"]) for d in (load_record(session, run_id, rank) or {}).get("ddp") or []
                  if "static_graph" in d}
    return flags == {True}


_P = namedtuple("_P", "rank fqn kind storage_key shape_json dtype requires_grad")
_G = namedtuple("_G", "id rank kind parent_id partition_index meta_json")


# NOTE: [Buffers read by graphs]
# Without a watched model's parameter list (``backend="graphdeck"`` alone, imported logs) the
# parameters are the module state the graphs read; a buffer (a RoPE table, BatchNorm's running
# stats) is read the same way but is no parameter: listing it made a FROZEN "parameter" of it
# and miscounted the model's parameters. Dynamo names each placeholder by its source
# (``l_self_modules_rope_buffers_cache_``, ``l__self___buffers_freqs_cis_``): a name read only
# through ``_buffers`` placeholders, never a ``_parameters`` one, is a buffer.
_BUFFER_SOURCE = re.compile(r"(^|_)buffers_")
_PARAM_SOURCE = re.compile(r"(^|_)parameters_")


def _buffer_inputs(io) -> set[tuple[int, str]]:
    """(rank, fqn) of the graph inputs that Dynamo's placeholder names show to be buffers only."""
    buf: set[tuple[int, str]] = set()
    par: set[tuple[int, str]] = set()
    for rank, _gid, kind, direction, fqn, _has, node in io:
        if direction != "in" or kind not in ("dynamo", "ddp_partition") or not node:
            continue
        if _PARAM_SOURCE.search(node):
            par.add((rank, fqn))
        elif _BUFFER_SOURCE.search(node):
            buf.add((rank, fqn))
    return buf - par


class _AutoParam:
    """A parameter known only because a graph reads it."""

    kind = "parameter"
    shape_json = "[]"
    dtype = None
    requires_grad = True

    def __init__(self, rank: int, fqn: str):
        self.rank, self.fqn, self.storage_key = rank, fqn, f"fqn:{fqn}"


def _frame_text(stack_trace: str | None) -> str | None:
    fr = frames(stack_trace)
    if not fr:
        return None
    file, line, fn = fr[-1]
    return f'File "{file}", line {line}' + (f", in {fn}" if fn else "")


def _explain(lg: LoadedGraph, res, strings: Strings) -> Cut:
    i = res.node
    stack = strings.get(lg.stack_ids[i])
    fr = frames(stack)
    src = short_source(fr[-1][0], fr[-1][1]) if fr else None
    code = source_line(fr[-1][0], fr[-1][1]) if fr else None
    region = no_grad_region(stack) if res.kind == "no_grad" else None
    return Cut(kind=res.kind, op=lg.flow.targets[i], node=lg.flow.names[i], graph_id=lg.graph_id, source=src,
               code=code, module_path=strings.get(lg.module_ids[i]), region=region,
               path=[lg.flow.names[k] for k in res.path])


def _reason(row: ParamRow, flow: FlowGraph, res) -> str:
    c = row.cut
    at = f" at {c.source}" if c.source else ""
    op = c.op or "?"
    if c.kind == "detach":
        return f"gradient flow is cut by {op} (node {c.node}){at}"
    if c.kind == "no_grad":
        return (f"{op} (node {c.node}) runs with grad mode off{at}"
                + (f", inside the no_grad region opened at {c.region}" if c.region else
                   " (a _set_grad_enabled(False) region)"))
    if c.kind == "integer_output":
        return f"{op} (node {c.node}) returns {flow.dtypes[res.node]}, which carries no gradient{at}"
    if c.kind == "dead_output":
        return (f"everything computed from it ends in output {c.node}{at}, which got no gradient in the "
                "first backward: the loss does not use it")
    if c.kind == "unused_result":
        return f"its last use {op} (node {c.node}){at} is never used"
    return f"{op} (node {c.node}) is not differentiable for it{at}"


def _intermediate_outputs(lg: LoadedGraph, strings: Strings, limit: int = 128) -> list[Finding]:
    """Outputs of one compiled region where one feeds another inside the region: after
    compilation the first is not an autograd ancestor of the second, so
    ``torch.autograd.grad(second, first)`` raises "One of the differentiated Tensors appears to
    not have been used in the graph" (it works eagerly). Reachability by bitsets over the nodes."""
    flow = lg.flow
    outs = [i for i in lg.output_producers if flow.ops[i] not in ("placeholder", "get_attr")
            and flow.tensor[i] is not False and (flow.dtypes[i] in (None, "float32", "float16", "bfloat16", "float64"))]
    if len(outs) < 2 or len(outs) > limit:
        return []
    bit = {i: 1 << k for k, i in enumerate(outs)}
    reach = [0] * len(flow)
    for i in range(len(flow)):
        if i in bit:
            reach[i] |= bit[i]
        if reach[i] and flow.ops[i] != "output":
            if any(flow.grad_off[i:i + 1]) or flow.targets[i] in ("detach", "_get_data_attr"):
                continue
            for u in flow.users[i]:
                reach[u] |= reach[i]
    found = []
    for j in outs:
        if lg.scalar[j]:
            continue  # a 0-d output is a loss: nobody differentiates it w.r.t. another output
        anc = reach[j] & ~bit[j]
        for k, i in enumerate(outs):
            # An output seen without gradient in the first backward (a KV cache, an unused
            # head) is not one anyone differentiates against.
            if anc >> k & 1 and i not in flow.dead:
                found.append((i, j))
    if not found:
        return []
    pairs = "; ".join(f"{flow.names[i]} → {flow.names[j]}" for i, j in found[:8])
    i0 = found[0][0]
    fr = frames(strings.get(lg.stack_ids[i0]))
    return [Finding(kind="OUTPUT_NOT_ANCESTOR", severity="warning", graph_id=lg.graph_id, node=flow.names[i0],
                    source=short_source(fr[-1][0], fr[-1][1]) if fr else None,
                    message=(f"graph {lg.graph_id} returns outputs that feed other outputs inside the same "
                             f"compiled region ({pairs}{' …' if len(found) > 8 else ''}); after compilation "
                             "the first is not an autograd ancestor of the second, so torch.autograd.grad("
                             "second, first) raises 'The differentiated Tensor … appears to not have been used "
                             "in the graph' (it works eagerly)"),
                    fix="put a graph break (torch._dynamo.graph_break()) between the two computations, or take "
                        "the gradient inside the compiled function")]


def _compile_tried(session: Session, run_id: int) -> bool:
    """Whether Dynamo tried a frame of the run (some ``compilation_metrics`` record)."""
    return session.scalar(select(CompileEvent.id).where(
        CompileEvent.run_id == run_id, CompileEvent.name == "compilation_metrics").limit(1)) is not None


def _compiled_without_capture(session: Session, run_id: int) -> bool:
    """Whether a compile of the run produced a graph the store does not hold (a job compiled with
    another backend than the agent's): some ``compilation_metrics`` with ``graph_op_count`` > 0."""
    for meta in session.scalars(select(CompileEvent.metadata_json).where(
            CompileEvent.run_id == run_id, CompileEvent.name == "compilation_metrics")):
        body = _json(meta).get("compilation_metrics")
        if isinstance(body, dict) and isinstance(body.get("graph_op_count"), int) and body["graph_op_count"] > 0:
            return True
    return False
