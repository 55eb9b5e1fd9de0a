"""What DDP really does with a gradient accumulated twice, and predictions the run itself refutes.

NOTE: [Predictions the run contradicts]
Some findings predict that the job *raises* (or hangs) at a step: DDP's "Expected to have finished
reduction in the prior iteration" at the step after a parameter got no gradient on every rank
(``DDP_UNUSED_ERROR``), "Expected to mark a variable ready only once" in the backward that
accumulates a parameter twice (``READY_TWICE``), a hang in the all-reduce of a gradient only some
ranks produce (``PREDICTED_HANG``). Each such finding carries ``Finding.raises_at`` — the 0-based
step at which the job would stop. When the run's own run-time evidence (``grad_steps`` rows of
graphdeck's Agent) holds a backward at a *later* step on every rank the prediction names, the job
did not stop there: the prediction is wrong for this job (a DDP option the record does not show,
a compiled backward that zero-fills, ...). :func:`refute_by_run` then keeps the finding as a
``warning`` whose message starts with what the run did, never as a FAIL; what the parameters
themselves lack (their rows) is judged on its own.

NOTE: [When DDP's unused-parameter error fires]
Measured on torch 2.13 (CPU, gloo, 2 ranks, a Linear never used in forward, 3-5 steps):
eager DDP and ``torch.compile(DDP(model))`` (DDPOptimizer, aot_eager) alike raise "Expected to have
finished reduction in the prior iteration" in the forward of step 1 with ``find_unused_parameters=
False``; with ``find_unused_parameters=True`` or ``static_graph=True`` neither raises and every step
runs. So ``DDP_UNUSED_ERROR`` is predicted only for a wrapper known to have neither flag
(``DDP_UNUSED_STATIC``, a warning, for ``static_graph=True``; ``DDP_UNUSED_DEPENDS`` where the record
does not say), and a run whose evidence goes past step 1 refutes it (below).

NOTE: [READY_TWICE under DDP]
Real torch 2.13 DDP (CPU, gloo, 2 ranks; tests/verdict_ddp_job.py and tests/test_verdicts_ddp.py):
autograd sums every use of a parameter in one backward into one accumulation, so a parameter used
twice in one forward is marked ready once — nothing to report. Only a nested backward
re-accumulates it: reentrant activation checkpointing recomputes each checkpointed call in a
backward of its own. Then

* ``static_graph=True``: handled (no error, the replicas agree);
* ``find_unused_parameters=True``: DDP's search from the outputs cannot see parameters used only
  inside reentrant checkpoints, marks them unused (ready) at the forward, and their first
  accumulation raises "Expected to mark a variable ready only once" in the first backward;
* ``find_unused_parameters=False`` (the default): DDP finishes its iteration (every bucket
  reduced, the reducer stops listening) at the end of the graph task in which the last of its
  parameters first became ready. Nested backwards run inside the outer one, so when that task is
  a nested backward, a later accumulation stays local to the rank: no error is raised and the
  replicas' gradients of that parameter silently diverge (0.42 on ``lora_silent``); any second
  accumulation before that point raises the same error (``lora_raises``: a trainable layer before
  the checkpoints is the last to become ready, in the outer backward).

:func:`ddp_twice_outcome` applies these rules to the order of accumulations an eager backward
recorded (``eager``).
"""

from __future__ import annotations

from graphdeck.analysis.gradients.report import Finding

RAISES = "raises"
SILENT = "silent"
HANDLED = "handled"


def ddp_twice_outcome(order: list[tuple[int, object]], trainable: set[int], twice: set[int], *,
                      find_unused: bool, static_graph: bool) -> str:
    """What a real DDP backward does (:data:`RAISES`, :data:`SILENT` or :data:`HANDLED`, NOTE:
    [READY_TWICE under DDP]). ``order``: every accumulation of one backward in the order it ran,
    as ``(parameter id, graph task)`` (the task: any hashable naming the nested backward it ran
    in, ``None`` for the outer one, inside which every nested one runs); ``trainable``: the ids of
    every parameter DDP reduces; ``twice``: those accumulated more than once.

    The reducer marks a parameter ready at its first accumulation (``find_unused_parameters=True``:
    those the outer graph does not reach — used only inside reentrant checkpoints — and unused ones
    are marked at the forward already); a parameter marked again while it listens raises. When all
    are ready it stops listening at the end of the graph task that completed them: after a nested
    task, later accumulations stay local; after the outer one, nothing comes later."""
    if static_graph:
        return HANDLED
    ready: set[int] = set()
    if find_unused:
        outer = {pid for pid, task in order if task is None}
        ready = {pid for pid in trainable if pid not in outer}
    done_task, finished = None, bool(trainable) and trainable <= ready
    silent = False
    for pid, task in order:
        if finished and done_task is not None and task != done_task:
            silent = silent or pid in twice  # the reducer stopped listening: this accumulation stays local
            continue
        if pid in ready:
            return RAISES  # marked ready twice while the reducer still listens
        ready.add(pid)
        if not finished and trainable <= ready:
            finished, done_task = True, task
    return SILENT if silent else RAISES


def ran_past(ev, ranks, step: int) -> dict[int, int]:
    """Ranks (of ``ranks``; all with evidence when empty) whose run-time evidence holds a backward
    at a step after ``step``: ``{rank: last recorded step}``; empty when any of them does not."""
    if ev is None or not getattr(ev, "by_rank", None):
        return {}
    want = sorted(ranks) if ranks else sorted(ev.by_rank)
    out = {}
    for r in want:
        segs = ev.by_rank.get(r) or []
        last = max((s.last for s in segs), default=None)
        if last is None or last <= step:
            return {}
        out[r] = last
    return out


def refute_by_run(findings: list[Finding], ev) -> None:
    """NOTE: [Predictions the run contradicts]: in place, every finding whose ``raises_at`` step
    the run went past on every rank it names becomes a warning that says so first."""
    for f in findings:
        if f.raises_at is None or f.severity != "error":
            continue
        ranks = [int(r) for r in (f.ranks if isinstance(f.ranks, (list, dict)) else [])]
        went = ran_past(ev, ranks, f.raises_at)
        if not went:
            continue
        lo, hi = min(went.values()), max(went.values())
        steps = f"{hi}" if lo == hi else f"{lo}-{hi}"
        f.severity = "warning"
        f.refuted_by = (f"the run went past step {f.raises_at}: rank(s) {sorted(went)} recorded backward passes "
                        f"through step {steps}")
        f.message = f"not what this run did — {f.refuted_by}, so it did not stop there. Predicted: {f.message}"


def eager_ready_twice(report, model, ddp: bool, accs_of: dict[str, list], order: list,
                      name_of: dict[int, str], fn_text, error: str) -> None:
    """A ``READY_TWICE`` finding for the rows accumulated more than once in one backward
    (``accs_of``: fqn -> what ran each accumulation, see :func:`_accumulation_hook`), its DDP
    consequence from the order the accumulations ran in (``order``; NOTE: [READY_TWICE under DDP]);
    ``name_of``: parameter id -> fqn; ``fn_text`` formats a checkpointed function; ``error``: DDP's
    message. Called by :func:`graphdeck.analysis.gradients.eager.eager_report`."""
    twice = [r for r in report.rows if r.accumulations and r.accumulations > 1]
    if not twice:
        return
    from torch.nn.parallel import DistributedDataParallel

    is_ddp = isinstance(model, DistributedDataParallel)  # torch's or a framework's subclass
    fns = sorted({d for r in twice for d in accs_of.get(r.fqn, []) if d}, key=lambda d: (d[1] or "", d[0]))
    desc = ", ".join(f"{r.fqn} ({r.accumulations}x)" for r in twice)
    names = ", ".join(r.fqn for r in twice)
    why = (f"reentrant activation checkpointing of {' and '.join(fn_text(d) for d in fns)} recomputes it in a "
           "backward of its own once per call" if fns else "nested backwards accumulate it more than once")
    by_name = {v: k for k, v in name_of.items()}
    trainable = {by_name[r.fqn] for r in report.rows if r.requires_grad and r.fqn in by_name}
    twice_ids = {by_name[r.fqn] for r in twice if r.fqn in by_name}

    def outcome(find_unused: bool, static: bool = False) -> str:
        got = ddp_twice_outcome(order, trainable, twice_ids, find_unused=find_unused, static_graph=static)
        if got == HANDLED:
            return "static_graph=True handles it (no error, the replicas agree)"
        if got == RAISES:
            return f"the first backward raises '{error}'"
        return (f"no error: DDP finishes its iteration before the second accumulation, which stays local to each "
                f"rank, so the replicas' gradients of {names} silently diverge")

    if is_ddp:
        static, fu = bool(getattr(model, "static_graph", False)), bool(getattr(model, "find_unused_parameters", False))
        said = outcome(fu, static)
        severity = "warning" if static else "error"
        consequence = f"under this DDP wrapper (find_unused_parameters={fu}, static_graph={static}): {said}"
    else:
        severity = "error" if ddp else "warning"
        consequence = (("under DDP" if ddp else "harmless without DDP (autograd sums them); under DDP")
                       + f" with find_unused_parameters=False (the default): {outcome(False)}; with "
                         f"find_unused_parameters=True: {outcome(True)}; with static_graph=True: {outcome(False, True)}")
    report.findings.append(Finding(
        kind="READY_TWICE", severity=severity, params=[r.fqn for r in twice],
        source=fns[0][1] if fns else None,
        message=f"{consequence} — gradient accumulated more than once in one backward: {desc}; {why}",
        fix="checkpoint(..., use_reentrant=False), or DistributedDataParallel(..., static_graph=True), "
            "or do not reuse the parameter across checkpointed calls"))
