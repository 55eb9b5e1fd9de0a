"""Measured memory from profiler output (split from :mod:`graphdeck.analysis.memory.core`, which
re-exports it): a Kineto trace's ``[memory]`` events and ``export_memory_timeline_raw`` files.
Bytes; times in ns."""

from __future__ import annotations

import json
from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.errors import NotFoundError, UsageError  # noqa: F401
from graphdeck.store.schema import InternedString


# ------------------------------------------------------------------------------------ measured
def measured_from_trace(session: Session, trace_id: int) -> dict:
    """Measured memory over time from a Kineto trace's ``[memory]`` instant events
    (``profile_memory=True``): per device (``"<Device Type>:<Device Id>"``), ``ts_ns`` and
    ``total_allocated_bytes`` lists and the peak. ``Total Allocated`` where the event has it,
    else the running sum of ``Bytes`` (allocations positive, frees negative).

    Raises:
        NotFoundError: the trace has no ``[memory]`` events.
    """
    from graphdeck.store.schema import Trace, TraceEvent

    if session.get(Trace, trace_id) is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    name_id = session.scalar(select(InternedString.id).where(InternedString.value == "[memory]"))
    if name_id is None:
        raise NotFoundError(f"trace {trace_id} has no [memory] events (profile with profile_memory=True)")
    series: dict[str, dict] = {}
    running: dict[str, int] = defaultdict(int)
    for ts, args in session.execute(select(TraceEvent.ts_ns, TraceEvent.args_json)
                                    .where(TraceEvent.trace_id == trace_id, TraceEvent.name_id == name_id)
                                    .order_by(TraceEvent.ts_ns, TraceEvent.id)):
        a = json.loads(args or "{}")
        dev = f"{a.get('Device Type', '?')}:{a.get('Device Id', '?')}"
        running[dev] += int(a.get("Bytes") or 0)
        # Older traces (2021) carry only the signed ``Bytes`` of each (de)allocation: the total
        # is then their running sum since the profiler started.
        total = a.get("Total Allocated", running[dev])
        s = series.setdefault(dev, {"ts_ns": [], "total_allocated_bytes": []})
        s["ts_ns"].append(ts)
        s["total_allocated_bytes"].append(int(total))
    if not series:
        raise NotFoundError(f"trace {trace_id} has no [memory] events")
    for s in series.values():
        s["peak_bytes"] = max(s["total_allocated_bytes"])
        s["min_bytes"] = min(s["total_allocated_bytes"])
    return series



#: Category names of ``torch.profiler`` memory timelines, in the index order of
#: ``export_memory_timeline_raw`` (torch/profiler/_memory_profiler.py: ``_CATEGORY_TO_INDEX``).
TIMELINE_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                       "autograd_detail", "unknown")


def read_memory_timeline_raw(path) -> dict:
    """Measured memory from a ``profile.export_memory_timeline_raw`` file (JSON list of
    ``[timestamp_ns, action, bytes, category index]``; ``.gz`` accepted), streamed with ijson.

    Actions 1 (pre-existing) and 2 (create) add ``bytes``; 3 (version bump) comes as a ``-n``/``+n``
    pair; 4 (destroy) carries ``-n``. Pre-existing tensors have timestamp -1 and are placed at the
    first real time. Returns ``ts_ns`` and ``total_bytes`` (running sum after each event), the
    peak, and ``by_category_at_peak``.

    Raises:
        BadInputError: the file is not such a list.
    """
    import gzip

    import ijson

    from graphdeck.errors import BadInputError

    opener = gzip.open if str(path).endswith(".gz") else open
    ts_ns: list[int] = []
    total: list[int] = []
    cats = [0] * len(TIMELINE_CATEGORIES)
    running, peak, peak_cats, peak_ts = 0, 0, list(cats), None
    first_real = None
    try:
        with opener(path, "rb") as f:
            for item in ijson.items(f, "item"):
                if not (isinstance(item, list) and len(item) == 4):
                    raise BadInputError(f"{path}: not an export_memory_timeline_raw event: {str(item)[:80]}")
                t, _action, n, c = (int(x) for x in item)
                if t >= 0 and first_real is None:
                    first_real = t
                running += n
                cats[c if 0 <= c < len(cats) else len(cats) - 1] += n
                ts_ns.append(t)
                total.append(running)
                if running > peak:
                    peak, peak_cats, peak_ts = running, list(cats), t
    except ijson.JSONError as exc:
        raise BadInputError(f"{path}: not JSON, or cut short ({exc}); {len(total)} events read") from exc
    if not total:
        raise BadInputError(f"{path}: no [timestamp, action, bytes, category] events (not an "
                            "export_memory_timeline_raw file)")
    ts_ns = [first_real if (t < 0 and first_real is not None) else t for t in ts_ns]
    return {"ts_ns": ts_ns, "total_bytes": total, "peak_bytes": peak,
            "peak_ts_ns": first_real if (peak_ts is not None and peak_ts < 0) else peak_ts,
            "by_category_at_peak": dict(zip(TIMELINE_CATEGORIES, peak_cats))}
