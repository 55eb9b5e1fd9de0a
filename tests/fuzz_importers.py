"""Type-mutation fuzz of the Flight Recorder and memory snapshot importers (issue 36, item 7).

A mutant is a real dump or snapshot with values swapped for other types at random places (a
``None``, a string, a negative or 2^70 integer, ``nan``, a list, a dict, a key removed), written
as the file the importer reads (pickle or JSON). Each goes through the whole import —
:func:`graphdeck.store.fr_import.import_flight_dumps` / :func:`graphdeck.analysis.memory.
snapshots.import_snapshot` into a real SQLite store — and must end either imported
or in a :class:`~graphdeck.errors.GraphdeckError` (the CLI's exit 2, naming the file); anything
else is a crash. Used by ``tests/test_import_fuzz.py`` (a few dozen mutants) and
``bench/bench_import_fuzz.py`` (hundreds).
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import pickle
import random
import traceback
from pathlib import Path

DATA = Path(__file__).parent / "data"
SOURCES = {
    "fr_pickle": (DATA / "flight" / "fr_dump_0", "pickle"),
    "fr_json": (DATA / "flight_torch2.11" / "gloo_ws2_json_0", "json"),
    "snapshot": (DATA / "gpt2_h200_trace" / "whatif_base.snapshot.pickle.gz", "pickle"),
}
ODD = (None, "x", -1, 2**70, math.nan, 1.5, True, [], {}, [None], {"a": 1}, "", 0)


def load_source(kind: str):
    path, _fmt = SOURCES[kind]
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    obj = pickle.loads(raw) if raw[:1] == b"\x80" else json.loads(raw)
    if kind == "snapshot":  # its first allocations and segments: mutants stay small and quick
        obj = {**obj, "segments": obj["segments"][:20],
               "device_traces": [t[:300] for t in obj["device_traces"]]}
    return obj


def _places(obj, path=()):
    """Every (container, key) in ``obj`` (shared parts visited once)."""
    seen: set[int] = set()
    out = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            out += [(o, k) for k in o]
            stack += [v for v in o.values() if isinstance(v, (dict, list))]
        elif isinstance(o, list):
            out += [(o, i) for i in range(len(o))]
            stack += [v for v in o if isinstance(v, (dict, list))]
    return out


def mutate(base, rng: random.Random, n: int = 3):
    obj = copy.deepcopy(base)
    places = _places(obj)
    for _ in range(n):
        box, key = rng.choice(places)
        if isinstance(box, dict) and rng.random() < 0.15:
            box.pop(key, None)
        else:
            try:
                box[key] = copy.deepcopy(rng.choice(ODD))
            except (IndexError, KeyError):
                pass
        if rng.random() < 0.3:  # now and then at the top, where the importer looks first
            top = [(obj, k) for k in obj] if isinstance(obj, dict) else []
            if top:
                box, key = rng.choice(top)
                box[key] = copy.deepcopy(rng.choice(ODD))
        places = _places(obj)
    return obj


def write(obj, fmt: str, path: Path) -> None:
    if fmt == "pickle":
        path.write_bytes(pickle.dumps(obj, protocol=2))
    else:
        path.write_text(json.dumps(obj))


def run_one(kind: str, obj, folder: Path, i: int, engine) -> str | None:
    """Import one mutant as run ``fuzz<i>``; ``None`` when it was imported or refused cleanly,
    else the crash."""
    from graphdeck.errors import GraphdeckError

    _path, fmt = SOURCES[kind]
    name = f"{kind}_m{i}_0" if kind != "snapshot" else f"snap_m{i}_rank0.pickle"
    f = folder / name
    write(obj, fmt, f)
    try:
        if kind == "snapshot":
            from graphdeck.analysis.memory.snapshots import import_snapshot

            import_snapshot(engine, f, f"fuzz{i}")
        else:
            from graphdeck.store.fr_import import import_flight_dumps

            res = import_flight_dumps(engine, [], run_name=f"fuzz{i}", files=[str(f)])
            from sqlalchemy import select
            from sqlalchemy.orm import Session

            from graphdeck.analysis.ranks.flight import flight_report
            from graphdeck.store.schema import Run

            with Session(engine) as s:  # what check-ranks reads back
                flight_report(s, s.scalar(select(Run.id).where(Run.id == res.run_id)))
    except GraphdeckError as exc:
        if name not in exc.message and "Flight Recorder dump found" not in exc.message:
            return f"{name}: error without the file's name: {exc.message[:200]}"
        return None
    except Exception:  # noqa: BLE001 - the crash being counted
        return f"{name}: {traceback.format_exc(limit=-3)}"
    return None


def fuzz(kind: str, count: int, folder: Path, seed: int = 0) -> list[str]:
    """Crashes among ``count`` mutants of ``kind`` (seeded: the same mutants every run)."""
    from graphdeck.store.db import open_engine

    rng = random.Random(f"{kind}:{seed}")
    base = load_source(kind)
    crashes = []
    engine = open_engine(folder / f"{kind}.db")
    try:
        for i in range(count):
            crash = run_one(kind, mutate(base, rng, n=rng.randint(1, 4)), folder, i, engine)
            if crash:
                crashes.append(crash)
    finally:
        engine.dispose()
    return crashes
