"""Which compiles of a frame compiled several times each rank still runs (NOTE: [Live compiles]),
and which compiles were live at the step of a hang (NOTE: [Compiles live at a step]).
:func:`live_compiles` is read through :mod:`graphdeck.analysis.ranks.predicted` (its callers import
it from there), which turns the frames it cannot tell into INCOMPLETE evidence.

Pure: reads the store (compile records, recompile reasons, profiler traces' compiled regions, the
graphs' collectives)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from graphdeck.analysis.ranks.core import CompileEntry


# NOTE: [Compiles live at a step]
# A hang happens at one training step (NOTE: [Compile steps] in capture/compile_record.py): its
# predicted schedule compares each rank's graphs live at that step, not its steady state. A
# compile made after the step is left out (a rank that went on past the hang and recompiled at
# step 3 ran its older graph at step 2); a compile made at the step ran there; an older compile
# whose fate was uncertain is replaced at that step when the frame was compiled again there (the
# step's inputs failed its guards). Compiles without a recorded step are kept (an older capture).
# A hang at step 0 of a run that never counted an optimizer step keeps the steady state: that
# "step" is the whole run (NOTE: [A step that never ended] in analysis/ranks/hang_step.py).

# NOTE: [Live compiles]
# A frame compiled again (compile ids F/0, F/1, ...) keeps its earlier graphs in Dynamo's cache
# beside the new one (torch/_dynamo: a recompile *adds* a cache entry; the newest is tried
# first, and an older one runs again whenever its guards pass — a frame compiled for two static
# shapes that alternate runs both graphs). Per rank, whether an older compile C of a frame still
# runs is told from, strongest first:
# 1. a profiler trace of the rank in which the frame's latest compile runs (Dynamo's
#    ``Torch-Compiled Region: F/c`` ranges): C runs there too (live) or not (replaced, as far as
#    that window shows);
# 2. a later compile's ``recompile_reasons`` record, which lists one guard failure per cache
#    entry then present (``"F/c: reason"``): when it names other entries and not C, C had left
#    the cache (replaced);
# 3. a later compile caused by a *size* guard of C whose graph takes symbolic sizes (automatic
#    dynamic shapes): it accepts C's inputs too and is tried first (replaced);
# 4. C's graphs issue the same collectives as the latest compile's: whichever runs, the schedule
#    is the same (counted once, as the latest).
# Otherwise it cannot be told (a static recompile on a dtype, value or size guard added an entry
# beside C, which runs again if such inputs come back): the latest compile is counted and the
# frame is named as *uncertain* — missing evidence, so check-ranks says INCOMPLETE, never agree.
# The predicted schedule counts the collectives of every live compile of a frame (one call each
# per step), in compile order, at the place of the frame's first compile.

_ENTRY_RE = re.compile(r"(?<![\w/])(!?\d+(?:/\d+)+(?:_\d+)?): ")
_SIZE_GUARDS = ("size mismatch", "stride mismatch", "dimensionality mismatch")
_SYMBOL = re.compile(r"^s\d+$")
_REGION = "Torch-Compiled Region: "


@dataclass
class FrameCompiles:
    """Which compiles of one frame (several compiles) one rank runs (NOTE: [Live compiles]).
    Each dict maps an older compile id to why it is classed so."""

    rank: int
    frame: str
    name: str | None
    counted: list[str]  # compile ids whose collectives the prediction counts, compile order
    live: dict[str, str] = field(default_factory=dict)
    replaced: dict[str, str] = field(default_factory=dict)
    same: dict[str, str] = field(default_factory=dict)  # same collectives as the latest
    uncertain: dict[str, str] = field(default_factory=dict)

    def missing(self) -> str | None:
        """The missing-evidence line for an uncertain frame, else None."""
        if not self.uncertain:
            return None
        return (f"rank {self.rank} frame {self.name or self.frame}: "
                + "; ".join(f"whether compile {c} still runs cannot be told ({why})" for c, why in self.uncertain.items())
                + f"; the predicted schedule counts compile {', '.join(self.counted)} only")

    def text(self) -> str:
        parts = [f"{c} still runs ({w})" for c, w in self.live.items()]
        parts += [f"{c} replaced ({w})" for c, w in self.replaced.items()]
        parts += [f"{c} issues the same collectives as {self.counted[-1]} ({w})" for c, w in self.same.items()]
        parts += [f"{c} uncertain ({w})" for c, w in self.uncertain.items()]
        return f"rank {self.rank} frame {self.name or self.frame}: counts {', '.join(self.counted)}; " + "; ".join(parts)


def live_compiles(session: Session, run_id: int, rank: int, sequence: list[CompileEntry],
                  scheduled: frozenset[str] | set[str] = frozenset(), at_step: int | None = None,
                  steps: dict[str, int] | None = None) -> tuple[list[CompileEntry], list[FrameCompiles]]:
    """``(entries, frames)``: the compiles whose graphs ``rank`` runs in steady state, in
    schedule order (per frame its live compiles, at the place of its first compile; compiles
    without a frame id kept where they are; failed compiles and compiles without graphs — or,
    in ``scheduled``, an imported Inductor collective schedule — left out), and for every frame
    with several such compiles how each older one was classed (NOTE: [Live compiles]).

    With ``at_step`` and ``steps`` (compile id → the step it was compiled at,
    :func:`graphdeck.analysis.ranks.hang_step.compile_steps`): the compiles live at that step
    instead (NOTE: [Compiles live at a step])."""
    from graphdeck.analysis.ranks.core import at_first_compile, frame_of

    steps = steps or {}
    if at_step is not None and steps:  # compiled after that step: not there yet
        sequence = [e for e in sequence if steps.get(e.compile_id) is None or steps[e.compile_id] <= at_step]
    per_frame: dict[str, list[CompileEntry]] = {}
    for e in sequence:
        f = frame_of(e.compile_id)
        if f is not None and e.failed is None and (e.graphs or e.compile_id in scheduled):
            per_frame.setdefault(f, []).append(e)
    ctx = _Evidence(session, run_id, rank)
    counted: dict[str, list[CompileEntry]] = {}
    frames: list[FrameCompiles] = []
    for f, entries in per_frame.items():
        latest = entries[-1]
        keep = []
        fc = FrameCompiles(rank=rank, frame=f, name=latest.frame, counted=[])
        made_there = [x.compile_id for x in entries if at_step is not None and steps.get(x.compile_id) == at_step]
        for i, e in enumerate(entries[:-1]):
            fate, why = ctx.fate(e, entries[i + 1:], latest)
            if e.compile_id in made_there and fate != "live":
                fate, why = "live", f"compiled at step {at_step}, the step of the hang: it ran there"
            elif made_there and fate == "uncertain" and steps.get(e.compile_id, at_step) < at_step:
                fate, why = "replaced", (f"compile {made_there[0]} was made at step {at_step}, the step of the hang: "
                                         "the inputs of that step failed its guards")
            getattr(fc, fate)[e.compile_id] = why
            if fate == "live":
                keep.append(e)
        counted[f] = [*keep, latest]
        fc.counted = [x.compile_id for x in counted[f]]
        if len(entries) > 1:
            frames.append(fc)
    return at_first_compile(sequence, counted), frames


class _Evidence:
    """The store's evidence of one rank, read on first use (only frames compiled again need it)."""

    def __init__(self, session: Session, run_id: int, rank: int):
        self.session, self.run_id, self.rank = session, run_id, rank
        self._regions: set[str] | None = None
        self._reasons: dict[str, str] | None = None

    @property
    def regions(self) -> set[str]:
        """Compile ids the rank's profiler traces show running (``Torch-Compiled Region: F/c``)."""
        if self._regions is None:
            from graphdeck.store.schema import InternedString, Trace, TraceEvent

            sids = dict(self.session.execute(select(InternedString.id, InternedString.value)
                                             .where(InternedString.value.like(_REGION + "%"))).all())
            tids = list(self.session.scalars(select(Trace.id).where(Trace.run_id == self.run_id,
                                                                     Trace.rank == self.rank)))
            self._regions = set()
            if sids and tids:
                for sid in self.session.scalars(select(TraceEvent.name_id).where(
                        TraceEvent.trace_id.in_(tids), TraceEvent.name_id.in_(list(sids))).distinct()):
                    self._regions.add(sids[sid][len(_REGION):].strip())
        return self._regions

    @property
    def reasons(self) -> dict[str, str]:
        """compile id → its full ``recompile_reasons`` record (one failure per cache entry)."""
        if self._reasons is None:
            from graphdeck.store.schema import CompileEvent

            self._reasons = {}
            for cid, payload in self.session.execute(select(CompileEvent.compile_id, CompileEvent.payload).where(
                    CompileEvent.run_id == self.run_id, CompileEvent.rank == self.rank,
                    CompileEvent.name == "recompile_reasons")):
                if cid and payload:  # a JSON list or plain text: one stripped failure per line, no JSON syntax
                    from graphdeck.analysis.compilation.rules import split_reasons

                    self._reasons[cid] = self._reasons.get(cid, "") + "".join(
                        "\n" + r.strip() for r in split_reasons(payload))
        return self._reasons

    def fate(self, e: CompileEntry, later: list[CompileEntry], latest: CompileEntry) -> tuple[str, str]:
        cid = e.compile_id
        if latest.compile_id in self.regions:
            if cid in self.regions:
                return "live", f"the rank's profiler trace shows it running beside compile {latest.compile_id}"
            return "replaced", f"the rank's profiler trace shows compile {latest.compile_id} running and not it"
        for x in later:
            named = _ENTRY_RE.findall(self.reasons.get(x.compile_id, ""))
            if named and cid not in named:
                return "replaced", (f"it had left Dynamo's cache when compile {x.compile_id} ran: that recompile's "
                                    f"guard failures name the cache entries {', '.join(named)} only")
        for x in later:
            mine = _failure_of(self.reasons.get(x.compile_id) or x.recompile_reason or "", cid)
            if mine and any(g in mine for g in _SIZE_GUARDS) and self._symbolic(x):
                return "replaced", (f"compile {x.compile_id} recompiled it on a size guard ({mine}) with symbolic "
                                    "sizes (automatic dynamic shapes): it takes its inputs too and is tried first")
        mine, theirs = self._collectives(e), self._collectives(latest)
        if mine is not None and mine == theirs:
            return "same", f"{len(mine)} collective(s), same kinds, groups, sizes and dtypes"
        guard = next((g for x in later if (g := _failure_of(self.reasons.get(x.compile_id) or x.recompile_reason
                                                             or "", cid))), None)
        later_ids = ", ".join(x.compile_id for x in later)
        return "uncertain", ((f"its guard failed on {guard}" if guard else "no guard failure of it recorded")
                             + f"; compile {later_ids} added a cache entry beside it and the compile records cannot "
                             "tell whether its inputs come back; "
                             + ("its graphs' collectives are unknown" if mine is None or theirs is None else
                                f"it issues {_coll_text(mine)}, compile {latest.compile_id} {_coll_text(theirs)}"))

    def _symbolic(self, entry: CompileEntry) -> bool:
        """Whether a graph of ``entry`` takes symbolic sizes (a SymInt placeholder ``sN``)."""
        from graphdeck.store.schema import Node

        gids = [gid for _k, _h, gid in entry.graphs]
        if not gids:
            return False
        names = self.session.scalars(select(Node.name).where(Node.graph_id.in_(gids), Node.op == "placeholder"))
        return any(_SYMBOL.match(n or "") for n in names)

    def _collectives(self, entry: CompileEntry) -> list[tuple] | None:
        """``(kind, group, bytes, dtype)`` of the collectives ``entry``'s executed graphs issue, in
        graph order; None when it has no graph."""
        from graphdeck.analysis.ranks.core import EXECUTED_TIERS, collective_target_ids, group_of
        from graphdeck.store.schema import Node

        for tier in EXECUTED_TIERS:
            gids = [gid for kind, _h, gid in entry.graphs if kind in tier]
            if gids:
                break
        else:
            return None
        ids = collective_target_ids(self.session)
        if not ids:
            return []
        out = []
        for gid in gids:
            out += [(ids[t], group_of(a), b, d) for t, a, b, d in self.session.execute(
                select(Node.target_id, Node.args_json, Node.size_bytes, Node.dtype)
                .where(Node.graph_id == gid, Node.op == "call_function", Node.target_id.in_(list(ids)))
                .order_by(Node.idx))]
        return out


def _failure_of(text: str, cid: str) -> str | None:
    """The guard failure of cache entry ``cid`` in a recompile reason text, or None."""
    parts = _ENTRY_RE.split(text)  # [before, id, reason, id, reason, ...]
    for i in range(1, len(parts) - 1, 2):
        if parts[i] == cid:
            return parts[i + 1].strip().rstrip(";").strip() or None
    return None


def _coll_text(colls: list[tuple]) -> str:
    if not colls:
        return "no collective"
    return ", ".join(f"{k}{f' {b} bytes' if b is not None else ''}" for k, _g, b, _d in colls)
