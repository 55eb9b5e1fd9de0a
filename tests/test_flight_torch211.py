"""Flight Recorder dumps written by a real torch 2.11 (format "2.10"), gloo and NCCL, pickle and
JSON (tests/data/flight_torch2.11/README.md): each is read, every entry kept, and the rank check
compares them without claiming more than they hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from graphdeck.cli import main
from graphdeck.store.db import open_engine
from graphdeck.store.fr_import import import_flight_dumps

DATA = Path(__file__).parent / "data" / "flight_torch2.11"


@pytest.mark.parametrize("kind", ["gloo_ws2_pickle", "gloo_ws2_json"])
def test_gloo_dumps_of_torch_211_are_read_and_agree(tmp_path, kind):
    engine = open_engine(tmp_path / "s.db")
    files = sorted(str(p) for p in DATA.glob(f"{kind}_*"))
    result = import_flight_dumps(engine, files, run_name="g", files=files)
    assert result.ranks == [0, 1] and result.entries == 30 and result.dropped == 0
    res = CliRunner().invoke(main, ["check-ranks", str(tmp_path / "s.db"), "--run", "g"])
    assert "dumps from ranks [0, 1], 30 entries" in res.output and "0 mismatched" in res.output, res.output


@pytest.mark.parametrize("name", ["nccl_ws1_ncclpickle_0", "nccl_ws1_ncclj_0"])
def test_nccl_dumps_of_torch_211_are_read(tmp_path, name):
    engine = open_engine(tmp_path / "s.db")
    result = import_flight_dumps(engine, [str(DATA / name)], run_name="n", files=[str(DATA / name)])
    assert result.ranks == [0] and result.entries == 15 and result.dropped == 0


def test_an_empty_fr_dump_of_an_nccl_job_is_named_not_silently_taken(tmp_path):
    """torch 2.11's generic dump of an NCCL job holds no entries and no groups (the NCCL buffer is
    separate): it is skipped with its reason, and the NCCL dump of the same rank is kept."""
    engine = open_engine(tmp_path / "s.db")
    files = [str(DATA / "nccl_ws1_pickle_0"), str(DATA / "nccl_ws1_ncclpickle_0")]
    result = import_flight_dumps(engine, files, run_name="n", files=files)
    assert result.ranks == [0] and result.entries == 15
    assert result.skipped == ["nccl_ws1_pickle_0: empty Flight Recorder dump (no entries, no groups)"]
