"""Wrong types in Flight Recorder dumps (pickle and JSON) and memory snapshots (issue 36, item 7):
every mutant of a real file is imported (bad entries dropped and named) or refused with an error
naming the file and the field (the CLI's exit 2) — never a traceback (tests/fuzz_importers.py;
``bench/bench_import_fuzz.py`` runs hundreds)."""

from __future__ import annotations

import pickle

import pytest
from click.testing import CliRunner

from graphdeck.cli import main
from tests.fuzz_importers import fuzz, load_source

COUNT = 50


@pytest.mark.parametrize("kind", ["fr_pickle", "fr_json", "snapshot"])
def test_type_mutants_never_crash_an_importer(tmp_path, kind):
    crashes = fuzz(kind, COUNT, tmp_path)
    assert not crashes, f"{len(crashes)} of {COUNT} mutants crashed:\n" + "\n".join(crashes[:3])


def test_a_wrong_type_names_the_file_and_the_field(tmp_path):
    dump = load_source("fr_pickle")
    dump["pg_config"] = 1.5
    (tmp_path / "bad_fr_0").write_bytes(pickle.dumps(dump, protocol=2))
    snap = load_source("snapshot")
    snap["device_traces"][0][3]["size"] = "12"
    (tmp_path / "snap_rank0.pickle").write_bytes(pickle.dumps(snap, protocol=4))
    store = str(tmp_path / "s.db")
    res = CliRunner().invoke(main, ["import", str(tmp_path / "bad_fr_0"), "--store", store, "--run", "r",
                                    "--no-progress"])
    assert res.exit_code == 2 and "bad_fr_0" in res.output and "pg_config is a float" in res.output, res.output
    res = CliRunner().invoke(main, ["memory-snapshot", str(tmp_path / "snap_rank0.pickle")])
    assert res.exit_code == 2 and "snap_rank0.pickle" in res.output, res.output
    assert "device_traces[0][3].size is a str" in res.output, res.output
    dump = load_source("fr_pickle")
    dump["entries"][2]["input_sizes"] = 7.5
    (tmp_path / "entry_fr_0").write_bytes(pickle.dumps(dump, protocol=2))
    res = CliRunner().invoke(main, ["import", str(tmp_path / "entry_fr_0"), "--store", store, "--run", "e",
                                    "--no-progress"])
    assert res.exit_code == 0 and "entry #2" in res.output and "input_sizes is a float" in res.output, res.output
