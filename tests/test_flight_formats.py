"""Flight Recorder dump versions (issue 19 item 1: "the versions torch 2.9-2.13 write"): small
dumps written by hand from torch's recorder sources, one pair of ranks per dump ``version``, in
tests/data/flight/formats/ (its README names the source of each format). Each is imported as
JSON and as a pickle (the same dict with Python types and ``frames``, as the pickle writer makes
it) and must give the same first mismatch: group 0, collective #3, reached by rank 0 only."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import rank_report
from graphdeck.store.db import open_engine
from graphdeck.store.fr_import import import_flight_dumps, load_bytes
from graphdeck.store.schema import CompileEvent, Run

FORMATS = Path(__file__).resolve().parent / "data" / "flight" / "formats"
VERSIONS = ("2.3", "2.4", "2.7", "2.10")


def _as_pickle(d: dict, rank: int) -> bytes:
    """The pickle writer's form of a JSON fixture: tuples for ``process_group``, None for a time
    not discovered (the JSON writers of 2.7+ write 0), integer ``pg_status``, and stacks."""
    d = json.loads(json.dumps(d))
    for e in d.get("entries", []):
        e["process_group"] = tuple(e["process_group"])
        for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            e[k] = e[k] or None
        e["frames"] = [{"name": "all_reduce", "filename": "/opt/torch/distributed/distributed_c10d.py", "line": 2800},
                       {"name": "train_step", "filename": "/home/user/train.py", "line": 40 + rank}]
    d["pg_status"] = {k: {kk: int(vv) for kk, vv in v.items()} for k, v in d["pg_status"].items()}
    return pickle.dumps(d, protocol=2)


def _import(tmp_path: Path, version: str, fmt: str):
    folder = tmp_path / "in"
    folder.mkdir()
    for r in (0, 1):
        src = FORMATS / f"fr-v{version}.json.{r}"
        if fmt == "json":
            shutil.copy(src, folder / src.name)
        else:
            (folder / f"dump_{r}").write_bytes(_as_pickle(json.loads(src.read_text()), r))
    engine = open_engine(tmp_path / "s.db")
    res = import_flight_dumps(engine, folder, run_name="v")
    with Session(engine) as s:
        rep = rank_report(s, s.scalar(select(Run).where(Run.name == "v")))
        stored = [json.loads(p)["version"] for p in s.scalars(select(CompileEvent.payload)
                                                              .where(CompileEvent.name == "flight_recorder"))]
    return res, rep, stored


@pytest.mark.parametrize("fmt", ["json", "pickle"])
@pytest.mark.parametrize("version", VERSIONS)
def test_each_dump_version_is_read(tmp_path, version, fmt):
    assert (FORMATS / f"fr-v{version}.json.0").exists(), "corpus file missing"
    res, rep, stored = _import(tmp_path, version, fmt)
    assert (res.ranks, res.entries, res.dropped, res.missing_ranks) == ([0, 1], 5, 0, []), res
    assert stored == [version, version]
    (m,) = rep.flight.mismatches
    lib = "gloo" if version == "2.10" else "nccl"
    assert (m.group, m.desc, m.seq, m.op, m.reached, m.not_reached) == ("0", "default_pg", 3, f"{lib}:all_reduce",
                                                                       [0], [1])
    assert m.last_completed[1].seq == 2 and rep.verdict == "FAIL" and rep.missing_evidence == []
    if fmt == "pickle":
        assert m.issued[0].line == "/home/user/train.py:40 in train_step"


def test_version_specific_keys_are_in_the_fixtures():
    """What differs between the versions (README): the accelerator-library key, the thread keys,
    and the JSON writers' 0 for a time not discovered."""
    keys = {v: json.loads((FORMATS / f"fr-v{v}.json.0").read_text()) for v in VERSIONS}
    assert "nccl_version" in keys["2.7"] and "comm_lib_version" in keys["2.10"]
    assert not {"nccl_version", "comm_lib_version"} & set(keys["2.4"])
    assert {"thread_id", "thread_name"} <= set(keys["2.10"]["entries"][0])
    assert not {"thread_id", "thread_name"} & set(keys["2.7"]["entries"][0])
    assert keys["2.7"]["entries"][-1]["time_discovered_completed_ns"] == 0
    assert keys["2.4"]["entries"][-1]["time_discovered_completed_ns"] is None


def test_an_empty_json_dump_is_a_dump_with_no_entries():
    """torch 2.13 ``_dump_fr_trace_json()`` of a rank that recorded nothing has no ``entries``
    key (checked on this machine: keys comm_lib_version, nccl_comm_state, pg_config, pg_status,
    version): it is that rank's dump, with no entries, not "no dump"."""
    d, fmt = load_bytes((FORMATS / "fr-v2.10-empty.json.1").read_bytes())
    assert fmt == "json" and d is not None
