"""Issue 40 item 5: a TORCH_TRACE payload whose md5 fails is kept as "unverified" and read; the
checks say a finding rests on it, and end INCOMPLETE only for records that are really missing.

Inputs: tlparse's own test logs (``../shared/data/torch_trace/tlparse_tests``: ``export.log``,
``inductor_provenance_extended_log.txt`` and ``multi_rank_runtime/`` have payloads whose md5
differs from their envelope's) and a copy of a generated 2-rank DDP log with one graph's
payload edited (comment text only: the graph is the same).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.compilation.health import compile_health
from graphdeck.analysis.ranks.core import rank_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Graph, Run
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import shared_path

INPUTS = ("data", "torch_trace", "tlparse_tests", "inputs")


def _run(s: Session, name: str) -> Run:
    return s.scalar(select(Run).where(Run.name == name))


def test_exported_program_with_a_bad_md5_keeps_its_export_graph(tmp_path):
    engine = open_engine(tmp_path / "s.db")
    res = import_torch_trace(engine, shared_path(*INPUTS, "export.log"), run_name="ex")
    assert res.dropped == 0 and res.unverified == 1, res.stats
    with Session(engine) as s:
        run = _run(s, "ex")
        (g,) = s.scalars(select(Graph).where(Graph.run_id == run.id, Graph.kind == "export")).all()
        assert g.num_nodes > 0 and json.loads(g.meta_json)["unverified"] == "md5_mismatch"
        rep = rank_report(s, run)
        assert rep.missing_evidence == [] and rep.verdict == "OK", rep.missing_evidence
        assert rep.unverified == ["rank 0: line 60: exported_program: md5_mismatch"]


def test_unverified_records_that_are_no_evidence_leave_the_verdict_alone(tmp_path):
    """The kernel stack traces of the provenance log fail their md5: compile health is PASS (it
    was INCOMPLETE); the runtime estimates of the 7-rank logs are kept and marked."""
    engine = open_engine(tmp_path / "s.db")
    import_torch_trace(engine, shared_path(*INPUTS, "inductor_provenance_extended_log.txt"), run_name="prov")
    res = import_torch_trace(engine, shared_path(*INPUTS, "multi_rank_runtime"), run_name="rt")
    assert res.dropped == 0 and res.unverified == 19, res.stats
    with Session(engine) as s:
        h = compile_health(s, _run(s, "prov"))
        assert h.verdict == "PASS" and h.missing_evidence == [] and h.unverified == [], h.missing_evidence
        rt = _run(s, "rt")
        metas = [json.loads(m) for m in s.scalars(select(CompileEvent.metadata_json).where(
            CompileEvent.run_id == rt.id, CompileEvent.rank == 0,
            CompileEvent.name == "inductor_runtime_and_tensor_meta"))]
        assert sum(m.get("unverified") == "md5_mismatch" for m in metas) == 4, metas
        rep = rank_report(s, rt)
        assert rep.verdict == "FAIL" and [d.ranks for d in rep.divergences] == [[5, 6]]
        assert not any("dropped on import" in m for m in rep.missing_evidence), rep.missing_evidence


def test_a_graph_with_a_bad_md5_is_read_and_the_verdict_says_so(tmp_path):
    """Generated healthy DDP run: rank 1's first dynamo graph edited in a comment (md5 fails).
    Before: the graph was dropped and check-ranks ended INCOMPLETE; now the ranks agree (OK, exit
    0) and the report names the unverified record the verdict rests on."""
    logs = tmp_path / "logs"
    shutil.copytree(shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "ddp"), logs,
                    ignore=shutil.ignore_patterns("*.txt", "*.py"))
    rank1 = next(p for p in logs.iterdir() if "rank_1" in p.name)
    lines = rank1.read_text().splitlines(keepends=True)
    at = next(i for i, t in enumerate(lines) if '"dynamo_output_graph"' in t)
    hit = next(j for j in range(at + 1, len(lines)) if lines[j].lstrip("\t").lstrip().startswith("#"))
    lines[hit] = lines[hit].replace("#", "# edited:", 1)
    rank1.write_text("".join(lines))
    store = tmp_path / "s.db"
    imp = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(logs), "--store", str(store),
                          "--run", "m"], capture_output=True, text=True)
    assert imp.returncode == 0 and "1 kept unverified" in imp.stdout, imp.stdout + imp.stderr
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", "--store", str(store), "--run", "m"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"UNVERIFIED (md5 failed, record kept and read): rank 1: line {at + 1}: dynamo_output_graph" in proc.stdout
