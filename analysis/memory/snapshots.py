"""CUDA memory snapshot pickles given to ``graphdeck import``: recognised by content, replayed
(:mod:`graphdeck.analysis.memory.measured`), attributed to the run's graph nodes through its
stored Inductor output code, and kept in the store as one ``compile_events`` record.

# NOTE: [Snapshot import]
``torch.cuda.memory._dump_snapshot(path)`` writes a pickle of plain data (NOTE: [Memory snapshot
format]) under any file name. :func:`is_snapshot` tells it from a Flight Recorder pickle (also
protocol-2+ pickles of a dict) by the keys near its start: a snapshot's dict opens with
``segments``; an FR dump names ``entries`` / ``pg_config`` / ``comm_lib_version``. An imported
snapshot becomes a ``graphdeck_memory_snapshot`` record of the run (rank from a ``rank<N>`` in
the file name, else 0; ``compile_id`` NULL) whose payload is :func:`summary`'s JSON, so the API
and pages can read the measured peak beside the graph-derived one without the pickle. The
TORCH_TRACE logs of the same command are imported first, so their output code names the graphs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from graphdeck.analysis.memory.measured import MeasuredMemory, load_snapshot, measure, output_code_files
from graphdeck.store.lite import fs_text

RECORD = "graphdeck_memory_snapshot"
_FR_KEYS = (b"entries", b"pg_config", b"comm_lib_version", b"pg_status")
_RANK = re.compile(r"rank[_-]?(\d+)", re.I)


def is_snapshot(path: str | Path, head_bytes: int = 4096) -> bool:
    """Whether ``path`` (gzipped or not) is a pickled CUDA memory snapshot, by its first bytes:
    a pickle (protocol ≥ 2, ``0x80``) naming ``segments`` and no Flight Recorder key. Never
    raises (an unreadable file is not one)."""
    from graphdeck.store.fr_import import file_head

    head = file_head(path, head_bytes)
    return head[:1] == b"\x80" and b"segments" in head and not any(k in head for k in _FR_KEYS)


def summary(m: MeasuredMemory, path: str | Path, top: int = 50) -> dict:
    """The record's payload: ``file``, ``device``, ``peak_bytes``, ``baseline_bytes``,
    ``peak_time_us``, ``allocations``, ``attributed``, ``by_category_bytes`` and ``at_peak``
    (the ``top`` largest places live at the peak: ``{"bytes", "category", "graph_id",
    "nodes"}``, graph fields ``None`` outside Inductor code)."""
    at_peak = []
    for size, where in m.at_peak[:top]:
        graph = where[0] == "graph"
        at_peak.append({"bytes": size, "category": where[0], "graph_id": where[1] if graph else None,
                        "nodes": list(where[2]) if graph else None})
    return {"file": fs_text(Path(path).name), "device": m.device, "peak_bytes": m.peak_bytes,
            "baseline_bytes": m.baseline_bytes, "peak_time_us": m.peak_time_us, "allocations": m.allocations,
            "attributed": m.attributed, "by_category_bytes": dict(m.by_category_bytes), "at_peak": at_peak}


@dataclass
class SnapshotImport:
    """One imported snapshot: the run it went to, its rank, the replay and the record's id."""

    path: str
    run_id: int
    rank: int
    measured: MeasuredMemory
    record_id: int


def import_snapshot(engine, path: str | Path, run_name: str, *, device: int = 0) -> SnapshotImport:
    """Replay the snapshot at ``path`` for CUDA ``device``, attribute it through run
    ``run_name``'s stored ``inductor_output_code`` records (created empty when the run does not
    exist: bytes then land on categories only) and store a ``graphdeck_memory_snapshot`` record.

    Raises:
        UsageError: not a snapshot pickle, or no allocation history for ``device``."""
    from sqlalchemy.orm import Session

    from graphdeck.errors import UsageError
    from graphdeck.store.db import get_or_create_run, write_session
    from graphdeck.store.schema import CompileEvent

    snap = load_snapshot(path)
    with Session(engine) as s, s.begin():
        run_id = get_or_create_run(s, run_name).id
    try:
        m = measure(snap, output_code_files(engine, run_id), device=device)
    except UsageError as exc:  # no history for the device: name the file
        raise UsageError(f"{path}: {exc.message}") from None
    got = _RANK.search(Path(path).name)
    rank = int(got.group(1)) if got else 0
    from graphdeck.analysis.memory.compare import record_extras

    payload = summary(m, path) | record_extras(engine, snap, m)  # curve, bytes per module (NOTE: [Measured beside derived])
    with write_session(engine) as s:
        row = CompileEvent(run_id=run_id, rank=rank, name=RECORD, compile_id=None,
                           metadata_json=json.dumps({"file": str(path)}), payload=json.dumps(payload))
        s.add(row)
        s.flush()
        rid = row.id
    return SnapshotImport(str(path), run_id, rank, m, rid)
