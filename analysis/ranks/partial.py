"""Partial Flight Recorder evidence: a collective only some members of a group issued, told from
the dumps that exist when a member wrote none (issue 38, item 4).

# NOTE: [One-sided collectives]
A rank that aborts inside a collective (gloo's "Received data size doesn't match" is a C++
``abort``) or is killed writes no dump, so its group cannot be compared entry by entry
(``FlightReport.groups_incomplete``). Torch's analyzer (``torch/distributed/flight_recorder``)
then only lists the ranks it has no entries from; it does not say whether the collective the
others hold could ever be matched. The dumps that exist can say so by themselves where the code
that issued a collective runs on some ranks only: each dumped entry carries its Python stack, and
its user frames (innermost first) sit in source lines whose enclosing code decides, by the rank
alone, which ranks get there:

* an ``if`` (or ``x if c else y``) whose test is a condition on the rank — ``rank == 0``,
  ``dist.get_rank() != 0 and step == 1``, ``is_main_process`` — and whose arm holding the line is
  not taken on a member, while the arm that member takes holds no call at all (nothing there can
  issue a matching collective);
* an earlier ``if`` of the same block, taken on that member, whose body leaves the block
  (``return``, ``continue``, ``break``, ``raise``) — ``if rank != 0: return``.

The test is evaluated three-valued (True, False, unknown) with the member's global rank put for
the rank's names (``rank``, ``global_rank``, ``ddp_rank``, ``world_rank``, ``process_index``,
``get_rank()`` with no group) and ``rank == 0`` for the main-process flags; any other name is
unknown, so ``rank == 0 and step == 1`` is False on rank 1 and unknown on rank 0. A member whose
test is False there cannot have issued that collective: it went past, so from that sequence id on
the group's members disagree — the hang (NCCL) or the abort (gloo). The claim is made only when
it holds on the evidence: every dumped member of the group recorded the same collective there
(they agree, or the group would be a plain mismatch) and the test is not False on any of them;
the first such sequence id of the group is the cause. Where no stack, no readable source or no
rank condition says it, the group stays INCOMPLETE.

The mismatch is a :class:`OneSided` (a :class:`~graphdeck.analysis.ranks.flight.GroupMismatch`
of kind ``"one-sided"``) added to ``FlightReport.mismatches``, so the verdict is FAIL everywhere
the report is read (check-ranks, JSON, API, parallel map). Pure: reads the store.
"""

from __future__ import annotations

import ast
import linecache
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.flight import (
    COMPILED_FRAMES,
    LIBRARY_FRAMES,
    EntryRef,
    FlightReport,
    GroupMismatch,
    _loads,
    _RankDump,
)
from graphdeck.analysis.ranks.records import _ranks_text
from graphdeck.store.fr_import import EVENT_NAME
from graphdeck.store.schema import CompileEvent

if TYPE_CHECKING:
    from graphdeck.analysis.ranks.core import RankReport

#: Names whose value is the process's global rank, and flags that mean ``rank == 0``.
RANK_NAMES = frozenset({"rank", "global_rank", "ddp_rank", "world_rank", "process_index", "RANK"})
ZERO_FLAGS = frozenset({"is_main_process", "is_global_zero", "is_rank_zero", "master_process", "is_master",
                        "is_local_main_process"})
#: Library functions that only wrap the call the user made (decorators, module and compiled-frame plumbing).
GENERIC = frozenset({"wrapper", "inner", "_fn", "__call__", "_call_impl", "_wrapped_call_impl", "compile_wrapper",
                     "decorate_context", "apply", "wrapped", "_wrapper", "fn", "forward"})
_UNKNOWN = object()
_FRAME = re.compile(r"^(.*):(\d+) in (.*)$")
_LEAVES = (ast.Return, ast.Continue, ast.Break, ast.Raise)


@dataclass
class OneSided(GroupMismatch):
    """A collective only ``reached`` issued, from their dumps alone (NOTE: [One-sided collectives]);
    ``branch``: ``"file:line in fn: `if ...:`"``; ``api``: the torch call the user code made (e.g.
    ``full_tensor``); ``frames``: the stack, outermost first, user frames and that call."""

    branch: str = ""
    api: str = ""
    frames: list[str] = field(default_factory=list)

    def headline(self) -> str:
        return (f"group {self.group} ({self.desc}): collective #{self.seq} {self.op} {self.sizes} issued only by "
                f"ranks {_ranks_text(self.reached)}"
                + (f" ({self.api})" if self.api else "")
                + f": ranks {_ranks_text(self.not_reached)} skip it at {self.branch} — told from the dumps of ranks "
                f"{_ranks_text(self.reached)} alone; no dump from ranks {_ranks_text(self.no_dump)}")

    def account(self, r: int) -> str:
        return "wrote no dump; its rank condition says it never issued this collective"


def _value(node: ast.AST, rank: int):
    """The value of expression ``node`` on global rank ``rank``, or ``_UNKNOWN``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        vals = [_value(x, rank) for x in node.elts]
        return _UNKNOWN if any(v is _UNKNOWN for v in vals) else vals
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if isinstance(node, ast.Call):
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if fname == "get_rank" and not node.args and all(
                k.arg == "group" and isinstance(k.value, ast.Constant) and k.value.value is None for k in node.keywords):
            return rank
        if fname in ZERO_FLAGS and not node.args and not node.keywords:
            return rank == 0
        if fname == "int" and len(node.args) == 1:
            v = _value(node.args[0], rank)
            return v if isinstance(v, int) else _UNKNOWN
        return _UNKNOWN
    if isinstance(node, ast.Name) and name in RANK_NAMES:
        return rank
    if isinstance(node, ast.Attribute) and name in RANK_NAMES - {"rank"}:
        return rank  # ``self.rank`` may be a mesh coordinate: only the unambiguous names
    if name in ZERO_FLAGS:
        return rank == 0
    return _UNKNOWN


_CMP = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
        ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def truth(test: ast.AST, rank: int) -> bool | None:
    """Three-valued truth of condition ``test`` on global rank ``rank``: True, False, or None
    (it depends on something other than the rank)."""
    if isinstance(test, ast.BoolOp):
        vals = [truth(v, rank) for v in test.values]
        stop = isinstance(test.op, ast.Or)  # the value that decides: True for `or`, False for `and`
        if stop in vals:
            return stop
        return None if None in vals else not stop
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = truth(test.operand, rank)
        return None if v is None else not v
    if isinstance(test, ast.Compare):
        left = _value(test.left, rank)
        for op, right_node in zip(test.ops, test.comparators):
            right = _value(right_node, rank)
            if left is _UNKNOWN or right is _UNKNOWN or type(op) not in _CMP:
                return None
            try:
                if not _CMP[type(op)](left, right):
                    return False
            except TypeError:
                return None
            left = right
        return True
    v = _value(test, rank)
    return None if v is _UNKNOWN or isinstance(v, list) else bool(v)


def _has_call(nodes) -> bool:
    return any(isinstance(n, ast.Call) for x in (nodes if isinstance(nodes, list) else [nodes]) if x is not None
               for n in ast.walk(x))


def _inside(node: ast.AST, line: int) -> bool:
    return getattr(node, "lineno", 0) <= line <= (getattr(node, "end_lineno", None) or getattr(node, "lineno", 0))


_TREES: dict[str, ast.AST | None] = {}


def _tree(file: str) -> ast.AST | None:
    if file not in _TREES:
        src = "".join(linecache.getlines(file)) if file.endswith(".py") else ""
        try:
            _TREES[file] = ast.parse(src) if src else None
        except (SyntaxError, ValueError):
            _TREES[file] = None
    return _TREES[file]


def _conditions(file: str, line: int):
    """``(node, arm, test)`` for each piece of code deciding by a condition whether ``line`` of
    ``file`` runs: ``arm`` "body" (runs when ``test`` is True), "orelse" (when False) or "leaves"
    (an earlier ``if`` of an enclosing block that leaves the block when ``test`` is True)."""
    tree = _tree(file)
    if tree is None:
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and _inside(node, line) and not _inside(node.test, line):
            body = node.body if isinstance(node.body, list) else [node.body]
            arm = "body" if any(_inside(x, line) for x in body) else "orelse"
            yield node, arm, node.test
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if not isinstance(block, list) or not any(_inside(x, line) for x in block):
                continue
            for stmt in block:
                if _inside(stmt, line):
                    break
                if isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.body[-1], _LEAVES):
                    yield stmt, "leaves", stmt.test


def _user_frames(stack: list[str]) -> list[tuple[str, int, str, int]]:
    """``(file, line, fn, index in stack)`` of the user frames of an FR stack (innermost first)."""
    out = []
    for i, f in enumerate(stack):
        m = _FRAME.match(f)
        if m and not any(x in f for x in LIBRARY_FRAMES):
            out.append((m.group(1), int(m.group(2)), m.group(3), i))
    return out


def skippers(stack: list[str], members: list[int]) -> tuple[str, set[int]] | None:
    """``(branch text, members that cannot reach this stack)`` by the innermost user frame whose
    enclosing code excludes some member by its rank (NOTE: [One-sided collectives]); None when none
    does."""
    for file, line, fn, _i in _user_frames(stack):
        for node, arm, test in sorted(_conditions(file, line), key=lambda c: -c[0].lineno):
            out = set()
            for r in members:
                t = truth(test, r)
                if t is None:
                    continue
                if arm == "leaves" and t:
                    out.add(r)
                elif arm in ("body", "orelse") and t != (arm == "body"):
                    other = node.orelse if arm == "body" else node.body
                    if not _has_call(other):
                        out.add(r)
            if out:
                text = f"if {ast.unparse(test)}:" + (f" {ast.unparse(node.body[-1])}" if arm == "leaves" else "")
                return f"{file}:{node.lineno} in {fn}: `{text}`", out
    return None


def _dump_of(session: Session, run_id: int, rank: int) -> _RankDump | None:
    payload = session.scalar(select(CompileEvent.payload).where(
        CompileEvent.run_id == run_id, CompileEvent.rank == rank, CompileEvent.name == EVENT_NAME)
        .order_by(CompileEvent.id.desc()).limit(1))
    try:
        return _RankDump(rank, _loads(payload or ""), {})
    except (ValueError, TypeError, KeyError, IndexError):
        return None


def _members_known(session: Session, run_id: int, rd: _RankDump, g: str) -> bool:
    """Whether group ``g``'s members are recorded (the dump's ``pg_config``, the capture's process
    group / layout records) or it is the default group: a subgroup whose members are only assumed
    to be every rank could make a rank that is no member look like one that skipped it."""
    from graphdeck.analysis.ranks.flight import recorded_members
    from graphdeck.store.fr_import import members_of

    cfg = rd.norm.get("pg_config") or {}
    if g == "0" or rd.desc.get(g) == "default_pg" or (g in cfg and members_of({g: cfg[g]})):
        return True
    return g in recorded_members(session, run_id)


def _call_path(e: EntryRef) -> tuple[str, list[str]]:
    """The torch call the user code made (the library frame just inside the innermost user frame)
    and the stack, outermost first: the user frames, then that call and the collective's own."""
    users = _user_frames(e.stack)
    if not users:
        return "", list(reversed(e.stack))[:8]
    inner = users[0][3]
    libs_out = list(reversed(e.stack[:inner]))  # the library frames, outermost first
    names = [f.rsplit(" in ", 1)[-1] for f in libs_out if not any(c in f for c in COMPILED_FRAMES)]
    api = "" if libs_out and any(c in libs_out[0] for c in COMPILED_FRAMES) else \
        next((n for n in names if n not in GENERIC and not n.startswith("<")), "")
    libs = [f for f in e.stack[:inner] if "_functional_collectives" in f or "distributed_c10d" in f]
    frames = [f for f in reversed(e.stack[inner:]) if not any(x in f for x in LIBRARY_FRAMES)]
    return api, frames + ([e.stack[inner - 1]] if inner > 0 else []) + libs[-1:]


def one_sided(session: Session, report: RankReport, fr: FlightReport) -> None:
    """Add a :class:`OneSided` to ``fr.mismatches`` for each incomplete group whose dumped members'
    entries show a collective its members without a dump cannot have issued; the group then is no
    longer incomplete. In place; reads one dump per such group (its lowest dumped member's)."""
    for g, missing in list(fr.groups_incomplete.items()):
        members = fr.group_members.get(g) or []
        dumped = [r for r in members if r not in missing]
        if not dumped:
            continue
        rd = _dump_of(session, report.run_id, dumped[0])
        if rd is None or g not in rd.by_group:
            continue
        found = None
        seen: dict[int, tuple | None] = {}  # stack index → skippers (stacks repeat every step)
        known = _members_known(session, report.run_id, rd, g)
        for q in sorted(rd.by_group[g]) if known else ():
            i = rd.by_group[g][q][1]
            st = rd.norm["entries"][i][7]
            if st not in seen:
                e = rd.ref(i)
                seen[st] = skippers(e.stack, members) if e.stack else None
            got = seen[st]
            if got is None or set(dumped) & got[1] or not set(missing) & got[1]:
                continue  # no rank condition, or one a dumped member contradicts (it recorded it)
            found = (q, rd.ref(i), got)
            break
        if found is None:
            last = rd.ref(rd.by_group[g][max(rd.by_group[g])][1])
            api = _call_path(last)[0]
            fr.shown[g] = (f"what the dumps show: rank {dumped[0]}'s latest collective of the group is {last.describe()}"
                           + (f", issued by {api}" if api else "")
                           + (" inside a compiled graph" if last.compiled else " from non-compiled code")
                           + (f"; no condition on the rank in its stack keeps ranks {_ranks_text(missing)} from it"
                              if known else "; the group's members are not recorded, so its stack is not read for "
                              "ranks that skip it")
                           + ", so these dumps alone do not explain a hang")
            continue
        q, e, (branch, skip) = found
        not_reached = sorted(set(missing) & skip)
        api, frames = _call_path(e)
        m = OneSided(group=g, desc=rd.desc.get(g, ""), seq=q, op=e.op, sizes=e.sizes, members=members,
                     reached=dumped, not_reached=not_reached, no_dump=list(missing), kind="one-sided",
                     issued={dumped[0]: e}, instead={r: None for r in not_reached},
                     last_completed={r: None for r in not_reached}, doing={r: None for r in not_reached},
                     branch=branch, api=api, frames=frames)
        for r in not_reached:
            m.cause[r] = "skipped"
            m.why[r] = [f"rank {r} wrote no Flight Recorder dump, but ranks {_ranks_text(dumped)} recorded "
                        f"{e.describe()}" + (f", issued by {api}" if api else "")
                        + (" from non-compiled code" if not e.compiled else " inside a compiled graph"),
                        f"the branch: {branch} is false on rank {r}, so it never issues this collective: from "
                        f"#{q} on, the members of group {g} disagree (NCCL: a hang; gloo: an abort)",
                        "stack: " + " -> ".join(frames)]
        del fr.groups_incomplete[g]
        fr.mismatches.append(m)
