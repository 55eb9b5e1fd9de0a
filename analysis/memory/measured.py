"""Measured memory: a CUDA memory snapshot replayed, its peak, and the bytes at the peak put on
the graph nodes whose generated code allocated them.

# NOTE: [Memory snapshot format]
``torch.cuda.memory._snapshot()`` (pickled by ``_dump_snapshot``; viewed in
pytorch.org/memory_viz; format read from ``torch/cuda/memory.py`` / ``_memory_viz.py``, not copied)
is a dict with ``segments`` (one per cudaMalloc'd segment: ``total_size``, ``blocks`` with
``size`` and ``state`` — ``active_allocated`` for a live tensor block) and ``device_traces``
(one list per device, oldest first, of ``{action, addr, size, stream, time_us, frames,
compile_context?}``; ``action`` ``alloc`` / ``free_requested`` / ``free_completed`` /
``segment_alloc`` / ``segment_free`` / ``snapshot`` / ``oom``; ``frames`` innermost first, each
``{filename, line, name}``). Allocated bytes rise at ``alloc`` and fall at ``free_completed``
(block sizes, as ``torch.cuda.memory_allocated`` counts them). The bytes allocated before the
recorded history are the live blocks now minus the history's net change.

Attribution: Inductor's wrapper runs as a Python file named in the TORCH_TRACE / capture record
``inductor_output_code`` (``metadata_json.inductor_output_code.filename``); an allocation whose
innermost frame lies in such a file is attributed to that code's graph (the post-grad graph id
the record names) and to the nodes the source-node comment of the kernel call the line feeds
names (AOT names in a backward, mostly Dynamo names in a forward): an ``empty_strided_*`` line → the next
``# Topologically Sorted Source Nodes`` comment below it (the call that writes the buffer), any
other line → the nearest one above it (NOTE: [Kernels by output code]). Other allocations are
classed by their frames: ``optimizer`` (``torch/optim``), ``autograd`` (gradient accumulation
outside compiled code), else ``eager``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from graphdeck.errors import UsageError
from graphdeck.store.safe_pickle import Limits, UnsafePickle, load_plain, read_capped

#: Records holding Inductor's wrapper code: TORCH_TRACE's, and the live agent's copy of it
#: (``graphdeck.capture.compile_log.OUTPUT_CODE_RECORD``, which the kernel mapping does not read).
CODE_RECORDS = ("inductor_output_code", "graphdeck_output_code")

_SOURCE = re.compile(r"^\s*# Topologically Sorted Source Nodes: \[(.*?)\]")


#: What a snapshot pickle may hold and cost (NOTE: [Bounded unpickling]): a long job's history
#: is a few hundred MiB of pickle.
SNAPSHOT_LIMITS = Limits(max_bytes=2 << 30, max_objects=100_000_000)


def load_snapshot(path: str | Path) -> dict:
    """The snapshot dict from a pickle (``.gz`` or plain) that ``_dump_snapshot`` wrote, read
    within :data:`SNAPSHOT_LIMITS` (gzip inflated in steps under the cap; NOTE: [Bounded
    unpickling] in :mod:`graphdeck.store.safe_pickle`).

    Raises:
        UsageError: unreadable, too large, refused (classes, bombs, parts shared past the
        limits), not a pickle of plain data, or without ``segments`` and ``device_traces``;
        the message names the file."""
    try:
        data = load_plain(read_capped(path, SNAPSHOT_LIMITS.max_bytes), SNAPSHOT_LIMITS)
    except OSError as exc:
        raise UsageError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except UnsafePickle as exc:
        raise UsageError(f"{path}: not a CUDA memory snapshot pickle ({exc})") from None
    if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
        raise UsageError(f"{path}: not a CUDA memory snapshot (needs 'segments' and 'device_traces')")
    problem = snapshot_problem(data)
    if problem:
        raise UsageError(f"{path}: not a CUDA memory snapshot torch writes: {problem}")
    return data


def _int(v, optional: bool = False) -> bool:
    return (v is None and optional) or (type(v) is int and -(2**63) <= v < 2**63)


def _kind(v) -> str:
    return type(v).__name__


def snapshot_problem(data: dict) -> str | None:
    """The first field of ``data`` whose type is not what torch writes and :func:`measure` reads
    (NOTE: [Memory snapshot format]), as ``"device_traces[0][12].size is a str"``; None when all
    fit: ``segments`` a list of dicts (``device`` an int, ``blocks`` a list of dicts with an int
    ``size`` and a str ``state``), ``device_traces`` a list of lists of dicts (``action`` a str,
    ``size``/``time_us`` ints or None, an ``alloc``'s ``addr`` an int and ``frames`` a list of
    dicts with a str ``filename`` and an int ``line``). Integers must fit 64 bits."""
    segs = data.get("segments")
    if not isinstance(segs, list):
        return f"segments is a {_kind(segs)}, not a list"
    for i, seg in enumerate(segs):
        if not isinstance(seg, dict):
            return f"segments[{i}] is a {_kind(seg)}, not a dict"
        if not _int(seg.get("device", 0)):
            return f"segments[{i}].device is a {_kind(seg.get('device'))}, not an int"
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            return f"segments[{i}].blocks is a {_kind(blocks)}, not a list"
        for j, b in enumerate(blocks):
            if not isinstance(b, dict) or not _int(b.get("size", 0)) or not isinstance(b.get("state", ""), str):
                return f"segments[{i}].blocks[{j}] is not a dict with an int size and a str state"
    traces = data.get("device_traces")
    if not isinstance(traces, list):
        return f"device_traces is a {_kind(traces)}, not a list"
    for d, events in enumerate(traces):
        if not isinstance(events, list):
            return f"device_traces[{d}] is a {_kind(events)}, not a list"
        for k, e in enumerate(events):
            where = f"device_traces[{d}][{k}]"
            if not isinstance(e, dict):
                return f"{where} is a {_kind(e)}, not a dict"
            for name in ("size", "time_us"):
                if not _int(e.get(name), optional=True):
                    return f"{where}.{name} is a {_kind(e.get(name))}, not an int"
            if not isinstance(e.get("action"), str):
                return f"{where}.action is a {_kind(e.get('action'))}, not a str"
            if e["action"] != "alloc":
                continue
            if not _int(e.get("addr")):
                return f"{where}.addr is a {_kind(e.get('addr'))}, not an int"
            frames = e.get("frames")
            if frames is None:
                continue
            if not isinstance(frames, list):
                return f"{where}.frames is a {_kind(frames)}, not a list"
            for f in frames:
                if not isinstance(f, dict) or not isinstance(f.get("filename", ""), str) or \
                        not _int(f.get("line"), optional=True):
                    return f"{where}.frames holds {f!r:.80} (a frame is a dict with a str filename and an int line)"
    return None


@dataclass
class MeasuredMemory:
    """One device's replayed history. Bytes are allocator block bytes (``_bytes``), times µs.

    ``baseline_bytes``: allocated when the history starts; ``peak_bytes``: the highest allocated
    total (baseline included) and ``peak_time_us`` when; ``at_peak``: live allocations then, as
    ``(bytes, where)`` summed per place — ``where`` is ``("graph", graph_id, node names)`` for
    Inductor code, else ``(category,)``; ``by_category_bytes``: the same summed per class
    (``graph``, ``optimizer``, ``autograd``, ``eager``, ``before_history``); ``allocations``:
    alloc events seen and ``attributed`` how many landed on graph nodes."""

    device: int
    baseline_bytes: int
    peak_bytes: int
    peak_time_us: int | None
    at_peak: list[tuple[int, tuple]] = field(default_factory=list)
    by_category_bytes: dict[str, int] = field(default_factory=dict)
    allocations: int = 0
    attributed: int = 0


def output_code_files(engine, run_id: int) -> dict[str, tuple[int | None, str | None, list[str]]]:
    """Generated-code file path → ``(post-grad graph id, compile id, code lines)`` from the run's
    stored ``inductor_output_code`` records."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.store.schema import CompileEvent

    out = {}
    with Session(engine) as s:
        for cid, meta, payload in s.execute(
                select(CompileEvent.compile_id, CompileEvent.metadata_json, CompileEvent.payload)
                .where(CompileEvent.run_id == run_id, CompileEvent.name.in_(CODE_RECORDS))):
            try:
                m = json.loads(meta or "{}")
            except ValueError:
                continue
            info = m.get("inductor_output_code") or {}
            path = info.get("filename") or info.get("file_path")
            if path and payload:
                out[path] = (m.get("graph_id"), cid, payload.splitlines())
    return out


def _nodes_at(lines: list[str], line_no: int) -> list[str]:
    i = line_no - 1  # frames count lines from 1
    if not 0 <= i < len(lines):
        return []
    step = 1 if "empty_strided" in lines[i] else -1
    j = i
    while 0 <= j < len(lines):
        m = _SOURCE.match(lines[j])
        if m:
            return [n.strip() for n in m.group(1).split(",") if n.strip()]
        if step == 1 and j > i and (".run(" in lines[j] or "extern_kernels." in lines[j]):
            break  # a call without a comment: do not borrow the next call's nodes
        j += step
    return []


def _where(frames: list[dict], code: dict) -> tuple:
    for f in frames or ():
        hit = code.get(f.get("filename"))
        if hit is not None:
            gid, _cid, lines = hit
            return ("graph", gid, tuple(_nodes_at(lines, int(f.get("line") or 0))))
    names = " ".join(str(f.get("filename", "")) for f in frames or ())
    if "torch/optim" in names:
        return ("optimizer",)
    if "torch/autograd" in names or "torch/_tensor.py" in names:
        return ("autograd",)
    return ("eager",)


def measure(snapshot: dict, code: dict | None = None, *, device: int = 0) -> MeasuredMemory:
    """Replay ``snapshot``'s history of ``device`` (NOTE: [Memory snapshot format]) and put the
    bytes live at its peak on graph nodes via ``code`` (from :func:`output_code_files`; empty:
    categories only).

    Raises:
        UsageError: the snapshot has no history for ``device`` (recorded without
        ``_record_memory_history``)."""
    code = code or {}
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise UsageError(f"the snapshot holds no allocation history for device {device} "
                         "(record it with torch.cuda.memory._record_memory_history())")
    now = sum(b.get("size", 0) for seg in snapshot.get("segments", []) if seg.get("device", 0) == device
              for b in seg.get("blocks", []) if b.get("state") == "active_allocated")
    live: dict[int, tuple[int, tuple]] = {}
    net = peak = 0
    peak_t = None
    peak_live: dict[int, tuple[int, tuple]] = {}
    out = MeasuredMemory(device=device, baseline_bytes=0, peak_bytes=0, peak_time_us=None)
    events = traces[device]
    for e in events:
        act, size = e.get("action"), int(e.get("size") or 0)
        if act == "alloc":
            where = _where(e.get("frames") or [], code)
            out.allocations += 1
            out.attributed += where[0] == "graph"
            live[e["addr"]] = (size, where)
            net += size
            if net > peak:
                peak, peak_t, peak_live = net, e.get("time_us"), None
        elif act == "free_completed":
            net -= size
            if peak_live is None:  # first free after a new peak: freeze the live set of the peak
                peak_live = dict(live)
            live.pop(e.get("addr"), None)
    if peak_live is None:
        peak_live = dict(live)
    out.baseline_bytes = now - net
    out.peak_bytes = out.baseline_bytes + max(peak, 0)
    out.peak_time_us = peak_t
    per: dict[tuple, int] = defaultdict(int)
    cats: dict[str, int] = defaultdict(int)
    for size, where in peak_live.values():
        per[where] += size
        cats[where[0]] += size
    cats["before_history"] = out.baseline_bytes
    out.at_peak = sorted(((b, w) for w, b in per.items()), key=lambda x: -x[0])
    out.by_category_bytes = dict(cats)
    return out
