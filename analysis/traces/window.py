"""Level of detail for timelines: which events of a time window to draw, fast on big traces.

# NOTE: [Timeline level of detail]
A view never gets more than ``max_shapes`` bars. For a window ``[t0_ns, t1_ns)`` the events
that overlap it are found from an in-memory index of the trace (start, end, duration, id as
numpy int64 arrays sorted by start: ``searchsorted`` bounds the starts, a vectorised test keeps
those ending after ``t0``), and when more than ``max_shapes`` overlap, the longest
``max_shapes`` are kept (``argpartition``) — zooming in brings the shorter ones back. The rows
themselves are then read by id. A stored trace whose status is final never changes, so an
index is built once per trace (one ordered scan of its ``X`` events) and reused; on a
1M-event trace it holds 32 MB.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from sqlalchemy import text
from sqlalchemy.orm import Session

_ROWS = (
    "SELECT e.id, e.ph, n.value, c.value, e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation "
    "FROM trace_events e JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id "
    "WHERE e.id IN ({ids})"
)
_KEYS = ("id", "ph", "name", "cat", "ts_ns", "dur_ns", "pid", "tid", "correlation")


@dataclass
class WindowIndex:
    """Start-sorted ``ts``, ``end``, ``dur``, ``ids`` (int64 ns / row ids) of a trace's ``X`` events."""

    trace_id: int
    ts: np.ndarray
    end: np.ndarray
    dur: np.ndarray
    ids: np.ndarray

    @classmethod
    def build(cls, session: Session, trace_id: int) -> "WindowIndex":
        sql = "SELECT id, ts_ns, dur_ns FROM trace_events WHERE trace_id = :t AND ph = 'X' ORDER BY ts_ns, id"
        if session.get_bind().dialect.name == "sqlite":  # the DBAPI cursor: no per-row Row objects
            cur = session.connection().connection.driver_connection.cursor()
            rows = cur.execute(sql.replace(":t", "?"), (trace_id,)).fetchall()
            cur.close()
        else:
            rows = session.execute(text(sql), {"t": trace_id}).all()
        arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
        ids, ts, dur = arr[:, 0].copy(), arr[:, 1].copy(), np.maximum(arr[:, 2], 0)
        return cls(trace_id, ts, ts + dur, dur, ids)

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, t0_ns: int, t1_ns: int, max_shapes: int) -> tuple[np.ndarray, int]:
        """(ids of at most ``max_shapes`` events overlapping ``[t0_ns, t1_ns)``, longest first when
        cut; how many overlap in all)."""
        hi = int(np.searchsorted(self.ts, t1_ns, side="left"))
        hit = np.nonzero(self.end[:hi] > t0_ns)[0]
        # zero-length events exactly at t0 count too
        total = len(hit)
        if total > max_shapes:
            keep = np.argpartition(-self.dur[hit], max_shapes - 1)[:max_shapes]
            hit = hit[keep]
        return self.ids[hit], total

    @property
    def span(self) -> tuple[int, int] | None:
        if not len(self.ts):
            return None
        return int(self.ts[0]), int(self.end.max())


def fetch_rows(session: Session, ids) -> list[dict]:
    """The event rows (dicts keyed like :func:`graphdeck.server.render.timeline.timeline_figure`
    expects) of ``ids``, ordered by start."""
    out: list[dict] = []
    id_list = [int(i) for i in ids]
    for i in range(0, len(id_list), 900):
        chunk = id_list[i : i + 900]
        sql = _ROWS.format(ids=",".join(str(x) for x in chunk))  # ints only: no injection
        out.extend(dict(zip(_KEYS, row)) for row in session.execute(text(sql)))
    out.sort(key=lambda r: (r["ts_ns"], r["id"]))
    return out


class IndexCache:
    """A small LRU of :class:`WindowIndex` per trace id (the server keeps one per app)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._items: OrderedDict[int, WindowIndex] = OrderedDict()

    def get(self, session: Session, trace_id: int) -> WindowIndex:
        got = self._items.get(trace_id)
        if got is None:
            got = WindowIndex.build(session, trace_id)
            self._items[trace_id] = got
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(trace_id)
        return got
