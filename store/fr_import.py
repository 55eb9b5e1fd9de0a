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
"dropped": [why, ...]}`` (indices into the tables; a stack of -1 is none). Pickles are read with
an unpickler that refuses every class, so a dump cannot run code.

Lenient and counted: a file that is not an FR dump is skipped with its reason; an entry that
lacks its op, sequence id or group is dropped, counted and *named* in ``dropped`` (file, index,
record id, why) — :mod:`graphdeck.analysis.flight` turns any drop into missing evidence.

Raises (``import_flight_dumps``): :class:`~graphdeck.errors.NotFoundError` for a path that does
not exist, :class:`~graphdeck.errors.BadInputError` when no dump is among the paths or
(``strict``) an entry was dropped, :class:`~graphdeck.errors.UsageError` when two dumps name the
same rank or the run already holds a dump for that rank.
"""

from __future__ import annotations

import gc
import gzip
import io
import json
import operator
import os
import pickle
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.errors import BadInputError, NotFoundError, UsageError

EVENT_NAME = "flight_recorder"
STATES = ("scheduled", "started", "completed")
#: Files of a folder larger than this are never FR dumps (a 2,000-entry dump is a few MiB).
MAX_DUMP_BYTES = 512 << 20
#: Files parsed in worker processes when at least this many are imported.
PARALLEL_FROM = 64
_RANK_RE = re.compile(r"(\d+)$")
_SUFFIXES = (".gz", ".json", ".pkl", ".pickle", ".bin")


class _NoClasses(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: D401 - FR pickles hold builtins only
        raise pickle.UnpicklingError(f"refused class {module}.{name} in a Flight Recorder dump")


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


def sniff(path: str | Path) -> bool:
    """Whether the file looks like an FR dump by its first bytes: a pickle (``0x80``), or JSON
    naming ``entries``/``comm_lib_version``/``pg_config`` near its start (gzipped or not); cheap,
    so folders of Kineto traces and logs are not parsed."""
    head = file_head(path)
    if head[:1] == b"\x80":
        return True
    if any(k in head for k in (b'"traceEvents"', b'"schemaVersion"', b'"deviceProperties"')):
        return False  # a Kineto / Chrome trace
    return head.lstrip()[:1] == b"{" and any(k in head for k in (b'"entries"', b'"comm_lib_version"', b'"pg_config"'))


def load_bytes(data: bytes) -> tuple[dict | None, str]:
    """``(dump, format)`` from a file's bytes, or ``(None, why)`` when they are no FR dump."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            return None, f"bad gzip: {exc}"
    head = data[:64].lstrip()
    obj, fmt = None, ""
    try:
        if data[:1] == b"\x80":
            # a buffered reader: the unpickler then peeks whole chunks instead of reading each
            # opcode of these frameless protocol-2 pickles through a Python call (7x faster)
            reader = io.BufferedReader(io.BytesIO(data), buffer_size=min(max(len(data), 8192), 16 << 20))
            obj, fmt = _NoClasses(reader).load(), "pickle"
        elif head[:1] == b"{":
            obj, fmt = json.loads(data), "json"
        else:
            return None, "neither pickle nor JSON"
    except Exception as exc:  # noqa: BLE001 - any parse failure is a skipped file, named
        return None, f"unreadable {fmt or 'file'}: {type(exc).__name__}: {str(exc)[:120]}"
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


def normalise(dump: dict, source: str) -> dict:
    """The stored form of one rank's dump (see the module docstring); drops named in ``dropped``.

    # NOTE: [FR normalise speed]
    # torch's dump pickles share frame dicts between entries (memoised), so stacks are
    # interned by the identities of their frame dicts first and rendered once each; sizes and
    # dtypes by their ``str``. A 2,000-entry dump normalises in a few ms.
    """
    pgs: dict[tuple, int] = {}
    sigs: dict[tuple, int] = {}
    sig_rows: list[list] = []
    stacks: dict[tuple, int] = {}
    by_ids: dict[tuple, int] = {}
    entries: list[list] = []
    dropped: list[str] = []
    state_ix = {s: i for i, s in enumerate(STATES)}
    fields = operator.itemgetter("record_id", "profiling_name", "collective_seq_id", "process_group", "input_sizes",
                                 "output_sizes", "input_dtypes", "output_dtypes", "p2p_seq_id", "state", "retired",
                                 "time_created_ns")
    for i, e in enumerate(dump.get("entries") or []):
        try:  # the fast path: every field there (torch 2.9-2.13 write them all)
            rid, op, seq, pg, ins, outs, idt, odt, p2p, state, retired, t_ns = fields(e)
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
            dropped.append(f"{source} entry #{i} (record_id {rid}): {why}")
            continue
        pgi = pgs.get(pg) if pg.__class__ is tuple else None  # a tuple (pickle) or a list (JSON)
        if pgi is None:
            pgk = (str(pg[0]), str(pg[1]))
            pgi = pgs.setdefault(pgk, len(pgs))
            if pg.__class__ is tuple:
                pgs[pg] = pgi
        sk = (op, str(ins), str(outs), str(idt), str(odt))
        si = sigs.get(sk)
        if si is None:
            si = sigs[sk] = len(sigs)
            sig_rows.append([op, ins, outs, (idt or []) + (odt or [])])
        frames = e.get("frames")
        st = -1
        if frames:
            ik = tuple(map(id, frames))
            st = by_ids.get(ik, -2)
            if st == -2:
                text = tuple(t for t in map(frame_text, frames) if t)
                st = stacks.setdefault(text, len(stacks)) if text else -1
                by_ids[ik] = st
        entries.append([pgi, seq, p2p or 0, si, state_ix.get(state, -1), 1 if retired else 0,
                        rid if rid.__class__ is int else i, st, t_ns or 0])
    names = {v: k for k, v in pgs.items() if isinstance(k[0], str) and isinstance(k[1], str)}
    return {"version": str(dump.get("version")), "pg_config": dump.get("pg_config") or {},
            "pg_status": dump.get("pg_status") or {}, "source": source,
            "pgs": [list(names[i]) for i in range(len(names))], "sigs": sig_rows,
            "stacks": [list(s) for s in stacks], "entries": entries, "dropped": dropped}


def _parse_file(path: str) -> tuple[str, int | None, str | None, str | None, int, int]:
    """Worker: ``(path, rank, stored payload JSON | None, skip reason | None, entries, drops)``.
    The garbage collector is off meanwhile: a dump is ~10^5 new containers, none of them cyclic,
    and the collections they would trigger cost more than reading them (torch's loader does so too)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse_file_gc_off(path)
    finally:
        if enabled:
            gc.enable()


def _parse_file_gc_off(path: str) -> tuple[str, int | None, str | None, str | None, int, int]:
    p = Path(path)
    try:
        if p.stat().st_size == 0:
            return path, None, None, "empty", 0, 0
        if p.stat().st_size > MAX_DUMP_BYTES:
            return path, None, None, "too large for a dump", 0, 0
        dump, fmt = load_bytes(p.read_bytes())
    except OSError as exc:
        return path, None, None, f"unreadable: {exc}", 0, 0
    if dump is None:
        return path, None, None, fmt, 0, 0
    if not dump["entries"] and not dump.get("pg_config"):
        return path, None, None, "empty Flight Recorder dump (no entries, no groups)", 0, 0
    rank = rank_of(dump, p.name)
    if rank is None:
        return path, None, None, "FR dump without a rank (no 'rank' key, no digits ending its name)", 0, 0
    norm = normalise(dump, p.name)
    norm["format"] = fmt
    return path, rank, _dumps(norm), None, len(norm["entries"]), len(norm["dropped"])


def _dumps(obj) -> str:
    try:
        import orjson

        return orjson.dumps(obj).decode()
    except ImportError:  # pragma: no cover
        return json.dumps(obj, separators=(",", ":"))


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
    ``dropped_records`` (named), ``skipped`` ("file: why") and ``missing_ranks`` (members of a
    recorded group without a dump)."""

    run_id: int
    ranks: list[int] = field(default_factory=list)
    entries: int = 0
    dropped: int = 0
    dropped_records: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse_files(files: list[str], workers: int | None = None) -> list[tuple]:
    """:func:`_parse_file` over ``files``, in worker processes when there are many."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if len(files) < PARALLEL_FROM or workers <= 1:
        return [_parse_file(f) for f in files]
    with ProcessPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(_parse_file, files, chunksize=max(1, len(files) // (workers * 4))))


def import_flight_dumps(engine: Engine, paths, *, run_name: str, strict: bool = False,
                        files: list[str] | None = None, workers: int | None = None) -> FlightImport:
    """Store the FR dumps found at ``paths`` (files or folders; other files are skipped, named)
    as run ``run_name`` (created if missing). ``files``: an already discovered list."""
    from graphdeck.store.db import get_or_create_run
    from graphdeck.store.schema import CompileEvent, Rank

    files = files if files is not None else discover([paths] if isinstance(paths, (str, Path)) else paths)
    parsed = parse_files(files, workers)
    skipped = [f"{Path(p).name}: {why}" for p, _r, _pl, why, _n, _d in parsed if why]
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
    with Session(engine) as s, s.begin():
        run = get_or_create_run(s, run_name, meta={"source": "flight_recorder"})
        have = set(s.scalars(select(CompileEvent.rank).where(CompileEvent.run_id == run.id,
                                                             CompileEvent.name == EVENT_NAME)))
        clash = sorted(have & set(by_rank))
        if clash:
            raise UsageError(f"run {run_name!r} already has Flight Recorder dumps for rank(s) {clash}")
        result = FlightImport(run_id=run.id, skipped=skipped)
        members: set[int] = set()
        existing = set(s.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
        new = [{"run_id": run.id, "rank": r, "world_size": 1, "meta_json": "{}"} for r in sorted(by_rank)
               if r not in existing]
        if new:  # one statement each for the ranks and the dumps (1,024 ranks: ~1 s saved)
            s.execute(insert(Rank), new)
        first = min(by_rank)
        rows = []
        for path, rank, payload, _why, n, d in sorted(found, key=lambda x: x[1]):
            rows.append({"run_id": run.id, "rank": rank, "name": EVENT_NAME, "compile_id": None, "payload": payload,
                         "metadata_json": json.dumps({"file": Path(path).name, "entries": n, "dropped": d})})
            result.entries += n
            result.dropped += d
            if d or rank == first:  # membership is the same in every dump; read it once
                norm = json.loads(payload)
                result.dropped_records += norm["dropped"]
                members |= members_of(norm["pg_config"])
        s.execute(insert(CompileEvent), rows)
        result.ranks = sorted(by_rank)
        result.missing_ranks = sorted(members - set(by_rank))
        if (run.world_size or 0) < max(len(members), max(by_rank) + 1):
            run.world_size = max(len(members), max(by_rank) + 1)
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
