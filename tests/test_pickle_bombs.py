"""Pickle bombs (issue 36, item 6): Flight Recorder dumps and CUDA memory snapshots are pickles a
user is handed; a few bytes must not buy gigabytes or hours (NOTE: [Bounded unpickling] in
graphdeck.store.safe_pickle).

Each case runs the real CLI in a subprocess under ``RLIMIT_AS`` (so a bomb fails fast with
``MemoryError`` instead of swapping the host) and a timeout, and must end in exit 2 naming the file
and the problem — never a MemoryError, a traceback or a hang — with the good dumps of the same
import kept.
"""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from graphdeck.store.db import open_engine

DATA = Path(__file__).parent / "data"
FR = DATA / "flight" / "fr_dump_0"
#: Address space for the CLI (Python, SQLAlchemy and the store need ~300 MiB; a bomb asks for GiBs).
LIMIT = 1 << 30

DRIVER = """
import resource, sys, json
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from click.testing import CliRunner
from graphdeck.cli import main
out = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(main, args)
    out.append({{"code": r.exit_code, "output": r.output,
                 "exc": None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)}})
print(json.dumps(out))
"""


def cli_limited(*commands: list[str]) -> list[dict]:
    """Run ``graphdeck <args>`` for each of ``commands`` in one subprocess under ``RLIMIT_AS``."""
    proc = subprocess.run([sys.executable, "-c", DRIVER.format(limit=LIMIT), json.dumps([list(c) for c in commands])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refused(result: dict, name: str, *words: str) -> None:
    text = result["output"]
    assert result["exc"] is None, result
    assert result["code"] == 2, text
    assert name in text and "MemoryError" not in text and "Traceback" not in text, text
    assert all(w in text for w in words), (words, text)


# --- hostile files -------------------------------------------------------------------------------

#: 9 bytes: LONG_BINPUT 2^30 makes CPython's unpickler grow (and clear) a 16 GiB memo table.
MEMO_BOMB = b"\x80\x02Nr\x00\x00\x00\x40."
#: length prefixes past the data: BINBYTES8, BINUNICODE8, LONG4, FRAME of 2^34 bytes
LENGTH_BOMBS = {"binbytes8": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 34) + b".",
                "binunicode8": b"\x80\x04\x8d" + struct.pack("<Q", 1 << 34) + b".",
                "long4": b"\x80\x02\x8b" + struct.pack("<I", 0x7FFFFFFF) + b".",
                "frame": b"\x80\x04\x95" + struct.pack("<Q", 1 << 34) + b"N."}


def shared_sublists(levels: int = 8, width: int = 16) -> bytes:
    """An FR dump (real keys) whose ``input_sizes`` and ``pg_config`` hold a list built of
    ``width`` references to the one below it, ``levels`` deep: a few hundred bytes that expand
    to width^levels items (16^8 = 4 G)."""
    out = bytearray(b"\x80\x02}q\x00(X\x07\x00\x00\x00versionq\x01X\x04\x00\x00\x002.10q\x02")
    out += b"X\t\x00\x00\x00pg_configq\x03"
    out += b"]q\x04K\x01a"  # memo 4: [1]
    for i in range(levels):  # memo 5+i: [memo[4+i], memo[4+i]], replacing memo[4+i] on the stack
        out += b"0(" + (b"h" + bytes([4 + i])) * width + b"lq" + bytes([5 + i])
    top = 4 + levels
    out += b"X\x07\x00\x00\x00entriesq" + bytes([top + 1]) + b"](}(X\x0b\x00\x00\x00input_sizesh" + bytes([top])
    out += b"X\x0e\x00\x00\x00profiling_nameX\x0f\x00\x00\x00gloo:all_reduceX\x11\x00\x00\x00collective_seq_idK\x01"
    out += b"X\r\x00\x00\x00process_groupX\x01\x00\x00\x000X\x01\x00\x00\x00a\x86ue" + b"X\x04\x00\x00\x00rankK\x00u."
    return bytes(out)


def gzip_bomb(head: bytes) -> bytes:
    """~2.5 MB of gzip inflating to ``head`` and 2.5 GiB of zeros (40 members of 64 MiB)."""
    return gzip.compress(head) + gzip.compress(bytes(64 << 20), 9) * 40


def snapshot_bomb() -> bytes:
    """24 bytes that open like a snapshot (``segments``) and then ask for a 16 GiB memo table."""
    data = b"\x80\x04}\x8c\x08segments]r\x00\x00\x00\x40s\x8c\x000."
    assert len(data) == 24
    return data


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bombs")
    (d / "memo_fr_1").write_bytes(MEMO_BOMB)
    for name, data in LENGTH_BOMBS.items():
        (d / f"{name}_fr_1").write_bytes(data)
    (d / "shared_fr_1").write_bytes(shared_sublists())
    (d / "snap.pickle").write_bytes(snapshot_bomb())
    (d / "snap_bomb.pickle.gz").write_bytes(gzip_bomb(b"\x80\x04}\x8c\x08segments"))
    (d / "fr_gz_bomb_1.gz").write_bytes(gzip_bomb(b"\x80\x02}X\x07\x00\x00\x00entries"))
    return d


def test_the_9_byte_fr_file_and_length_bombs_exit_2_and_keep_the_good_dump(bombs, tmp_path):
    names = ["memo_fr_1", *(f"{n}_fr_1" for n in LENGTH_BOMBS), "shared_fr_1", "fr_gz_bomb_1.gz"]
    store = str(tmp_path / "s.db")
    open_engine(store).dispose()
    results = cli_limited(*(["import", str(FR), str(bombs / n), "--store", store, "--run", f"r{i}", "--no-progress"]
                            for i, n in enumerate(names)))
    words = {"memo_fr_1": "memo index", "binbytes8_fr_1": "BINBYTES8", "binunicode8_fr_1": "string of",
             "long4_fr_1": "LONG4", "frame_fr_1": "frame of", "shared_fr_1": "expands to more than",
             "fr_gz_bomb_1.gz": "gzip that inflates"}
    for name, res in zip(names, results):
        refused(res, name, "refused", words[name])
        assert "Flight Recorder: ranks [0]" in res["output"], res["output"]  # the good dump was kept


def test_the_24_byte_snapshot_and_a_gzip_bomb_exit_2(bombs):
    res = cli_limited(["memory-snapshot", str(bombs / "snap.pickle")],
                      ["memory-snapshot", str(bombs / "snap_bomb.pickle.gz")])
    refused(res[0], "snap.pickle", "memo index")
    refused(res[1], "snap_bomb.pickle.gz", "gzip that inflates")


def test_import_refuses_a_snapshot_bomb_and_keeps_the_rest(bombs, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(FR, d / "fr_dump_0")
    shutil.copy(bombs / "snap.pickle", d / "snapshot_rank0.pickle")
    store = str(tmp_path / "s.db")
    open_engine(store).dispose()
    (res,) = cli_limited(["import", str(d), "--store", store, "--run", "r", "--no-progress"])
    refused(res, "snapshot_rank0.pickle", "memo index")
    assert "Flight Recorder: ranks [0]" in res["output"]


def test_a_folder_pickle_that_is_no_dump_is_skipped_not_a_lost_rank(tmp_path):
    """A pickle without FR keys found in a folder is some other file (a checkpoint, a bomb): not
    read, and not counted as rank 1's unreadable dump."""
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(FR, d / "fr_dump_0")
    (d / "fr_dump_1").write_bytes(MEMO_BOMB)
    (d / "weights_1.pkl").write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=2))
    store = str(tmp_path / "s.db")
    open_engine(store).dispose()
    (res,) = cli_limited(["import", str(d), "--store", store, "--run", "r", "--no-progress"])
    assert res["code"] == 0 and res["exc"] is None, res
    assert "Flight Recorder: ranks [0]" in res["output"] and "no dump from ranks" not in res["output"], res["output"]
    assert "unreadable" not in res["output"] and "MemoryError" not in res["output"], res["output"]


# --- the loader itself (in process: each refusal is found before anything large is built) --------

def test_real_dumps_and_snapshots_still_load():
    from graphdeck.store.safe_pickle import inflate_capped, load_plain

    assert load_plain(FR.read_bytes()) == pickle.loads(FR.read_bytes())
    raw = gzip.decompress((DATA / "gpt2_h200_trace" / "snapshot.pickle.gz").read_bytes())
    assert load_plain(raw) == pickle.loads(raw)
    assert inflate_capped((DATA / "gpt2_h200_trace" / "snapshot.pickle.gz").read_bytes(), 1 << 30) == raw
    for proto in (2, 3, 4, 5):
        obj = {"a": [1, 2.5, None, True, ("x", -(2**63), 2**64 - 1)], "b": "é" * 300}
        assert load_plain(pickle.dumps(obj, protocol=proto)) == obj


@pytest.mark.parametrize("data, words", [
    (pickle.dumps({"b": b"bytes"}, protocol=3), "BINBYTES"),
    (pickle.dumps({1, 2}, protocol=4), "EMPTY_SET"),
    (pickle.dumps(Path("/"), protocol=4), "names a class"),
    (pickle.dumps(2**100, protocol=2), "integer of"),
    (pickle.dumps("x", protocol=0), "protocol 2-5"),
    (b"\x80\x02" + b"]" * 100 + b"a" * 99 + b".", "deeper than"),  # lists nested 100 deep
    (b"\x80\x02]q\x00h\x05.", "Memo"),
])
def test_the_loader_refuses(data, words):
    from graphdeck.store.safe_pickle import UnsafePickle, load_plain

    with pytest.raises(UnsafePickle) as got:
        load_plain(data)
    assert words is None or words in str(got.value), str(got.value)


def test_expansion_is_bounded_not_just_parsing():
    from graphdeck.store.safe_pickle import Limits, UnsafePickle, load_plain, measure

    with pytest.raises(UnsafePickle, match="expands to more than"):
        load_plain(shared_sublists())
    with pytest.raises(UnsafePickle, match="deeper than"):
        load_plain(shared_sublists(levels=60, width=2))
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(UnsafePickle, match="deeper than"):
        measure(deep)
    assert measure(load_plain(shared_sublists(levels=3, width=2)), Limits()) < 200
