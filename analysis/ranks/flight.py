"""The recorded half of a hang: each process group's first mismatched collective in the ranks'
Flight Recorder dumps (stored by :mod:`graphdeck.store.fr_import` or the capture agent).

Per process group (the entries' ``process_group`` name; members from the dumps' ``pg_config``,
else the capture's process-group / layout records (:func:`recorded_members`), else every rank
of the run; ``FlightReport.group_members``), collectives are aligned by ``collective_seq_id`` from the latest
first id every rank still holds (ring buffers forget the oldest entries); a sequence id's
signature is the ``(profiling_name, input sizes, output sizes, dtypes)`` of its entries
(coalesced ops share one id). The first id whose signature is not the same on every member —
another op, other sizes, or no entry at all — is the group's :class:`GroupMismatch`: the
reference signature is the one most ranks hold there (ties: the lowest rank's); ranks holding it
*reached* the collective, the others did not, each with what it recorded there instead, its last
completed collective of the group and its latest entry of any group (what it was doing when
dumped), each with the innermost user frame of its stack. Point-to-point ops (``send``/``recv``)
are not aligned. This is the same first mismatch ``python -m torch.distributed.flight_recorder.
fr_trace`` reports where it can read the dumps (tests/test_flight.py checks it); unlike it, dumps
whose ``pg_config`` names the default group ``''`` while entries say ``('0', 'default_pg')`` (gloo
on torch 2.13) and dumps of only some ranks are read: a member without a dump is named.

Missing evidence (:func:`~graphdeck.analysis.ranks.evidence.missing_evidence`): FR entries dropped on import, members without a
dump, and TORCH_TRACE records the importer dropped (``ranks.meta_json["dropped_records"]``)
unless check-ranks never reads that kind (:data:`~graphdeck.analysis.ranks.evidence.NOT_EVIDENCE`).
Any of it makes ``check-ranks`` say INCOMPLETE, never that the ranks agree.

Speed (NOTE: [FR compare by index]): ranks are compared by their dumps' indexes
(:func:`graphdeck.store.fr_import.seq_index`, stored with each dump): ranks whose sequence of a
group is the same form one class, compared once; only the dumps of ranks a mismatch shows are
decoded. A group whose dumped members agree while a member has no dump is *incomplete*
(``FlightReport.groups_incomplete``), never one that agrees: a rank that aborted inside the
collective (gloo's "Received data size doesn't match") may write no dump. 1,024 ranks × 2,000 entries: ~0.3 s instead of ~1.8 s (bench/bench_flight.py).

The join to compile records is :mod:`graphdeck.analysis.ranks.hangs`. Pure: reads the store.
"""

from __future__ import annotations

import gc
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

# re-exported: hangs.py, core.py and compilation/health.py import these from here
from graphdeck.analysis.ranks.evidence import NOT_EVIDENCE, missing_evidence, unverified_evidence  # noqa: F401
from graphdeck.analysis.ranks.records import _ranks_phrase, _ranks_text
from graphdeck.store.fr_import import EVENT_NAME, INDEX_VERSION, members_of, seq_index, unpack_codes
from graphdeck.store.schema import CompileEvent, Rank

try:  # the stored payloads are large on big jobs: the faster parser where installed
    import orjson as _orjson

    _loads = _orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads

#: Path fragments of frames that are not the user's code (torch, generated kernels, the stdlib).
LIBRARY_FRAMES = ("/torch/", "/site-packages/", "/dist-packages/", "torchinductor_", "/lib/python3", "<frozen",
                  "<string>", "<eval_with_key>")
_ROOT = __file__.rsplit("/analysis/", 1)[0]
LIBRARY_FRAMES += tuple(f"{_ROOT}/{d}/" for d in ("capture", "analysis", "store", "graphdeck"))  # the capture's own
#: Frames that mean "issued from inside a compiled graph".
COMPILED_FRAMES = ("output_code.py", "torchinductor_", "eval_frame.py", "runtime_wrappers.py")
_P2P = ("send", "recv")


@dataclass
class EntryRef:
    """One recorded entry, for a human."""

    rank: int
    group: str
    seq: int
    op: str
    sizes: list | None
    state: str
    retired: bool
    line: str | None  # innermost user frame, "file:line in fn"
    compiled: bool  # issued from inside a compiled graph (by its stack)
    stack: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"{self.op} #{self.seq} of group {self.group}" + (f" {self.sizes}" if self.sizes else "")
                + (f" at {self.line}" if self.line else ""))


@dataclass
class GroupMismatch:
    group: str
    desc: str
    seq: int
    op: str | None
    sizes: list | None
    members: list[int]
    reached: list[int]
    not_reached: list[int]
    no_dump: list[int]
    kind: str  # "missing" (a rank has no entry there) | "op" | "sizes"
    issued: dict[int, EntryRef]  # per reached rank (the first 8): its entry at seq
    instead: dict[int, EntryRef | None]  # per not-reached rank: its entry at seq (another op), or None
    last_completed: dict[int, EntryRef | None]
    doing: dict[int, EntryRef | None]  # latest entry of any group
    why: dict[int, list[str]] = field(default_factory=dict)  # filled by analysis.ranks.hangs
    # per not-reached rank: "skipped" (it went on past this collective: the cause) or "waiting"
    # (it is blocked in an earlier collective of another mismatched group: a consequence)
    cause: dict[int, str] = field(default_factory=dict)
    primary: bool = True  # some rank skipped it (or nothing says otherwise)

    def account(self, r: int) -> str:
        """What not-reached rank ``r`` recorded instead, last completed and went on to."""
        inst, last, doing = self.instead.get(r), self.last_completed.get(r), self.doing.get(r)
        text = (f"recorded {inst.describe()} there instead; " if inst else "no entry there; ")
        text += f"last completed {last.describe()}" if last else "no completed collective of this group"
        if doing is not None and doing is not inst:
            text += f"; {'went on to' if self.cause.get(r) == 'skipped' else 'waiting in'} {doing.describe()}"
        return text

    def headline(self) -> str:
        reached = (f"{len(self.reached)} ranks (every member but {_ranks_text(self.not_reached + self.no_dump)})"
                   if len(self.reached) > 16 else f"ranks {_ranks_text(self.reached)}")
        return (("" if self.primary else "(consequence) ")
                + f"group {self.group} ({self.desc}): first mismatch at collective #{self.seq} {self.op} "
                f"{self.sizes}: reached by {reached}, not by ranks {_ranks_text(self.not_reached)}"
                + (f"; no dump from ranks {_ranks_text(self.no_dump)}" if self.no_dump else ""))


@dataclass
class FlightReport:
    ranks: list[int]  # ranks with a dump
    members: list[int]
    no_dump: list[int]
    entries: int
    dropped: list[str]
    mismatches: list[GroupMismatch]
    groups_agree: list[str]
    # group -> rank -> collectives recorded completed or retired (point-to-point left out); group -> desc.
    # Filled by :func:`count_completed` only where a prediction is checked (analysis.ranks.predicted).
    completed: dict[str, dict[int, int]] = field(default_factory=dict)
    descs: dict[str, str] = field(default_factory=dict)
    # group -> its members as compared (pg_config, else the capture's records, else every rank), and
    # group -> members without a dump where the dumped members agree: not "agree", INCOMPLETE (the
    # missing dump may hold the mismatch: a rank that aborted in the collective writes none).
    group_members: dict[str, list[int]] = field(default_factory=dict)
    groups_incomplete: dict[str, list[int]] = field(default_factory=dict)
    shown: dict[str, str] = field(default_factory=dict)  # incomplete group -> what its dumps show (ranks.partial)

    def to_dict(self) -> dict:
        """The fields, each mismatch with its ``headline`` and per not-reached rank its ``accounts``
        (the texts :meth:`lines` prints: the page shows them, so it says what check-ranks says)."""
        d = asdict(self)
        for md, m in zip(d["mismatches"], self.mismatches):
            md["headline"] = m.headline()
            md["accounts"] = {str(r): m.account(r) for r in m.not_reached}
        return d

    def lines(self) -> list[str]:
        out = [f"Flight Recorder: dumps from ranks {_ranks_text(self.ranks)}, {self.entries} entries; "
               f"{len(self.groups_agree)} group(s) agree, "
               + (f"{len(self.groups_incomplete)} incomplete, " if self.groups_incomplete else "")
               + f"{len(self.mismatches)} mismatched"]
        if self.no_dump:
            out.append(f"  no Flight Recorder dump from ranks {_ranks_text(self.no_dump)}")
        for g, missing in self.groups_incomplete.items():
            out.append(f"  INCOMPLETE group {g}{' (' + self.descs[g] + ')' if self.descs.get(g) else ''}: members "
                       f"{_ranks_text(missing)} have no dump, so whether its collectives match cannot be told (the "
                       "dumped members agree)")
            out += [f"    {self.shown[g]}"] if g in self.shown else []
        for m in self.mismatches:
            out.append(f"HANG {m.headline()}")
            for r, e in list(m.issued.items())[:2]:  # the others' entries are the same collective
                out.append(f"    rank {r} issued it{' inside a compiled graph' if e.compiled else ''}"
                           f"{' at ' + e.line if e.line else ''} ({e.state}{', retired' if e.retired else ', pending'})")
            alike: dict[tuple, list[int]] = {}  # ranks whose lines read the same: one entry (1,024 ranks)
            for r in m.not_reached:
                alike.setdefault((m.account(r), *m.why.get(r, [])), []).append(r)
            for (text, *why), rs in list(alike.items())[:8]:
                out.append(f"    {_ranks_phrase(rs)}: {text}")
                out += [f"      why: {w}" for w in why]
            if len(alike) > 8:
                rest = sorted(r for rs in list(alike.values())[8:] for r in rs)
                out.append(f"    ranks {_ranks_text(rest)}: {len(alike) - 8} more account(s), in --format json")
        return out


def _user_frame(stack: list[str]) -> str | None:
    for f in stack:
        if not any(x in f for x in LIBRARY_FRAMES):
            return f
    return None


class _RankDump:
    """One rank's stored dump, decoded lazily: per group, sequence id → entry indices."""

    def __init__(self, rank: int, norm: dict, sig_ids: dict[str, int]):
        self.rank, self.norm = rank, norm
        pgs = norm["pgs"]
        sigs = norm["sigs"]
        gsig = [sig_ids.setdefault(json.dumps(s, separators=(",", ":")), len(sig_ids)) for s in sigs]
        self.p2p = [str(s[0]).endswith(_P2P) for s in sigs]
        self.by_group: dict[str, dict[int, list]] = {}
        self.desc: dict[str, str] = {}
        for name, desc in pgs:
            self.desc.setdefault(name, desc)
        tables = [self.by_group.setdefault(name, {}) for name, _desc in pgs]
        p2p = self.p2p
        for i, e in enumerate(norm["entries"]):  # the hot loop: 2,000 entries a rank
            sig = e[3]
            if p2p[sig]:
                continue
            table = tables[e[0]]
            slot = table.get(e[1])
            if slot is None:
                table[e[1]] = [gsig[sig], i]
            else:  # coalesced: one sequence id, several ops
                slot[0] = (slot[0], gsig[sig]) if not isinstance(slot[0], tuple) else (*slot[0], gsig[sig])
        self.by_group = {k: v for k, v in self.by_group.items() if v}

    def ref(self, i: int | None) -> EntryRef | None:
        if i is None:
            return None
        pg, seq, _p2p, sig, state, retired, _rid, st, _t = self.norm["entries"][i]
        stack = self.norm["stacks"][st] if st >= 0 else []
        s = self.norm["sigs"][sig]
        return EntryRef(rank=self.rank, group=self.norm["pgs"][pg][0], seq=seq, op=s[0], sizes=s[1],
                        state=("scheduled", "started", "completed")[state] if state >= 0 else "?",
                        retired=bool(retired), line=_user_frame(stack),
                        compiled=any(c in f for f in stack for c in COMPILED_FRAMES), stack=stack[:64])

    def last_entry(self) -> int | None:
        ents = self.norm["entries"]
        return max(range(len(ents)), key=lambda i: ents[i][6]) if ents else None


def load_dumps(session: Session, run_id: int) -> dict[int, dict]:
    """rank → its latest stored dump (decoded payload)."""
    rows = session.execute(select(CompileEvent.rank, CompileEvent.id, CompileEvent.payload)
                           .where(CompileEvent.run_id == run_id, CompileEvent.name == EVENT_NAME)
                           .order_by(CompileEvent.id)).all()
    latest = {r: p for r, _i, p in rows}
    out = {}
    for r, p in latest.items():
        try:
            out[r] = _loads(p)
        except ValueError:
            continue
    return out


class _Dumps(dict):
    """rank → :class:`_RankDump`, each decoded from its stored payload on first use (a report
    shows a few ranks' entries; the comparison itself reads only the indexes)."""

    def __init__(self, session: Session, event_ids: dict[int, int], decoded: dict[int, dict],
                 sig_ids: dict[str, int]):
        super().__init__()
        self.session, self.event_ids, self.decoded, self.sig_ids = session, event_ids, decoded, sig_ids

    def __missing__(self, rank: int) -> _RankDump:
        norm = self.decoded.get(rank)
        if norm is None:
            norm = _loads(self.session.scalar(select(CompileEvent.payload)
                                              .where(CompileEvent.id == self.event_ids[rank])))
        x = self[rank] = _RankDump(rank, norm, self.sig_ids)
        return x


def _indexes(session: Session, run_id: int) -> tuple[dict[int, dict], dict[int, int], dict[int, dict]]:
    """``(rank → seq_index, rank → event id, rank → decoded payload)`` of each rank's latest dump.
    The importer stores the index in ``metadata_json``; a record without it (written by the
    capture, or by an older importer) is decoded and indexed here (its payload kept)."""
    rows = session.execute(select(CompileEvent.rank, CompileEvent.id, CompileEvent.metadata_json)
                           .where(CompileEvent.run_id == run_id, CompileEvent.name == EVENT_NAME)
                           .order_by(CompileEvent.id)).all()
    latest = {r: (i, m) for r, i, m in rows}
    index, ids, decoded = {}, {}, {}
    for r, (i, meta) in latest.items():
        try:
            x = _loads(meta or "{}").get("fr_index")
        except (ValueError, AttributeError):
            x = None
        if not (isinstance(x, dict) and x.get("v") == INDEX_VERSION and isinstance(x.get("groups"), dict)
                and all(isinstance(g, list) and len(g) == 6 and isinstance(g[4], str) for g in x["groups"].values())):
            try:
                norm = _loads(session.scalar(select(CompileEvent.payload).where(CompileEvent.id == i)) or "")
                x = seq_index(norm)
            except (ValueError, TypeError, KeyError, IndexError):
                continue  # an unreadable payload: not a dump
            decoded[r] = norm
        index[r], ids[r] = x, i
    return index, ids, decoded


def flight_report(session: Session, run_id: int, dumps: dict[int, dict] | None = None) -> FlightReport | None:
    """The first mismatch per process group, or None when the run has no FR dump. ``dumps``
    (rank → decoded payload, as :func:`load_dumps` gives): use these instead of the store's."""
    enabled = gc.isenabled()
    gc.disable()  # many new lists per rank, none cyclic: collections would cost more than the work
    try:
        return _flight_report(session, run_id, dumps)
    finally:
        if enabled:
            gc.enable()


#: Collectives whose tensors exist on one side only at the root: a scatter's inputs live on its
#: source rank, a gather's outputs on its destination; the others hold none there.
_ROOT_INPUTS, _ROOT_OUTPUTS = ("scatter",), ("gather",)


def comparable(sig: list) -> list:
    """What ranks must agree on in a signature ``[op, input_sizes, output_sizes, dtypes]`` (the
    stored form, dtypes = inputs' then outputs'): all of it, except the root-only side of a scatter
    (inputs) or a gather (outputs), which the other ranks record empty — comparing it would make
    every scatter a mismatch between its source and the rest."""
    try:
        op, ins, outs, dtypes = sig
    except (TypeError, ValueError):
        return sig
    kind = str(op).rsplit(":", 1)[-1]
    n_in = len(ins) if isinstance(ins, list) else 0
    if kind in _ROOT_INPUTS and isinstance(dtypes, list):
        return [op, None, outs, dtypes[n_in:]]
    if kind in _ROOT_OUTPUTS and isinstance(dtypes, list):
        return [op, ins, None, dtypes[:n_in]]
    return sig


class _Classes:
    """Ranks whose recorded sequence of a group is the same, found by their indexes: each
    distinct sequence is decoded and compared once, however many ranks hold it."""

    def __init__(self, index: dict[int, dict], sig_ids: dict[str, int]):
        self.index = index
        self.gsig: dict[int, tuple] = {}  # rank → its signatures' global ids
        tables: dict[str, tuple] = {}
        for r, x in index.items():
            sigs = x.get("sigs") or []
            key = json.dumps(sigs, separators=(",", ":"))
            if key not in tables:
                tables[key] = tuple(sig_ids.setdefault(json.dumps(comparable(sg), separators=(",", ":")),
                                                       len(sig_ids)) for sg in sigs)
            self.gsig[r] = tables[key]

    def rows(self, g: str, have: list[int]) -> tuple[int, dict[tuple, list[int]]] | None:
        """``(start, row → ranks)``: a row gives each id's signature (a global id, a tuple of them
        for a coalesced id, None where the rank has no entry) from ``start`` — the latest first id
        any rank holds — to the last id any rank holds. None when no rank has an entry in ``g``."""
        by_key: dict[tuple, list[int]] = defaultdict(list)
        for r in have:
            ent = self.index[r]["groups"].get(g)
            by_key[(self.gsig[r], None) if ent is None else (self.gsig[r], *ent[1:5])].append(r)
        decoded = {k: _decode(k) for k in by_key}
        spans = [(v[0], v[1]) for v in decoded.values() if v is not None]
        if not spans:
            return None
        start, end = max(f for f, _l in spans), max(la for _f, la in spans)
        out: dict[tuple, list[int]] = defaultdict(list)
        for k, ranks in by_key.items():
            v = decoded[k]
            if v is None or v[1] < start:
                row = (None,) * (end - start + 1)
            else:
                first, last, codes = v
                row = tuple(codes[start - first:]) + (None,) * (end - last)
            out[row] += ranks
        return start, out


def _decode(k: tuple) -> tuple[int, int, list] | None:
    """``(first, last, global signature per id first..last)`` of a class key, None for no entries."""
    if k[1] is None:
        return None
    gsig, first, last, dense, packed = k
    codes = unpack_codes(packed)

    def one(c):
        return None if c is None else gsig[c] if c.__class__ is int else tuple(gsig[x] for x in c)

    if not dense:
        at = {q: one(c) for q, c in codes}
        return first, last, [at.get(q) for q in range(first, last + 1)]
    try:
        return first, last, list(map(gsig.__getitem__, codes))
    except TypeError:  # None or a coalesced id among them
        return first, last, [one(c) for c in codes]


def _flight_report(session: Session, run_id: int, dumps: dict[int, dict] | None) -> FlightReport | None:
    if dumps is not None:
        index = {r: seq_index(d) for r, d in dumps.items()}
        ids: dict[int, int] = {}
    else:
        index, ids, dumps = _indexes(session, run_id)
    if not index:
        return None
    sig_ids: dict[str, int] = {}
    ranks = sorted(index)
    classes = _Classes(index, sig_ids)
    rd = _Dumps(session, ids, dumps, sig_ids)
    cfg_members: dict[str, set[int]] = {}
    everyone: set[int] = set(ranks)
    by_pgc: dict = {}  # the same pg_config (by digest) in every dump, as a rule: read once
    for r in ranks:
        by_pgc.setdefault(index[r].get("pgc"), r)
    for r in by_pgc.values():
        for name, cfg in (rd[r].norm.get("pg_config") or {}).items():
            m = members_of({name: cfg})
            if m:
                cfg_members.setdefault(str(name), set()).update(m)
                everyone |= m
    world = set(session.scalars(select(Rank.rank).where(Rank.run_id == run_id))) | everyone
    report = FlightReport(ranks=ranks, members=sorted(world), no_dump=sorted(world - set(ranks)),
                          entries=sum(x.get("n", 0) for x in index.values()),
                          dropped=[d for r in ranks if index[r].get("d") for d in rd[r].norm.get("dropped") or []],
                          mismatches=[], groups_agree=[])
    ops = {}  # global signature id → op
    for r in ranks:
        for sg, gid in zip(index[r].get("sigs") or [], classes.gsig[r]):
            ops.setdefault(gid, str(sg[0]))
    groups = sorted({g for x in index.values() for g in x["groups"]})
    recorded = recorded_members(session, run_id) if any(g not in cfg_members for g in groups) else {}
    for g in groups:
        # gloo's pg_config names only the default group: a mesh dimension's group takes its members
        # from the capture's process-group / layout records, never the whole world (a false hang).
        members = sorted(cfg_members.get(g) or recorded.get(g) or world)
        report.group_members[g] = members
        m = _group_mismatch(g, members, rd, classes, ops)
        if m is None:
            lacking = [r for r in members if r not in index]
            if lacking:
                report.groups_incomplete[g] = lacking
                report.descs.setdefault(g, rd[next(r for r in members if r in index)].desc.get(g, "")
                                        if any(r in index for r in members) else "")
            else:
                report.groups_agree.append(g)
        else:
            report.mismatches.append(m)
    _causes(report.mismatches, rd)
    report.mismatches.sort(key=lambda m: (not m.primary, m.group))
    return report


def count_completed(session: Session, run_id: int, report: FlightReport) -> None:
    """Fill ``report.completed`` and ``report.descs`` from the run's dump indexes (read again:
    only runs whose prediction is checked pay for it, not every Flight Recorder report)."""
    index, _ids, _decoded = _indexes(session, run_id)
    for r, x in index.items():
        for g, (desc, _first, _last, _dense, _codes, done) in x["groups"].items():
            report.completed.setdefault(g, {})[r] = done
            report.descs.setdefault(g, desc)


def _causes(mismatches: list[GroupMismatch], rd: dict[int, _RankDump]) -> None:
    """For each rank that did not reach a mismatch (group g, id q): what it was doing — its first
    entry after its last entry of g that is itself an unanswered collective (another group's
    mismatch it reached) — and whether it *skipped* g's collective or is *waiting* elsewhere.
    The reached rank's own history decides: if there the previous round of g precedes the
    previous round of the other group, the not-reached rank issued the other group's collective
    first — it skipped (the cause); otherwise it is waiting in a collective that comes first (a
    consequence). Without history to compare, it counts as skipped."""
    pending = {(r, m.group): m.seq for m in mismatches for r in m.reached}
    for m in mismatches:
        a = rd[m.reached[0]]
        for r in m.not_reached:
            x = rd[r]
            ents = x.norm["entries"]
            mine = x.by_group.get(m.group, {})
            after = max((ents[v[1]][6] for v in mine.values()), default=-1)
            blocked = None
            for i in sorted(range(len(ents)), key=lambda i: ents[i][6]):
                pg, seq, _p2p, sig, *_ = ents[i]
                name = x.norm["pgs"][pg][0]
                if ents[i][6] > after and name != m.group and pending.get((r, name)) == seq and not x.p2p[sig]:
                    blocked = i
                    break
            if blocked is None:
                m.cause[r] = "skipped"
                continue
            m.doing[r] = x.ref(blocked)
            h, s = m.doing[r].group, m.doing[r].seq
            prev_g, prev_h = a.by_group.get(m.group, {}).get(m.seq - 1), a.by_group.get(h, {}).get(s - 1)
            if prev_g is None or prev_h is None:
                m.cause[r] = "skipped"
            else:
                ag = a.norm["entries"][prev_g[1]][6]
                ah = a.norm["entries"][prev_h[1]][6]
                m.cause[r] = "skipped" if ag < ah else "waiting"
        m.primary = not m.not_reached or any(c == "skipped" for c in m.cause.values())


#: Capture records that name process groups and their members (capture/process_groups.py, capture/layout.py).
PG_RECORDS = ("graphdeck_process_groups", "graphdeck_parallel_layout")


def recorded_members(session: Session, run_id: int) -> dict[str, set[int]]:
    """Process-group name → member ranks from the capture's ``graphdeck_process_groups`` records
    (``{"groups": [{"name", "ranks"}]}``) and layout records (``meshes[].dim_groups[]``), the union
    over every rank's records; empty when the run has none (an imported log, older captures)."""
    out: dict[str, set[int]] = defaultdict(set)
    rows = session.execute(select(CompileEvent.name, CompileEvent.payload).where(
        CompileEvent.run_id == run_id, CompileEvent.name.in_(PG_RECORDS)))
    for name, payload in rows:
        try:
            data = json.loads(payload or "{}")
        except ValueError:
            continue
        groups = (data.get("groups") or []) if name == PG_RECORDS[0] else [
            dg for mesh in data.get("meshes") or [] for dg in mesh.get("dim_groups") or []]
        for grp in groups:
            ranks = grp.get("ranks") if isinstance(grp, dict) else None
            if grp.get("name") is not None and isinstance(ranks, list) and ranks:
                out[str(grp["name"])].update(r for r in ranks if isinstance(r, int))
    return dict(out)


def _group_mismatch(g: str, members: list[int], rd: dict[int, _RankDump], classes: _Classes,
                    ops: dict[int, str]) -> GroupMismatch | None:
    """Group ``g``'s first mismatch among ``members`` (module docstring), or None when they agree.
    Distinct sequences are compared (``classes``, from the dumps' indexes; ``ops``: global
    signature id → op), not every rank's; ``rd`` decodes only the ranks the mismatch shows."""
    have = [r for r in members if r in classes.index]
    found = classes.rows(g, have)
    if found is None:
        return None
    start, rows = found
    no_dump = [r for r in members if r not in classes.index]
    if len(rows) <= 1:  # a member without a dump is missing evidence, not a mismatch
        return None
    row_list = list(rows.items())
    for k in range(len(row_list[0][0])):
        if len({row[k] for row, _rs in row_list}) == 1:
            continue
        variants: dict = defaultdict(list)
        for row, rs in row_list:
            variants[row[k]] += rs
        real = [(key, sorted(rs)) for key, rs in variants.items() if key is not None]
        if not real:
            continue
        ref_key, reached = sorted(real, key=lambda kv: (-len(kv[1]), kv[1][0]))[0]
        not_reached = sorted(r for key, rs in variants.items() if key != ref_key for r in rs)
        if not not_reached:
            continue
        q = start + k
        seqmap = rd[reached[0]].by_group.get(g, {})
        ref = rd[reached[0]].ref(seqmap[q][1])
        kind = "missing" if None in variants else "op"
        first_op = {key: ops.get(key if key.__class__ is int else key[0]) for key in variants if key is not None}
        if kind == "op" and all(op == ref.op for op in first_op.values()):
            kind = "sizes"
        m = GroupMismatch(group=g, desc=rd[reached[0]].desc.get(g, ""), seq=q, op=ref.op, sizes=ref.sizes,
                          members=members, reached=reached, not_reached=not_reached, no_dump=no_dump,
                          kind=kind, issued={}, instead={}, last_completed={}, doing={})
        for r in m.reached[:8]:  # the collective as the first reached ranks recorded it (same op, sizes)
            m.issued[r] = rd[r].ref(rd[r].by_group[g][q][1])
        for r in not_reached:
            s = rd[r].by_group.get(g, {})
            m.instead[r] = rd[r].ref(s[q][1]) if q in s else None
            done = [p for p in s if p < q and rd[r].norm["entries"][s[p][1]][5]]
            m.last_completed[r] = rd[r].ref(s[max(done)][1]) if done else None
            m.doing[r] = rd[r].ref(rd[r].last_entry())
            if m.instead[r] is not None and m.doing[r] is not None and m.doing[r].seq == q \
                    and m.doing[r].group == g:
                m.doing[r] = m.instead[r]
        return m
    return None
