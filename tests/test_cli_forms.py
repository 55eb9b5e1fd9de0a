"""Every command that reads a run of a store takes both forms (issue 36, newcomer consistency):
``CMD STORE --run RUN`` (the checks') and ``CMD RUN --store STORE`` (summary's) give the same
output and exit code; a newcomer's ``check-grads demo --store graphdeck.db`` said "No such option
'--store'". Two stores, or no run, are exit 2 naming the forms (NOTE: [Store and run arguments]).

Real parts: the repository's demo store (tests/data/demo_warm_bucket), the CLI in subprocesses.
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

RUN = "demo"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("forms") / "demo.db"
    with gzip.open(REPO / "tests/data/demo_warm_bucket/demo.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.mark.parametrize("cmd,extra", [
    ("check-grads", ()), ("check-ranks", ()), ("check-compile", ()), ("summary", ()),
    ("memory", ("1",)), ("export-trace", ("-o", "OUT")),
])
def test_store_then_run_and_run_then_store_are_the_same(store, tmp_path, cmd, extra):
    outs = []
    for i, form in enumerate(([str(store), "--run", RUN], [RUN, "--store", str(store)])):
        args = [a.replace("OUT", str(tmp_path / f"{i}.json")) for a in extra]
        if cmd == "memory":  # its positionals: [STORE | RUN] GRAPH_ID
            form, args = form[:1] + args + form[1:], []
        proc = cli(cmd, *form, *args)
        assert proc.returncode in (0, 1, 3), (cmd, form, proc.returncode, proc.stderr[-2000:])
        out = proc.stdout.replace(str(tmp_path / f"{i}.json"), "OUT")
        # what a command says of its own elapsed time ("…, 0.3s)") depends on the host's load
        outs.append((proc.returncode, re.sub(r"\b\d+(\.\d+)?\s?m?s\b", "<time>", out)))
    assert outs[0] == outs[1], (cmd, outs)


def test_delete_run_takes_both_forms(store, tmp_path):
    for i, form in enumerate((["--run", RUN], ["--store"])):
        copy = tmp_path / f"{i}.db"
        shutil.copy(store, copy)
        args = [str(copy), *form] if i == 0 else [RUN, "--store", str(copy)]
        proc = cli("delete-run", *args)
        assert proc.returncode == 0 and f"deleted run {RUN!r}" in proc.stdout, (args, proc.stderr)


def test_two_stores_or_no_run_are_exit_2_naming_the_forms(store, tmp_path):
    two = cli("check-ranks", str(store), "--store", str(tmp_path / "other.db"), "--run", RUN)
    assert two.returncode == 2 and "two stores given" in two.stderr, two.stderr
    for cmd in ("check-ranks", "summary", "delete-run"):
        none = cli(cmd, str(store))
        assert none.returncode == 2 and "STORE --run RUN, or RUN --store STORE" in none.stderr, (cmd, none.stderr)


def test_a_lone_run_reads_the_default_store(store, tmp_path):
    shutil.copy(store, tmp_path / "graphdeck.db")
    alone = cli("check-ranks", RUN, cwd=tmp_path)
    given = cli("check-ranks", str(store), "--run", RUN)
    assert alone.returncode == given.returncode == 0 and alone.stdout == given.stdout, (alone.stderr, given.stderr)
