"""Flight Recorder dumps in: read, normalise and store each rank's collective ring buffer.

Input: the per-rank dumps torch's Flight Recorder writes (``torch._C._distributed_c10d.
_dump_fr_trace()`` → a pickle, ``_dump_fr_trace_json()`` → JSON, or on watchdog timeout
``$TORCH_FR_DUMP_TEMP_FILE<rank>``), torch 2.9–2.13 (dump ``version`` "2.x"). Both are a dict
``{"version", "pg_config": {pg name: {"name", "desc", "ranks": "[0, 1]"}}, "pg_status": {pg id:
{"last_enqueued_collective", "last_started_collective", "last_completed_collective"}},
"entries": [...]}``; an entry carries ``record_id``, ``process_group`` (pg name, desc),
``collective_seq_id``, ``p2p_seq_id``, ``profiling_name`` (``"gloo:all_reduce"``,
``"nccl:all_gather"``), ``input_sizes``/``output_sizes``/``input_dtypes``/``output_dtypes``,
``state`` (``scheduled``/``started``/``completed``), ``retired``, ``is_p2p``,
``time_created_ns`` and (pickle only) ``frames`` ``[{"filename", "line", "name"}]``, innermost
first. Files are recognised by content (pickle, JSON, either gzipped), never by name; the rank
is the dump's own ``rank`` when it has one, else the digits that end the file name (torch names
dumps ``<prefix><rank>``).

Stored form (:func:`normalise`): one ``compile_events`` row per rank, ``name`` =
:data:`EVENT_NAME`, ``payload`` = JSON ``{"version", "pg_config", "pg_status", "source",
"pgs": [[name, desc]], "sigs": [[op, in_sizes, out_sizes, dtypes]], "stacks": [["file:line in
fn", ...]], "entries": [[pg, seq, p2p_seq, sig, state, retired, record_id, stack, t_ns]],
"dropped": [why, ...]}`` (indices into the tables; a stack of -1 is none), and ``metadata_json``
= ``{"file", "entries", "dropped", "fr_index": seq_index(...)}``: per group, the signature of each
sequence id — what check-ranks compares, so it decodes only the payloads its report shows
(rows without ``fr_index``, from the capture or older stores, are indexed on read). Pickles are
read with an unpickler that refuses every class, so a dump cannot run code.

Lenient and counted: a file that is not an FR dump is skipped with its reason; an entry that
lacks its op, sequence id or group is dropped, counted and *named* in ``dropped`` (file, index,
record id, why) — :mod:`graphdeck.analysis.ranks.flight` turns any drop into missing evidence.

Raises (``import_flight_dumps``): :class:`~graphdeck.errors.NotFoundError` for a path that does
not exist, :class:`~graphdeck.errors.BadInputError` when no dump is among the paths or
(``strict``) an entry was dropped, :class:`~graphdeck.errors.UsageError` when two dumps name the
same rank or the run already holds a dump for that rank.
"""

from __future__ import annotations

import base64
import gc
import gzip
import hashlib
import json
import operator
import os
import re
import zlib
from dataclasses import dataclass, field
from itertools import compress, repeat
from pathlib import Path
from typing import TYPE_CHECKING

from graphdeck.errors import BadInputError, NotFoundError, UsageError
from graphdeck.store.fr_types import dump_problem, entry_problem
from graphdeck.store.lite import fs_text
from graphdeck.store.safe_pickle import Limits, TruncatedPickle, UnsafePickle, inflate_capped, load_plain

EVENT_NAME = "flight_recorder"
STATES = ("scheduled", "started", "completed")
#: Files of a folder larger than this are never FR dumps (a 2,000-entry dump is a few MiB).
MAX_DUMP_BYTES = 512 << 20
#: Files parsed in worker processes when at least this many are imported.
PARALLEL_FROM = 64
_RANK_RE = re.compile(r"(\d+)$")
_SUFFIXES = (".gz", ".json", ".pkl", ".pickle", ".bin")
if TYPE_CHECKING:
    from sqlalchemy.engine import Engine


#: What a Flight Recorder pickle may hold and cost (NOTE: [Bounded unpickling]).
FR_LIMITS = Limits(max_bytes=MAX_DUMP_BYTES)
#: Keys one of which a pickle found in a folder must name near its start to be read as an FR dump.
_FR_KEYS = (b"entries", b"pg_config", b"comm_lib_version", b"pg_status")


def file_head(path: str | Path, size: int = 4096) -> bytes:
    """The first ``size`` bytes of ``path``, inflated when it is gzipped; ``b""`` when unreadable."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(size)
        if head[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as fh:
                head = fh.read(size)
    except (OSError, EOFError):
        return b""
    return head


def sniff(path: str | Path, named: bool = False) -> bool:
    """Whether the file looks like an FR dump by its first bytes (gzipped or not): a pickle
    (``0x80`` and a protocol 2-5) naming ``entries``/``pg_config``/``comm_lib_version``/
    ``pg_status`` near its start — any such pickle when ``named`` (a file the user named, not one
    found in a folder) — or JSON naming ``entries``/``comm_lib_version``/``pg_config``; cheap,
    so folders of Kineto traces, logs and other pickles are not parsed."""
    head = file_head(path)
    if head[:1] == b"\x80":
        return len(head) > 1 and 2 <= head[1] <= 5 and (named or any(k in head for k in _FR_KEYS))
    if any(k in head for k in (b'"traceEvents"', b'"schemaVersion"', b'"deviceProperties"')):
        return False  # a Kineto / Chrome trace
    return head.lstrip()[:1] == b"{" and any(k in head for k in (b'"entries"', b'"comm_lib_version"', b'"pg_config"'))


def load_bytes(data: bytes) -> tuple[dict | None, str]:
    """``(dump, format)`` from a file's bytes, or ``(None, why)`` when they are no FR dump:
    ``why`` starts with ``"refused"`` for a file no torch writes (NOTE: [Bounded unpickling]),
    ``"bad gzip"`` / ``"unreadable"`` for a cut or corrupt one."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = inflate_capped(data, FR_LIMITS.max_bytes)
        except TruncatedPickle as exc:
            return None, str(exc)
        except UnsafePickle as exc:
            return None, f"refused: {exc}" if not str(exc).startswith("bad gzip") else str(exc)
    head = data[:64].lstrip()
    obj, fmt = None, ""
    try:
        if data[:1] == b"\x80":
            fmt = "pickle"
            obj = load_plain(data, FR_LIMITS)  # classes, bombs and shared-part expansion refused
        elif head[:1] == b"{":
            obj, fmt = json.loads(data), "json"
        else:
            return None, "neither pickle nor JSON"
    except TruncatedPickle as exc:
        return None, f"unreadable pickle: {exc}"
    except UnsafePickle as exc:
        return None, f"refused: {exc}"
    except RecursionError:
        return None, "refused: JSON nested too deep"
    except Exception as exc:  # noqa: BLE001 - any parse failure is a skipped file, named
        return None, f"unreadable {fmt or 'file'}: {type(exc).__name__}: {str(exc)[:120]}"
    if isinstance(obj, dict) and "version" in obj and "entries" not in obj and (
            isinstance(obj.get("pg_config"), dict) or isinstance(obj.get("pg_status"), dict)):
        obj["entries"] = []  # torch's JSON writer leaves 'entries' out of an empty ring buffer (2.7-2.13)
    if not isinstance(obj, dict) or not isinstance(obj.get("entries"), list) or "version" not in obj:
        return None, "not a Flight Recorder dump (no 'entries'/'version')"
    return obj, fmt


def rank_of(dump: dict, name: str) -> int | None:
    """The dump's own ``rank``, else the digits ending the file name (suffixes stripped)."""
    if isinstance(dump.get("rank"), int):
        return dump["rank"]
    stem = name
    while stem.endswith(_SUFFIXES):
        stem = stem[: stem.rfind(".")]
    m = _RANK_RE.search(stem)
    return int(m.group(1)) if m else None


def frame_text(f) -> str | None:
    if not isinstance(f, dict):
        return None
    return f"{f.get('filename')}:{f.get('line')} in {f.get('name')}"


_FIELDS = operator.itemgetter("record_id", "profiling_name", "collective_seq_id", "process_group", "input_sizes",
                              "output_sizes", "input_dtypes", "output_dtypes", "p2p_seq_id", "state", "retired",
                              "time_created_ns")
_STATE_IX = {s: i for i, s in enumerate(STATES)}
_P2P = ("send", "recv")
_LIST_OR_NONE, _STR_OR_NONE = frozenset({list, type(None)}), frozenset({str, type(None)})
_BOOL_OR_NONE, _INT_OR_NONE = frozenset({bool, type(None)}), frozenset({int, type(None)})


def normalise(dump: dict, source: str) -> dict:
    """The stored form of one rank's dump (see the module docstring); drops named in ``dropped``.

    # NOTE: [FR normalise speed]
    # A 2,000-entry dump normalises in ~2 ms (unpickling it takes ~3 ms). Where every entry has
    # every field with the right types (torch 2.9-2.13 write them all), the columns are taken
    # with C-level map/zip (:func:`_columns`); only signatures and stacks need a Python loop, and
    # there an entry is first compared (list ==, identity first) with the last one of the same
    # op and group — ring buffers repeat a few collectives — before its sizes are rendered with
    # ``str`` and its frames interned by the identities of their dicts (torch's pickles share
    # frame dicts between entries). Any odd entry sends the whole dump down the per-entry path
    # (:func:`_normalise_slow`), which names each dropped entry. Both give the same form.
    """
    ents = dump.get("entries") or []
    cols = _columns(ents) if ents else None
    if cols is None:
        cols = _normalise_slow(ents, source)
    return {"version": str(dump.get("version")), "pg_config": dump.get("pg_config") or {},
            "pg_status": dump.get("pg_status") or {}, "source": source, **cols}


def _stack_id(frames: list, by_ids: dict[tuple, int], stacks: dict[tuple, int]) -> int:
    """The interned id of an entry's stack (its frames' texts; -1: no frame has text), new ids
    numbered in ``stacks`` (texts → id); ``by_ids`` caches the answer per tuple of frame object ids
    (the frames stay alive while the dump is normalised)."""
    ik = tuple(map(id, frames))
    st = by_ids.get(ik, -2)
    if st == -2:
        text = tuple(t for t in map(frame_text, frames) if t)
        st = stacks.setdefault(text, len(stacks)) if text else -1
        by_ids[ik] = st
    return st


def _columns(ents: list) -> dict | None:
    """The fast path of :func:`normalise`: None unless every entry is a dict with every field,
    ``profiling_name`` a str, ``collective_seq_id`` an int and ``process_group`` a pair."""
    if set(map(type, ents)) != {dict}:
        return None
    try:
        rows = list(map(_FIELDS, ents))
    except KeyError:
        return None
    rid, op, seq, pg, ins, outs, idt, odt, p2p, state, retired, t_ns = zip(*rows)
    if set(map(type, op)) != {str} or set(map(type, seq)) != {int}:
        return None
    if not (set(map(type, ins + outs + idt + odt)) <= _LIST_OR_NONE and set(map(type, state)) <= _STR_OR_NONE
            and set(map(type, retired)) <= _BOOL_OR_NONE
            and set(map(type, map(dict.get, ents, repeat("frames")))) <= _LIST_OR_NONE
            and set(map(type, rid + t_ns + p2p)) <= _INT_OR_NONE
            and -(2**63) <= min(seq + tuple(filter(None, rid + t_ns + p2p)))
            and max(seq + tuple(filter(None, rid + t_ns + p2p))) < 2**63):
        return None  # some odd entry: the per-entry path names it
    kinds = set(map(type, pg))
    if kinds == {list}:  # JSON
        pg = tuple(map(tuple, pg))
    elif kinds != {tuple}:
        return None
    if set(map(len, pg)) != {2}:
        return None
    pgs: dict[tuple, int] = {}
    try:
        pg_ix = {p: pgs.setdefault((str(p[0]), str(p[1])), len(pgs)) for p in dict.fromkeys(pg)}
    except TypeError:  # a group name that is a list or a dict
        return None
    pgi = list(map(pg_ix.__getitem__, pg))
    sigs: dict[tuple, int] = {}
    sig_rows: list[list] = []
    stacks: dict[tuple, int] = {}
    by_ids: dict[tuple, int] = {}
    last_sig: dict[tuple, tuple] = {}
    last_st: dict[tuple, tuple] = {}
    sig_col: list[int] = []
    st_col: list[int] = []
    for o, p, a, b, c, d, fr in zip(op, pgi, ins, outs, idt, odt, map(dict.get, ents, repeat("frames"))):
        key = (o, p)
        k = (a, b, c, d)
        hit = last_sig.get(key)
        if hit is not None and hit[0] == k:
            sig_col.append(hit[1])
        else:
            sk = (o, str(a), str(b), str(c), str(d))
            si = sigs.get(sk)
            if si is None:
                si = sigs[sk] = len(sigs)
                sig_rows.append([o, a, b, (c or []) + (d or [])])
            last_sig[key] = (k, si)
            sig_col.append(si)
        if not fr:
            st_col.append(-1)
            continue
        hit = last_st.get(key)
        if hit is not None and hit[0] == fr:
            st_col.append(hit[1])
            continue
        st = _stack_id(fr, by_ids, stacks)
        last_st[key] = (fr, st)
        st_col.append(st)
    if set(map(type, rid)) != {int}:
        rid = [x if x.__class__ is int else i for i, x in enumerate(rid)]
    entries = list(map(list, zip(pgi, seq, [x or 0 for x in p2p], sig_col, map(_STATE_IX.get, state, repeat(-1)),
                                 [1 if x else 0 for x in retired], rid, st_col, [x or 0 for x in t_ns])))
    return {"pgs": [list(k) for k in pgs], "sigs": sig_rows, "stacks": [list(s) for s in stacks],
            "entries": entries, "dropped": []}


def _normalise_slow(ents: list, source: str) -> dict:
    """Entry by entry: drops an entry without its op, sequence id or group, naming it."""
    pgs: dict[tuple, int] = {}
    sigs: dict[tuple, int] = {}
    sig_rows: list[list] = []
    stacks: dict[tuple, int] = {}
    by_ids: dict[tuple, int] = {}
    entries: list[list] = []
    dropped: list[str] = []
    for i, e in enumerate(ents):
        try:
            rid, op, seq, pg, ins, outs, idt, odt, p2p, state, retired, t_ns = _FIELDS(e)
        except (KeyError, TypeError):
            if not isinstance(e, dict):
                dropped.append(f"{source} entry #{i} (record_id None): not a mapping")
                continue
            rid, op, seq, pg = e.get("record_id"), e.get("profiling_name"), e.get("collective_seq_id"), \
                e.get("process_group")
            ins, outs, idt, odt = e.get("input_sizes"), e.get("output_sizes"), e.get("input_dtypes"), \
                e.get("output_dtypes")
            p2p, state, retired, t_ns = e.get("p2p_seq_id"), e.get("state"), e.get("retired"), e.get("time_created_ns")
        if op.__class__ is not str or seq.__class__ is not int or pg.__class__ not in (tuple, list) or len(pg) != 2:
            why = ("no profiling_name" if not isinstance(op, str) else "no collective_seq_id"
                   if not isinstance(seq, int) else "no process_group")
            dropped.append(f"{source} entry #{i} (record_id {str(rid)[:40]}): {why}")
            continue
        why = entry_problem(e)
        if why:
            dropped.append(f"{source} entry #{i} (record_id {str(rid)[:40]}): {why}")
            continue
        pgi = pgs.setdefault((str(pg[0]), str(pg[1])), len(pgs))
        sk = (op, str(ins), str(outs), str(idt), str(odt))
        si = sigs.get(sk)
        if si is None:
            si = sigs[sk] = len(sigs)
            sig_rows.append([op, ins, outs, (idt or []) + (odt or [])])
        frames = e.get("frames")
        st = -1
        if frames:
            st = _stack_id(frames, by_ids, stacks)
        entries.append([pgi, seq, p2p or 0, si, _STATE_IX.get(state, -1), 1 if retired else 0,
                        rid if rid.__class__ is int else i, st, t_ns or 0])
    return {"pgs": [list(k) for k in pgs], "sigs": sig_rows, "stacks": [list(s) for s in stacks],
            "entries": entries, "dropped": dropped}


#: Version of the per-rank index below; an index of another version is recomputed on read.
INDEX_VERSION = 2


def seq_index(norm: dict) -> dict:
    """What the first-mismatch analysis compares, per rank, without the entries: ``{"v",
    "n": entries, "d": dropped, "sigs": norm's sigs, "pgc": digest of pg_config, "groups":
    {group name: [desc, first seq, last seq, dense, codes, done]}}``. Per group (point-to-point
    ops left out), the codes give each collective sequence id's signature (index into ``sigs``;
    a list for a coalesced id, null for an id the rank has no entry for): dense (``dense`` 1)
    one code per id from ``first`` to ``last``, else ``[seq, code]`` pairs; stored as the base64
    of the zlib of their JSON (:func:`pack_codes`; ring buffers repeat a few collectives, so a
    2,000-id group packs into ~100 bytes). ``done``: ids whose first entry is completed or
    retired. Stored in the dump's ``metadata_json`` (``fr_index``) by the importer — kept small,
    because queries that pick a rank's compile records read each row's start — so check-ranks
    compares ranks by these strings and decodes only the dumps its report shows."""
    sigs, ents = norm["sigs"], norm["entries"]
    p2p = [str(s[0]).endswith(_P2P) for s in sigs]
    names = [str(n) for n, _d in norm["pgs"]]
    desc: dict[str, str] = {}
    for n, d in norm["pgs"]:
        desc.setdefault(str(n), d)
    groups = None if any(p2p) or len(set(names)) < len(names) else _index_fast(ents, names, desc)
    if groups is None:
        groups = _index_slow(ents, names, desc, p2p)
    for g in groups.values():
        g[4] = pack_codes(g[4])
    pgc = hashlib.sha1(_dumps(norm.get("pg_config") or {}, sort_keys=True).encode()).hexdigest()[:16]
    return {"v": INDEX_VERSION, "n": len(ents), "d": len(norm["dropped"]), "sigs": sigs, "pgc": pgc,
            "groups": groups}


def pack_codes(codes: list) -> str:
    """:func:`seq_index`'s codes as text: base64 of the zlib of their JSON."""
    return base64.b64encode(zlib.compress(_dumps(codes).encode(), 6)).decode()


def unpack_codes(text: str) -> list:
    """The inverse of :func:`pack_codes`. Raises ``ValueError`` (or ``zlib.error``) on bad text."""
    return json.loads(zlib.decompress(base64.b64decode(text)))


def _index_fast(ents: list, names: list[str], desc: dict) -> dict | None:
    """:func:`seq_index`'s groups with C-level filters (compress), where each group's ids run
    one by one in entry order — no gap, no coalesced id (the common case); else None."""
    if not ents:
        return {}
    pg, seq, _p2p, sig, state, retired = list(zip(*ents))[:6]
    done = list(map(operator.or_, map((2).__eq__, state), retired))
    groups = {}
    for p, name in enumerate(names):
        mask = list(map(p.__eq__, pg))
        qs = list(compress(seq, mask))
        if not qs:
            continue
        if qs != list(range(qs[0], qs[0] + len(qs))):
            return None
        groups[name] = [desc.get(name, ""), qs[0], qs[-1], 1, list(compress(sig, mask)), sum(compress(done, mask))]
    return groups


def _index_slow(ents: list, names: list[str], desc: dict, p2p: list[bool]) -> dict:
    tables: dict[str, dict] = {n: {} for n in names}
    per = [tables[n] for n in names]
    for i, e in enumerate(ents):
        sig = e[3]
        if p2p[sig]:
            continue
        table = per[e[0]]
        slot = table.get(e[1])
        if slot is None:
            table[e[1]] = [sig, i]
        else:  # coalesced: one sequence id, several ops
            slot.append(sig)
    groups = {}
    for name, table in tables.items():
        if not table:
            continue
        codes = {q: (v[0] if len(v) == 2 else [v[0], *v[2:]]) for q, v in table.items()}
        first, last = min(table), max(table)
        dense = last - first + 1 <= 2 * len(table) + 64
        done = sum(1 for v in table.values() if ents[v[1]][4] == 2 or ents[v[1]][5])
        groups[name] = [desc.get(name, ""), first, last, 1 if dense else 0,
                        [codes.get(q) for q in range(first, last + 1)] if dense
                        else [[q, codes[q]] for q in sorted(table)], done]
    return groups


def _parse_file(path: str) -> tuple:
    """Worker: ``(path, rank, stored payload JSON | None, skip reason | None, entries, drops,
    metadata JSON (file, counts, :func:`seq_index`) | None, dropped entries named, pg_config)``.
    The garbage collector is off meanwhile: a dump is ~10^5 new containers, none of them cyclic,
    and the collections they would trigger cost more than reading them (torch's loader does so too)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse_file_gc_off(path)
    finally:
        if enabled:
            gc.enable()


def _parse_file_gc_off(path: str) -> tuple:
    p = Path(path)
    try:
        if p.stat().st_size == 0:
            return _skip(path, "empty")
        if p.stat().st_size > MAX_DUMP_BYTES:
            return _skip(path, "too large for a dump")
        dump, fmt = load_bytes(p.read_bytes())
    except OSError as exc:
        return _skip(path, f"unreadable: {exc}")
    if dump is None:
        return _skip(path, fmt)
    problem = dump_problem(dump)
    if problem:
        return _skip(path, f"refused: not a Flight Recorder dump torch writes: {problem}")
    if not dump["entries"] and not dump.get("pg_config"):
        return _skip(path, "empty Flight Recorder dump (no entries, no groups)")
    rank = rank_of(dump, p.name)
    if rank is None:
        return _skip(path, "FR dump without a rank (no 'rank' key, no digits ending its name)")
    norm = normalise(dump, p.name)
    norm["format"] = fmt
    n, d = len(norm["entries"]), len(norm["dropped"])
    meta = {"file": fs_text(p.name), "entries": n, "dropped": d, "fr_index": seq_index(norm)}
    return path, rank, _dumps(norm), None, n, d, _dumps(meta), norm["dropped"], norm["pg_config"]


def _skip(path: str, why: str) -> tuple:
    return path, None, None, why, 0, 0, None, [], None


def _dumps(obj, sort_keys: bool = False) -> str:
    try:
        import orjson

        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS if sort_keys else None).decode()
    except TypeError:  # an integer past 64 bits, a non-string key: the slower encoder takes them
        return json.dumps(obj, separators=(",", ":"), sort_keys=sort_keys, default=str)
    except ImportError:  # pragma: no cover
        return json.dumps(obj, separators=(",", ":"), sort_keys=sort_keys)


def discover(paths) -> list[str]:
    """Files to look at: the paths themselves, and every file under a directory (sorted)."""
    out: list[str] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise NotFoundError(f"{p} does not exist", resource="path", id=str(p))
        out.extend(sorted(str(x) for x in p.rglob("*") if x.is_file()) if p.is_dir() else [str(p)])
    return out


@dataclass
class FlightImport:
    """What :func:`import_flight_dumps` read: ``ranks`` stored, ``entries``/``dropped`` counts,
    ``dropped_records`` (named), ``skipped`` ("file: why"), ``refused`` ("file: why", files no
    torch writes — hostile or not a dump — among ``skipped`` too: the caller exits 2 after
    keeping the rest) and ``missing_ranks`` (members of a recorded group without a dump)."""

    run_id: int
    ranks: list[int] = field(default_factory=list)
    entries: int = 0
    dropped: int = 0
    dropped_records: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse_files(files: list[str], workers: int | None = None) -> list[tuple]:
    """:func:`_parse_file` over ``files``, in worker processes when there are many."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if len(files) < PARALLEL_FROM or workers <= 1:
        return [_parse_file(f) for f in files]
    from concurrent.futures import ProcessPoolExecutor  # here: importing it registers an atexit hook,
    # which fails once the interpreter shuts down, where the capture's last dump imports this module

    with ProcessPoolExecutor(max_workers=workers) as ex:
        # small chunks: the last ones finish together (a 128-dump chunk left to one worker costs ~0.7 s)
        return list(ex.map(_parse_file, files, chunksize=max(1, min(16, len(files) // (workers * 4)))))


def import_flight_dumps(engine: Engine, paths, *, run_name: str, strict: bool = False,
                        files: list[str] | None = None, workers: int | None = None) -> FlightImport:
    """Store the FR dumps found at ``paths`` (files or folders; other files are skipped, named)
    as run ``run_name`` (created if missing). ``files``: an already discovered list."""
    from sqlalchemy import insert, select  # here, so `graphdeck import` of logs alone never loads SQLAlchemy
    from sqlalchemy.orm import Session

    from graphdeck.store.db import get_or_create_run
    from graphdeck.store.schema import CompileEvent, Rank

    files = files if files is not None else discover([paths] if isinstance(paths, (str, Path)) else paths)
    parsed = parse_files(files, workers)
    skipped = [f"{Path(x[0]).name}: {x[3]}" for x in parsed if x[3]]
    found = [x for x in parsed if x[2] is not None]
    if not found:
        raise BadInputError("no Flight Recorder dump found" + (f" (skipped: {'; '.join(skipped[:10])})" if skipped
                                                                 else ""), skipped_files=skipped)
    by_rank: dict[int, list[str]] = {}
    for p, r, *_ in found:
        by_rank.setdefault(r, []).append(Path(p).name)
    same = {r: n for r, n in by_rank.items() if len(n) > 1}
    if same:
        raise UsageError("several Flight Recorder dumps name the same rank: "
                         + "; ".join(f"rank {r}: {', '.join(n)}" for r, n in sorted(same.items())))
    drops = sum(x[5] for x in found)
    if strict and drops:
        raise BadInputError(f"strict import: {drops} Flight Recorder entries dropped")
    # A file that looks like a dump but cannot be read (cut, corrupt) is a rank's lost evidence,
    # not just a skipped file: its rank (from the name) is kept as a member without a dump, and
    # the failure is stored for check-ranks' missing evidence (never "all ranks agree").
    broken: dict[int | None, list[str]] = {}
    for path, _r, _pl, why, *_rest in parsed:
        if why and why.startswith(("unreadable", "bad gzip")):
            name = Path(path).name
            r = rank_of({}, name)
            broken.setdefault(None if r in by_rank else r, []).append(f"{name}: {why}")
    if strict and broken:
        raise BadInputError("strict import: unreadable Flight Recorder dump(s): "
                            + "; ".join(x for v in broken.values() for x in v))
    with Session(engine) as s, s.begin():
        run = get_or_create_run(s, run_name, meta={"source": "flight_recorder"})
        have = set(s.scalars(select(CompileEvent.rank).where(CompileEvent.run_id == run.id,
                                                             CompileEvent.name == EVENT_NAME)))
        clash = sorted(have & set(by_rank))
        if clash:
            raise UsageError(f"run {run_name!r} already has Flight Recorder dumps for rank(s) {clash}")
        result = FlightImport(run_id=run.id, skipped=skipped,
                              refused=[f"{Path(x[0]).name}: {x[3]}" for x in parsed if x[3] and x[3].startswith("refused")])
        members: set[int] = set()
        existing = set(s.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
        first = min(by_rank)
        lost = {(r if r is not None else first): v for r, v in broken.items()}
        new = [{"run_id": run.id, "rank": r, "world_size": 1,
                "meta_json": json.dumps({"broken_flight_dumps": lost[r]}) if r in lost else "{}"}
               for r in sorted(set(by_rank) | set(lost)) if r not in existing]
        for r in sorted(set(lost) & existing):  # a rank the run knew already: add to its meta
            row = s.scalar(select(Rank).where(Rank.run_id == run.id, Rank.rank == r))
            meta = json.loads(row.meta_json or "{}")
            meta["broken_flight_dumps"] = (meta.get("broken_flight_dumps") or []) + lost[r]
            row.meta_json = json.dumps(meta)
        result.dropped_records += [f"unreadable dump {x}" for v in lost.values() for x in v]
        if new:  # one statement each for the ranks and the dumps (1,024 ranks: ~1 s saved)
            s.execute(insert(Rank), new)
        rows = []
        for _path, rank, payload, _why, n, d, meta, named, pg_config in sorted(found, key=lambda x: x[1]):
            rows.append({"run_id": run.id, "rank": rank, "name": EVENT_NAME, "compile_id": None, "payload": payload,
                         "metadata_json": meta})
            result.entries += n
            result.dropped += d
            result.dropped_records += named
            if d or rank == first:  # membership is the same in every dump; read it once
                members |= members_of(pg_config)
        s.execute(insert(CompileEvent), rows)
        result.ranks = sorted(by_rank)
        result.missing_ranks = sorted(members - set(by_rank))
        top = max(set(by_rank) | set(lost))
        result.missing_ranks = sorted((members | set(lost)) - set(by_rank))
        if (run.world_size or 0) < max(len(members), top + 1):
            run.world_size = max(len(members), top + 1)
    return result


def members_of(pg_config: dict) -> set[int]:
    """Every global rank any group of a dump's ``pg_config`` names (``"ranks": "[0, 1]"``)."""
    out: set[int] = set()
    for cfg in (pg_config or {}).values():
        ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                ranks = None
        if isinstance(ranks, list):
            out |= {r for r in ranks if isinstance(r, int)}
    return out
