"""Import TORCH_TRACE structured compile logs (the logs tlparse reads) into the store.

``import_torch_trace(engine, paths, run_name=...)`` reads ``dedicated_log_torch_trace_rank_<r>_*.log``
files (one per rank; a directory is searched for them) or single-process logs without a rank,
and writes one run:

* ``dynamo_output_graph`` → a ``dynamo`` graph; ``optimize_ddp_split_child`` → ``ddp_partition``
  graphs (``parent_id`` = the Dynamo graph) with a ``partitions`` row each;
  ``aot_joint_graph`` / ``aot_forward_graph`` / ``aot_backward_graph`` / ``aot_inference_graph`` →
  ``aot_joint`` / ``aot_forward`` / ``aot_backward`` / ``aot_inference`` (``parent_id`` = the graph
  AOTAutograd traced, a DDP bucket's when split); Inductor's pre-/post-grad graphs
  (``inductor_pre_grad_graph`` / ``after_pre_grad_graph``, ``inductor_post_grad_graph`` /
  ``after_post_grad_graph``) → ``inductor_pre_grad`` / ``inductor_post_grad`` (a post-grad graph's
  parent is the AOT graph with the same inputs); ``compiled_autograd_graph`` → ``compiled_autograd``
  (parent of Dynamo's trace of it, ``!0/1/0``); ``exported_program`` → ``export``.
  Nodes, edges, shapes, dtypes, strides, devices and source lines come from the printed graph
  (:mod:`graphdeck.store.fx_text`).
* Parameters: ``describe_source``/``describe_tensor`` records name each graph input's source
  (``L['self']._modules['emb']._parameters['weight']`` → ``emb.weight``) → ``params`` rows and
  ``graph_io`` ``in`` bindings; AOT descriptors (``PlainAOTInput(idx=k)``,
  ``ParamAOTInput(target=...)``, ``GradAOTOutput(grad_of=...)``) carry them to the AOT graphs and
  bind each backward output to the gradient it is (``has_grad`` false for ``None``), which is
  what :func:`graphdeck.analysis.gradients.core.gradient_report` reads.
* Every other record (guards, ``compilation_metrics``, graph-break and recompile reasons,
  ``inductor_output_code``, artifacts) → ``compile_events`` (payload kept up to 1 MB), with
  ``metadata_json.graph_id`` pointing at the graph an output code or provenance belongs to.
* Inductor provenance (v1 and v2 formats) → ``kernel_nodes`` (kernel → post-grad node →
  pre-grad node), ``graph_id`` = the post-grad graph, kernels named as the profiler shows them
  (``extern_kernels.mm`` → ``aten::mm``), the debug handle in ``call_index`` when that column exists.

Printed graphs repeated across compiles and ranks (same payload md5) are parsed once per import
(:class:`~graphdeck.store.torch_trace_build.GraphCache`).

Compile ids are ``"frame/compile"`` as the capture agent writes them, with tlparse's
``_attempt`` suffix when the attempt is nonzero and ``!<compiled-autograd id>`` in front under
compiled autograd. Rank: the file name's ``rank_<r>`` when present, else the envelopes' ``rank``,
else 0. When a file's envelopes name another rank than its file name, the file name wins (two
files are two processes; taking the envelope's rank would merge them) and the disagreement is
kept in ``ranks.meta_json`` (``envelope_rank``, ``rank_mismatch``) and in the result.

Lenient and counted (``ImportResult.stats``): ``bad_line``, ``bad_json``,
``truncated_payload``, ``no_kind``, ``other_rank`` (a line whose envelope names a rank other than
the file's) and ``unknown_kind`` (kept as a compile event, counted) are drops. ``md5_mismatch``
(a payload whose digest is not its envelope's ``has_payload``) is no drop: the record is kept and
used, marked ``"unverified": "md5_mismatch"`` in its graph's ``meta_json`` / compile event's
``metadata_json``, counted in ``stats["unverified"]`` and named per rank in ``ranks.meta_json``
(``unverified``, ``unverified_records``) so a finding that rests on it says so
(:func:`graphdeck.analysis.ranks.flight.unverified_evidence`). With ``strict=True`` any drop or
unverified record raises :class:`~graphdeck.errors.BadInputError` and nothing of the
import is kept.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from graphdeck.errors import BadInputError, NotFoundError, UsageError
from graphdeck.store.lite import fs_text
from graphdeck.store.torch_trace_build import KNOWN_KINDS, FileBuilder, GraphCache
from graphdeck.store.torch_trace_log import (
    GLOG_RE,
    LogReader,
    ReadStats,
    discover,
    open_log,
    rank_from_filename,
)
from graphdeck.store.torch_trace_rows import RowWriter, open_writer
from graphdeck.store.writers import WRITER_KEY, alive, describe, stamp

#: Counters that are drops: any of them nonzero fails a strict import.
DROP_KEYS = ("bad_line", "bad_json", "truncated_payload", "no_kind", "other_rank",
             "unknown_kind", "orphan_payload_lines")
#: Counters of records kept whose payload could not be verified (a strict import fails on them too).
UNVERIFIED_KEYS = ("md5_mismatch",)
COMMIT_EVERY_RECORDS = 2000


@dataclass
class ImportResult:
    """What an import stored and dropped.

    ``stats``: summed counters (``records``, ``graphs``, ``nodes``, ``edges``, ``graph_io``,
    ``partitions``, ``compile_events``, ``kernel_nodes``, ``params`` and the drops in
    :data:`DROP_KEYS`); ``files``: one dict per file read (``path``, ``rank``, ``file_rank``,
    ``envelope_rank``, ``rank_mismatch``, ``counts``); ``skipped_files``: "name: why" for files of
    a directory that are not logs (empty, other text); ``replaced``: which ranks a killed import
    had left half-written and this one replaced (NOTE: [Writer stamps]), else ``None``.
    """

    run_id: int
    run_name: str
    ranks: list[int]
    stats: dict[str, int]
    files: list[dict] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    replaced: str | None = None

    @property
    def dropped(self) -> int:
        return sum(self.stats.get(k, 0) for k in DROP_KEYS)

    @property
    def unverified(self) -> int:
        """Records kept and used though their payload's md5 failed."""
        return sum(self.stats.get(k, 0) for k in UNVERIFIED_KEYS)

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "run_name": self.run_name, "ranks": self.ranks, "stats": self.stats,
                "dropped": self.dropped, "unverified": self.unverified, "files": self.files, "skipped_files": self.skipped_files}


def import_torch_trace(engine, paths, *, run_name: str, strict: bool = False,
                       progress: bool = False) -> ImportResult:
    """Import the TORCH_TRACE logs at ``paths`` (a file, a directory, or a list of them) as run
    ``run_name`` (created if missing; a rank it already holds is refused).

    ``engine``: the store, a SQLAlchemy ``Engine`` or a path / URL. A SQLite path (the CLI's
    case) is written with ``sqlite3`` alone when the store is new or current, without importing
    SQLAlchemy (NOTE: [SQLite store without SQLAlchemy] in store/lite.py); other stores are
    opened with :func:`graphdeck.store.db.open_engine`. ``progress`` shows a tqdm bar over the
    bytes read (on stderr).

    Raises:
        NotFoundError: a path does not exist.
        BadInputError: no TORCH_TRACE log among ``paths``, or (``strict``) any record dropped;
            ``details["stats"]`` holds the counters. Nothing of this import is kept then.
        UsageError: the run already has one of the ranks being imported, or two logs resolve to
            the same rank (e.g. two single-process logs without a rank).
    """
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    for p in items:
        if not Path(p).exists():
            raise NotFoundError(f"{p} does not exist", resource="path", id=str(p))
    files, skipped = discover(items)
    if not files:
        raise BadInputError(f"no TORCH_TRACE log found in {', '.join(map(str, items))}"
                            + (f" (skipped: {'; '.join(skipped)})" if skipped else ""), skipped_files=skipped)
    plan = [(f, *_plan_rank(f)) for f in files]
    by_rank: dict[int, list[str]] = {}
    for f, rank, _, _ in plan:
        by_rank.setdefault(rank, []).append(f.name)
    same = {r: names for r, names in by_rank.items() if len(names) > 1}
    if same:
        raise UsageError("several logs resolve to the same rank (import them as separate runs): "
                         + "; ".join(f"rank {r}: {', '.join(n)}" for r, n in sorted(same.items())))
    w = open_writer(engine)
    try:
        return _import(w, plan, skipped, run_name, strict, progress)
    finally:
        w.close()


def _import(w: RowWriter, plan: list, skipped: list[str], run_name: str, strict: bool, progress: bool) -> ImportResult:
    files = [p[0] for p in plan]
    w.begin()
    try:
        run_id = w.scalar("SELECT id FROM runs WHERE name = ?", (run_name,))
        created_run = run_id is None
        if created_run:
            run_id = w.insert("runs", {"name": run_name, "world_size": None,
                                       "meta_json": json.dumps({"source": "torch_trace"})})
        wanted = {r for _, r, _, _ in plan}
        dead = _killed_imports(w, run_id, wanted)
        if dead:  # ranks a killed import left half-written: replaced (NOTE: [Writer stamps])
            _delete_ranks(w, run_id, sorted(dead))
            result_note = (f"replaced rank(s) {sorted(dead)} left half-imported by a killed import "
                           f"({'; '.join(sorted(set(dead.values())))})")
        else:
            result_note = None
        taken = {r for (r,) in w.rows("SELECT DISTINCT rank FROM graphs WHERE run_id = ?", (run_id,))}
        busy = {r: describe(_writer(m)) for r, m in w.rows(
            "SELECT rank, meta_json FROM ranks WHERE run_id = ? AND meta_json LIKE ?", (run_id, f'%"{WRITER_KEY}"%'))
            if r in wanted}  # an import of them that lives, or whose host is not this one
        clash = sorted((taken & wanted) | set(busy))
        if clash:
            being = (f" ({', '.join(f'rank {r} is being imported by {who}' for r, who in sorted(busy.items()))}; "
                     "if that import died on another host, delete-run the run and import again)") if busy else ""
            raise UsageError(f"run {run_name!r} already has rank(s) {clash}{being}; import into another --run")
        w.commit()
    except BaseException:
        w.rollback()
        raise
    result = ImportResult(run_id=run_id, run_name=run_name, ranks=sorted({r for _, r, _, _ in plan}),
                          stats={}, skipped_files=skipped, replaced=result_note)
    total = Counter()
    bar = _progress(sum(f.stat().st_size for f in files)) if progress else None
    cache = GraphCache()
    try:
        for path, rank, file_rank, env_rank in plan:
            counts = _import_file(w, run_id, path, rank, env_rank, strict, bar, cache)
            total.update(counts)
            mismatch = file_rank is not None and env_rank is not None and env_rank != file_rank
            result.files.append({"path": str(path), "rank": rank, "file_rank": file_rank, "envelope_rank": env_rank,
                                 "rank_mismatch": mismatch, "counts": dict(counts)})
            if mismatch:
                total["rank_mismatch_files"] += 1
    except BaseException:  # a strict drop, or anything unexpected (KeyboardInterrupt too): keep nothing
        w.rollback()
        _discard(w, run_id, result.ranks, drop_run=created_run)
        raise
    finally:
        if bar is not None:
            bar.close()
    total["files"] = len(files)
    total["skipped_files"] = len(skipped)
    result.stats = dict(sorted(total.items()))
    w.begin()
    ranks = [r for (r,) in w.rows("SELECT rank FROM ranks WHERE run_id = ?", (run_id,))]
    # a log names no world size: the ranks imported (and the highest rank) bound it from below
    world = max(w.scalar("SELECT world_size FROM runs WHERE id = ?", (run_id,)) or 0, len(ranks),
                max(ranks, default=-1) + 1)
    w.update("runs", run_id, {"world_size": world})
    w.execute("UPDATE ranks SET world_size = ? WHERE run_id = ? AND world_size < ?", (world, run_id, world))
    for rank in result.ranks:  # done: the ranks lose their writer stamp (NOTE: [Writer stamps])
        row = w.rows("SELECT id, meta_json FROM ranks WHERE run_id = ? AND rank = ?", (run_id, rank))
        if row:
            meta = json.loads(row[0][1] or "{}")
            meta.pop(WRITER_KEY, None)
            w.update("ranks", row[0][0], {"meta_json": json.dumps(meta)})
    w.commit()
    return result


def _writer(meta_json: str | None) -> dict | None:
    try:
        meta = json.loads(meta_json or "{}")
    except ValueError:
        return None
    return meta.get(WRITER_KEY) if isinstance(meta, dict) else None


def _killed_imports(w: RowWriter, run_id: int, ranks: set[int]) -> dict[int, str]:
    """Of ``ranks``, those whose rows an import left unfinished and whose importer is known dead
    (NOTE: [Writer stamps]) → who it was."""
    dead = {}
    for rank, meta_json in w.rows("SELECT rank, meta_json FROM ranks WHERE run_id = ? AND meta_json LIKE ?",
                                  (run_id, f'%"{WRITER_KEY}"%')):
        writer = _writer(meta_json)
        if rank in ranks and alive(writer) is False:
            dead[rank] = describe(writer)
    return dead


def torch_version_of(payload: str) -> str:
    """The version string of a ``torch_version`` artifact: its JSON ``{"pytorch_version": "2.13.0+cpu",
    "commit": ...}`` (torch 2.9+), else the payload's first line (older logs wrote the bare string);
    at most 64 characters."""
    text = payload.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("pytorch_version"), str):
        return obj["pytorch_version"][:64]
    if isinstance(obj, str):
        return obj[:64]
    return (text.splitlines() or [""])[0][:64]


def _plan_rank(path: Path) -> tuple[int, int | None, int | None]:
    """(store rank, rank in the file name, rank in the first envelope that has one)."""
    file_rank = rank_from_filename(path)
    env_rank = None
    with open_log(path) as fh:
        for i, raw in enumerate(fh):
            if i > 5000:
                break
            if raw[:1] == b"\t" or b'"rank": ' not in raw:
                continue
            m = GLOG_RE.match(raw)
            if m is None:
                continue
            try:
                env = json.loads(raw[m.end():])
            except ValueError:
                continue
            if isinstance(env, dict) and isinstance(env.get("rank"), int):
                env_rank = env["rank"]
                break
    rank = file_rank if file_rank is not None else env_rank if env_rank is not None else 0
    return rank, file_rank, env_rank


def _import_file(w: RowWriter, run_id: int, path: Path, rank: int, env_rank: int | None, strict: bool,
                 bar, cache: GraphCache) -> Counter:
    stats = ReadStats()
    reader = LogReader(path, stats)
    w.begin()  # one transaction per COMMIT_EVERY_RECORDS records; on an error the caller rolls back
    meta = {"source": "torch_trace", "file": fs_text(path.name), WRITER_KEY: stamp()}  # until the import ends
    if env_rank is not None and env_rank != rank:
        meta.update(envelope_rank=env_rank, rank_mismatch=True)
    row_id = w.scalar("SELECT id FROM ranks WHERE run_id = ? AND rank = ?", (run_id, rank))
    if row_id is None:
        row_id = w.insert("ranks", {"run_id": run_id, "rank": rank, "world_size": 1,
                                    "meta_json": json.dumps(meta)})
    builder = FileBuilder(w, run_id, rank, cache=cache)
    since_commit, pos = 0, 0
    for rec in reader:
        if rec.rank is not None and env_rank is not None and rec.rank != env_rank:
            stats.add("other_rank")
            _maybe_fail(strict, path, stats)
            continue
        if rec.kind not in KNOWN_KINDS:
            stats.add("unknown_kind")
            stats.add("unknown_kind:" + rec.kind)
        _maybe_fail(strict, path, stats)
        if rec.name == "torch_version" and rec.payload:
            w.update("ranks", row_id, {"torch_version": torch_version_of(rec.payload)})
        builder.add(rec, reader.resolve_stack)
        since_commit += 1
        if since_commit >= COMMIT_EVERY_RECORDS:
            builder.flush_events()
            w.commit()
            w.begin()
            since_commit = 0
        if bar is not None and reader.bytes_read - pos > 1 << 20:
            bar.update(reader.bytes_read - pos)
            pos = reader.bytes_read
    _maybe_fail(strict, path, stats)
    builder.flush_events()
    _write_params(w, run_id, rank, builder.params)
    builder.counts["params"] = len(builder.params)
    drops = {k: stats.counts[k] for k in DROP_KEYS if stats.counts.get(k)}
    unverified = sum(stats.counts.get(k, 0) for k in UNVERIFIED_KEYS)
    stats.counts["unverified"] = unverified
    w.update("ranks", row_id, {"meta_json": json.dumps({**meta, "records": stats.counts.get("records", 0),
                                                        "dropped": drops, "dropped_records": stats.dropped,
                                                        "unverified": unverified,
                                                        "unverified_records": stats.unverified})})
    # (dropped_records is named: analysis.ranks.flight.missing_evidence)
    w.commit()
    if bar is not None:
        bar.update(reader.bytes_read - pos)
    counts = Counter(stats.counts)
    counts.update(builder.counts)
    return counts


def _maybe_fail(strict: bool, path: Path, stats: ReadStats) -> None:
    if not strict:
        return
    drops = {k: stats.counts[k] for k in DROP_KEYS + UNVERIFIED_KEYS if stats.counts.get(k)}
    if drops:
        raise BadInputError(f"strict import: {path.name} has dropped records (an md5 mismatch counts here): "
                            + ", ".join(f"{k} {v}" for k, v in drops.items()), stats=dict(stats.counts))


PARAM_COLS = ("run_id", "rank", "fqn", "kind", "storage_key", "shape_json", "dtype", "numel", "size_bytes",
              "requires_grad")


def _write_params(w: RowWriter, run_id: int, rank: int, params: dict[str, dict]) -> None:
    w.execute("DELETE FROM params WHERE run_id = ? AND rank = ?", (run_id, rank))
    w.insert_many("params", PARAM_COLS, [(run_id, rank, p["fqn"][:500], p["kind"], p["fqn"][:64],
                                          json.dumps(p["shape"] or []), p["dtype"], p["numel"], p["size_bytes"],
                                          p["requires_grad"]) for p in params.values()])


def _delete_ranks(w: RowWriter, run_id: int, ranks: list[int]) -> None:
    """Delete the rows an import writes for ``ranks`` (inside the caller's transaction)."""
    marks = ", ".join("?" * len(ranks))
    for table in ("kernel_nodes", "compile_events", "partitions", "params", "graphs", "ranks"):
        w.execute(f"DELETE FROM {table} WHERE run_id = ? AND rank IN ({marks})", (run_id, *ranks))


def _discard(w: RowWriter, run_id: int, ranks: list[int], *, drop_run: bool) -> None:
    """Remove what a failed (strict) import wrote (one transaction)."""
    w.begin()
    try:
        _delete_ranks(w, run_id, ranks)
        if drop_run:
            w.execute("DELETE FROM runs WHERE id = ?", (run_id,))
        w.commit()
    except BaseException:
        w.rollback()
        raise


def _progress(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="import", leave=False)
