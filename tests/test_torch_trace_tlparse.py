"""TORCH_TRACE import checked against the anchor, tlparse (PyPI ``tlparse``), on every log of
``../shared/data/torch_trace``: the same compile ids per rank, the same graph breaks and
recompiles with the same reasons, the same failures and restarts.

tlparse is run once per rank file (``tlparse FILE -o DIR``); its facts are read from its output:
``compile_directory.json`` (one key per compile id, e.g. ``[4/0_1]``; artifacts
``dynamo_graph_break_reason_<n>.txt`` and ``recompile_reasons_<n>.json`` hold the reasons) and
``failures_and_restarts.html`` (one table row per failure or restart).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.compilation.index import _reasons, compile_index
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from graphdeck.store.torch_trace import import_torch_trace
from graphdeck.store.torch_trace_log import discover, rank_from_filename
from tests.conftest import IN_CI, shared_path

#: Every input of the corpus: single files and rank folders (each folder is one run).
INPUTS = [
    "tlparse_tests/inputs/artifacts.log",
    "tlparse_tests/inputs/autotune_with_compile_id.log",
    "tlparse_tests/inputs/chromium_events.log",
    "tlparse_tests/inputs/comp_failure.log",
    "tlparse_tests/inputs/export.log",
    "tlparse_tests/inputs/collectives_parity",
    "tlparse_tests/inputs/inductor_provenance_aot_log.txt",
    "tlparse_tests/inputs/inductor_provenance_aot_log_old.txt",
    "tlparse_tests/inputs/inductor_provenance_aot_debug_handle_log.txt",
    "tlparse_tests/inputs/inductor_provenance_extended_log.txt",
    "tlparse_tests/inputs/inductor_provenance_jit_log.txt",
    "tlparse_tests/inputs/inductor_provenance_jit_debug_handle_log.txt",
    "tlparse_tests/inputs/multi_rank_logs",
    "tlparse_tests/inputs/multi_rank_messy_input",
    "tlparse_tests/inputs/multi_rank_runtime",
    "tlparse_tests/inputs/simple.log",
    "generated_torch2.13_cpu_gloo/ddp",
    "generated_torch2.13_cpu_gloo/unused",
    "generated_torch2.13_cpu_gloo/graphbreak",
    "generated_torch2.13_cpu_gloo/detach",
]


def _tlparse() -> str:
    exe = shutil.which("tlparse")
    if exe is None:
        if IN_CI:
            pytest.fail("tlparse is missing under CI=true (it is in the test extra)")
        pytest.skip("tlparse not installed")
    return exe


class _FailureRows(HTMLParser):
    """Rows of tlparse's failures_and_restarts.html table: [compile id, type, description, source]."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self.rows:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _norm(text: str) -> str:
    """Whitespace collapsed; ``<...>`` dropped, because tlparse writes reasons into its HTML
    unescaped, so ``[<class 'X'>]`` reads back as ``[]``."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]*>", "", text or "")).strip()


def tlparse_facts(exe: str, log: Path, out: Path) -> dict:
    """Compile ids, graph breaks, recompile reasons and failures as tlparse reports them."""
    subprocess.run([exe, str(log), "-o", str(out), "--overwrite", "--no-browser"], check=True,
                   capture_output=True, timeout=120)
    directory = json.loads((out / "compile_directory.json").read_text())
    cids = {k.strip("[]") for k in directory if k != "[-/-]"}
    breaks, recompiles = Counter(), Counter()
    for key, value in directory.items():
        for art in value.get("artifacts", []):
            path = out / art["url"]
            if art["name"].startswith("dynamo_graph_break_reason_"):
                breaks[(key.strip("[]"), _norm(path.read_text()))] += 1
            elif art["name"].startswith("recompile_reasons_"):
                for reason in _reasons(path.read_text()):
                    recompiles[(key.strip("[]"), _norm(reason))] += 1
    parser = _FailureRows()
    page = out / "failures_and_restarts.html"
    parser.feed(page.read_text() if page.exists() else "")
    failures = Counter((r[0].strip("[] "), r[1], _norm(r[2])) for r in parser.rows if len(r) >= 3)
    return {"compile_ids": cids, "graph_breaks": breaks, "recompiles": recompiles, "failures": failures}


def _tl(cid: str) -> str:
    """The store's compiled-autograd id ``!0`` in tlparse's spelling ``!0/-/-``."""
    return f"{cid}/-/-" if re.fullmatch(r"!\d+(_\d+)?", cid) else cid


def graphdeck_facts(entries: list[dict]) -> dict:
    breaks, recompiles, failures = Counter(), Counter(), Counter()
    entries = [e for e in entries if e["compile_id"] is not None]  # tlparse's "[-/-]", left out there too
    for e in entries:
        cid = _tl(e["compile_id"])
        for b in e["graph_breaks"]:
            breaks[(cid, _norm(b["reason"]))] += 1
        for r in e["recompile_reasons"]:
            recompiles[(cid, _norm(r))] += 0  # counted from the artifact below
        for r in e.get("_recompile_artifact", []):
            recompiles[(cid, _norm(r))] += 1
        if e["failure"]:
            failures[(cid, e["failure"]["type"], _norm(e["failure"]["reason"]))] += 1
        for r in e["restarts"]:
            failures[(cid, "RestartAnalysis", _norm(r))] += 1
    return {"compile_ids": {_tl(e["compile_id"]) for e in entries}, "graph_breaks": breaks,
            "recompiles": +recompiles, "failures": failures}


@pytest.fixture(scope="module")
def corpus_store(tmp_path_factory):
    """Every corpus input imported (strict off: some logs carry real md5 mismatches) into one
    store, one run per input."""
    store = tmp_path_factory.mktemp("tt") / "corpus.db"
    engine = open_engine(store)
    results = {}
    for rel in INPUTS:
        path = shared_path("data", "torch_trace", *rel.split("/"))
        results[rel] = import_torch_trace(engine, path, run_name=rel)
    return engine, results


@pytest.mark.parametrize("rel", INPUTS)
def test_same_facts_as_tlparse(rel, corpus_store, tmp_path):
    exe = _tlparse()
    engine, results = corpus_store
    path = shared_path("data", "torch_trace", *rel.split("/"))
    files, _ = discover([path])
    with Session(engine) as s:
        run = s.scalar(select(Run).where(Run.name == rel))
        index = compile_index(s, run)
        _attach_recompile_artifacts(s, run, index)
    for i, log in enumerate(files):
        rank = rank_from_filename(log)
        rank = rank if rank is not None else results[rel].files[i]["rank"]
        want = tlparse_facts(exe, log, tmp_path / f"tl{i}")
        got = graphdeck_facts(index.get(rank, []))
        for key in ("compile_ids", "graph_breaks", "recompiles", "failures"):
            assert got[key] == want[key], f"{rel} rank {rank}: {key} differ from tlparse's"


def _attach_recompile_artifacts(session, run, index) -> None:
    """tlparse counts each ``recompile_reasons`` artifact's entries; the index also folds in
    ``compilation_metrics.recompile_reason``, so re-read the artifacts alone here."""
    from graphdeck.store.schema import CompileEvent

    rows = session.execute(select(CompileEvent.rank, CompileEvent.compile_id, CompileEvent.payload)
                           .where(CompileEvent.run_id == run.id, CompileEvent.name == "recompile_reasons")).all()
    by = {(r, e["compile_id"]): e for r, entries in index.items() for e in entries}
    for rank, cid, payload in rows:
        reasons = _reasons(payload)
        by[(rank, cid)].setdefault("_recompile_artifact", []).extend(str(x) for x in reasons)


def test_c4_multi_rank_groups(corpus_store):
    """Case C4: ranks 0 and 2 are one failed compile, rank 1 has 15 compiles, rank 3 has 7; the
    ranks come from the file names (the envelopes carry none)."""
    engine, results = corpus_store
    res = results["tlparse_tests/inputs/multi_rank_logs"]
    assert res.ranks == [0, 1, 2, 3], "ranks from the file names"
    with Session(engine) as s:
        index = compile_index(s, s.scalar(select(Run).where(Run.name == "tlparse_tests/inputs/multi_rank_logs")))
    signature = {r: tuple(e["compile_id"] for e in entries) for r, entries in index.items()}
    assert signature[0] == signature[2] and len(signature[0]) == 1, "ranks 0 and 2: one frame"
    assert index[0][0]["status"] == "failed" and index[0][0]["failure"]["type"], "rank 0's compile failed"
    assert len(signature[1]) == 15 and len(signature[3]) == 7, "15 compiles on rank 1, 7 on rank 3"
    assert sum(len(e["recompile_reasons"]) > 0 for e in index[1]) == 14, "14 recompiles with reasons on rank 1"


if os.environ.get("GRAPHDECK_TT_DEBUG"):  # pragma: no cover - print both sides for one input
    print(INPUTS)
