"""Every file of ../shared/data/traces ingests; counts equal SOURCES.md's ``events`` and
``GPU kernels`` columns (which were counted from the files by their publisher of the corpus).

Well-formed traces ingest with ``strict=True``. Files that are not Kineto traces (PyTorch
execution traces, the memory-timeline list) are refused with a BadInputError that says so.
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.errors import BadInputError
from graphdeck.store.db import open_engine
from graphdeck.store.schema import InternedString, TraceEvent
from graphdeck.store.traces import ingest_trace
from tests.conftest import SHARED, shared_path


def _rows() -> list[dict]:
    path = SHARED / "data" / "traces" / "SOURCES.md"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or not cells[0].startswith("`"):
            continue
        rows.append({"file": cells[0].strip("`"), "kernels": cells[6], "events": cells[7]})
    return rows


ROWS = _rows()


def _int(text: str) -> int | None:
    m = re.fullmatch(r"[\d,]+", text)
    return int(text.replace(",", "")) if m else None


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_corpus_file_ingests_with_the_published_counts(row, tmp_path):
    path = shared_path("data", "traces", row["file"])
    engine = open_engine(tmp_path / "s.db")
    events = _int(row["events"])
    if events is None:  # an execution trace ("931 nodes") or the memory timeline ("-")
        with pytest.raises(BadInputError):
            ingest_trace(engine, path, run_name="corpus", strict=True)
        return
    result = ingest_trace(engine, path, run_name="corpus", strict=True)
    assert result.stats["events_total"] == events, f"{row['file']}: items of traceEvents vs SOURCES.md events"
    m = re.search(r"\((\d+)\)", row["kernels"])
    want_kernels = int(m.group(1)) if m else 0
    with Session(engine) as s:
        got = s.scalar(select(func.count()).select_from(TraceEvent).join(
            InternedString, InternedString.id == TraceEvent.cat_id).where(
            TraceEvent.trace_id == result.trace_id, InternedString.value.in_(("kernel", "Kernel"))))
    assert got == want_kernels, f"{row['file']}: stored kernel/Kernel events vs SOURCES.md GPU kernels"
