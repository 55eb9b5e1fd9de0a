"""The per-rank Flight Recorder index (store/fr_import.seq_index, NOTE: [FR compare by index] in
analysis/ranks/flight.py) on the real dumps of tests/flight_job.py (tests/data/flight/): the report from
the index equals the report from the payloads (a row without the index, as the capture and older
stores write it, or with an index of another version, is indexed on read), and the fast paths of
normalise and the index agree with their entry-by-entry paths on coalesced ids, p2p ops and gaps."""

from __future__ import annotations

import copy
import json
import pickle
import sqlite3
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.flight import flight_report, load_dumps
from graphdeck.store.db import open_engine
from graphdeck.store.fr_import import (
    _P2P,
    _index_fast,
    _index_slow,
    _normalise_slow,
    import_flight_dumps,
    normalise,
    pack_codes,
    seq_index,
    unpack_codes,
)
from graphdeck.store.schema import Run

DATA = Path(__file__).resolve().parent / "data" / "flight"


def _flight(store: Path):
    with Session(open_engine(store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "r"))
        return flight_report(s, run.id).to_dict(), flight_report(s, run.id, load_dumps(s, run.id)).to_dict()


def _import(tmp_path: Path, dumps: dict[int, dict]) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    for r, dump in dumps.items():
        (d / f"fr_{r}").write_bytes(pickle.dumps(dump, protocol=2))
    store = tmp_path / "s.db"
    import_flight_dumps(open_engine(store), d, run_name="r")
    return store


def _dumps() -> dict[int, dict]:
    return {r: pickle.loads((DATA / f"fr_dump_{r}").read_bytes()) for r in (0, 1)}


def test_report_from_index_equals_report_from_payloads_and_rows_without_index_are_indexed(tmp_path):
    dumps = _dumps()
    dumps[2] = copy.deepcopy(dumps[0])  # ranks 0 and 2 hold the same sequences: one class
    store = _import(tmp_path, dumps)
    indexed, from_payloads = _flight(store)
    assert indexed == from_payloads
    assert [m["seq"] for m in indexed["mismatches"]] == [3, 3, 3, 3]
    assert {m["desc"]: m["not_reached"] for m in indexed["mismatches"]}["loss_sync"] == [1]
    con = sqlite3.connect(store)
    metas = con.execute("SELECT id, metadata_json FROM compile_events").fetchall()
    assert all(len(m) < 2000 and json.loads(m)["fr_index"]["v"] == 2 for _i, m in metas)  # kept small
    for i, m in metas:  # as the capture writes it, and an index of another version
        meta = json.loads(m)
        if i % 2:
            del meta["fr_index"]
        else:
            meta["fr_index"]["v"] = 1
        con.execute("UPDATE compile_events SET metadata_json = ? WHERE id = ?", (json.dumps(meta), i))
    con.commit()
    con.close()
    assert _flight(store)[0] == indexed


def _variants() -> list[dict]:
    d0 = pickle.loads((DATA / "fr_dump_0").read_bytes())
    coalesced = copy.deepcopy(d0)
    e = dict(coalesced["entries"][4], profiling_name="gloo:broadcast", record_id=99)
    coalesced["entries"].insert(5, e)
    p2p = copy.deepcopy(d0)
    p2p["entries"].append(dict(p2p["entries"][1], profiling_name="gloo:send", record_id=77))
    gap = copy.deepcopy(d0)
    del gap["entries"][3]
    sparse = copy.deepcopy(d0)
    sparse["entries"][-1]["collective_seq_id"] = 100000
    return [d0, coalesced, p2p, gap, sparse, json.loads((DATA / "rank1-trace.json.1").read_text())]


def test_fast_paths_agree_with_entry_by_entry_paths():
    for dump in _variants():
        norm = normalise(dump, "x")
        assert {k: norm[k] for k in ("pgs", "sigs", "stacks", "entries", "dropped")} == _normalise_slow(
            dump["entries"], "x")
        names = [str(n) for n, _d in norm["pgs"]]
        desc = {str(n): d for n, d in norm["pgs"]}
        slow = _index_slow(norm["entries"], names, desc, [str(s[0]).endswith(_P2P) for s in norm["sigs"]])
        fast = _index_fast(norm["entries"], names, desc)
        assert fast is None or fast == slow
        packed = seq_index(norm)["groups"]
        assert packed.keys() == slow.keys()
        for name, g in packed.items():
            assert g[:4] + g[5:] == slow[name][:4] + slow[name][5:] and unpack_codes(g[4]) == slow[name][4]
    assert unpack_codes(pack_codes([0, None, [1, 2]])) == [0, None, [1, 2]]


def test_variants_report_the_same_from_index_and_payloads(tmp_path):
    base = pickle.loads((DATA / "fr_dump_0").read_bytes())
    for k, v in enumerate(_variants()[1:5]):  # coalesced, p2p, gap, sparse
        (tmp_path / str(k)).mkdir()
        indexed, from_payloads = _flight(_import(tmp_path / str(k), {0: base, 1: v, 2: copy.deepcopy(base)}))
        assert indexed == from_payloads and bool(indexed["mismatches"]) == (k != 1), k  # p2p is not aligned


def test_a_scatter_is_compared_on_what_every_rank_holds():
    """A scatter's inputs live on its source rank only (the others record none), a gather's outputs
    on its destination: comparing those sides made every scatter of the FSDP2 x TP job a mismatch."""
    from graphdeck.analysis.ranks.flight import comparable

    src = ["gloo:scatter", [[2, 32, 32]], [[32, 32]], ["Float", "Float"]]
    other = ["gloo:scatter", [], [[32, 32]], ["Float"]]
    assert comparable(src) == comparable(other)
    assert comparable(["gloo:scatter", [], [[16, 32]], ["Float"]]) != comparable(other)
    dst = ["nccl:gather", [[8]], [[8], [8]], ["Float", "Float", "Float"]]
    assert comparable(dst) == comparable(["nccl:gather", [[8]], [], ["Float"]])
    ar = ["gloo:all_reduce", [[8]], [[8]], ["Float", "Float"]]
    assert comparable(ar) == ar
