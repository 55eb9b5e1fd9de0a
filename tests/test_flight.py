"""Flight Recorder hangs on real torchrun jobs (issue 19, items 1-3): one 2-rank gloo job
(tests/flight_job.py, 3 s timeouts) hangs twice — a data-dependent Python branch that issues one
collective fewer on rank 1, then a recompile on rank 1 into a graph without the all-reduce. The
agent's dumps, the raw dumps imported with ``graphdeck import`` (pickle and JSON, odd names),
``fr_trace`` on the same dumps, and the job's TORCH_TRACE logs with records dropped on import."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import rank_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "flight_job.py"
BRANCH_LINE = next(i for i, t in enumerate(JOB.read_text().splitlines(), 1) if "# BRANCH" in t) + 1
MLP_LINE = next(i for i, t in enumerate(JOB.read_text().splitlines(), 1) if "# MLP_ALL_REDUCE" in t)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("flight")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_TRACE=str(out / "trace"))
    env.pop("TORCH_FR_BUFFER_SIZE", None)  # the agent turns the recorder on
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(JOB),
           str(out / "s.db"), str(out / "dumps")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    return out, proc


def _report(store: Path, run: str = "hangs"):
    with Session(open_engine(store, read_only=True)) as s:
        return rank_report(s, s.scalar(select(Run).where(Run.name == run)))


def _by_desc(rep):
    return {m.desc: m for m in rep.flight.mismatches}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_job_times_out_and_each_rank_dumps_into_the_store(job):
    out, proc = job
    assert proc.returncode != 0, "the second hang is not caught: the job fails"
    assert proc.stdout.count("case 1 timed out") == 2, proc.stdout[-2000:]
    with Session(open_engine(out / "s.db", read_only=True)) as s:
        dumps = s.execute(select(CompileEvent.rank, CompileEvent.metadata_json)
                          .where(CompileEvent.name == "flight_recorder")).all()
    assert {r for r, _ in dumps} == {0, 1}
    reasons = {r: {json.loads(m)["reason"] for rr, m in dumps if rr == r} for r in (0, 1)}
    assert all(rs & {"exception", "sigterm"} and rs <= {"exception", "sigterm", "exit"} for rs in reasons.values()), \
        dumps  # a later dump (at exit) is written only when the buffer changed; the latest is analysed


def test_branch_case_names_group_collective_rank_and_line(job):
    out, _ = job
    rep = _report(out / "s.db")
    assert rep.verdict == "FAIL"
    m = _by_desc(rep)["loss_sync"]
    assert (m.seq, m.op, m.reached, m.not_reached, m.primary) == (3, "gloo:all_reduce", [0], [1], True)
    assert m.cause[1] == "skipped"
    assert m.issued[0].line.endswith(f"flight_job.py:{BRANCH_LINE} in main") and not m.issued[0].compiled
    assert m.doing[1].group != m.group and m.doing[1].line.endswith("in main"), "what rank 1 did instead"
    assert m.last_completed[1].seq == 2
    why = " ".join(m.why[1])
    assert "data-dependent branch" in why and f"flight_job.py:{BRANCH_LINE}" in why
    assert "recompile" not in why, "phase 2's recompile is another frame: it does not explain this"
    # the branch itself: the innermost frame both stacks share (main) parts at lines 67 / 68; the
    # `if` that separates them, read from the source (issue 19: name the branch, not only the line)
    assert f"the branch: {JOB}:{BRANCH_LINE - 1} in main: `if loss.item() > 0:" in why, why
    text = rep.to_text()
    assert f"HANG group {m.group} (loss_sync): first mismatch at collective #3" in text


def test_recompile_case_names_the_recompile_and_the_missing_all_reduce(job):
    out, _ = job
    m = _by_desc(_report(out / "s.db"))["mlp"]
    assert (m.seq, m.reached, m.not_reached, m.primary) == (3, [0], [1], True)
    assert m.issued[0].compiled
    why = " ".join(m.why[1])
    assert "ranks [1] recompiled frame mlp_step" in why
    assert "size mismatch at index 0. expected 4, actual 5" in why
    assert re.search(rf"issues no all_reduce .* at .*flight_job.py:{MLP_LINE} in mlp_step", why), why
    assert f"the branch: {JOB}:{MLP_LINE - 1} in mlp_step: `if y.shape[0] % 2 == 0:" in why, why


def test_branch_between_stacks_and_source(tmp_path):
    """The branch finder on its own: lines on two sides of an if/else, in a loop, none shared."""
    from graphdeck.analysis.ranks.hangs import branch_between, branch_in_source

    src = tmp_path / "prog.py"
    src.write_text("def f(x):\n    for i in range(3):\n        if x > i:\n            a()\n        else:\n"
                   "            b()\n        c()\n")
    assert branch_in_source(str(src), 4, 6) == (3, "if x > i:")  # if vs else arm
    assert branch_in_source(str(src), 4, 7) == (3, "if x > i:")  # inside vs after
    assert branch_in_source(str(src), 7, 7) is None
    assert branch_in_source(str(src), 4, None) == (3, "if x > i:")
    assert branch_in_source(str(tmp_path / "missing.py"), 4, 6) is None
    lib = "/usr/lib/python3/site-packages/torch/distributed/c10d.py:10 in all_reduce"
    a = [lib, f"{src}:4 in f", f"{src}:20 in <module>"]
    b = [lib, f"{src}:6 in f", f"{src}:20 in <module>"]
    assert branch_between(a, b) == f"{src}:3 in f: `if x > i:`"
    assert branch_between([], b) is None and branch_between(a, [lib, f"{src}:9 in g"]) is None


def test_the_other_groups_are_consequences(job):
    out, _ = job
    rep = _report(out / "s.db")
    by = _by_desc(rep)
    for desc, waits_in in (("grad_sync", "loss_sync"), ("opt_sync", "mlp")):
        m = by[desc]
        assert not m.primary and m.not_reached == [0] and m.cause[0] == "waiting"
        assert m.doing[0].group == by[waits_in].group
    assert [m.primary for m in rep.flight.mismatches] == [True, True, False, False]


def _fr_trace_first_mismatches(folder: Path, tmp: Path) -> set[tuple]:
    """fr_trace on copies of the raw dumps whose pg_config names every group the entries use (on
    torch 2.13 it raises KeyError ('0', 0) on gloo's pg_config otherwise)."""
    fixed = tmp / "fixed"
    fixed.mkdir()
    for r in (0, 1):
        with open(folder / f"fr_dump_{r}", "rb") as fh:
            d = pickle.load(fh)
        d["pg_config"] = {n: {"name": n, "desc": desc, "ranks": "[0, 1]"} for n, desc in
                          {tuple(e["process_group"]) for e in d["entries"]}}
        with open(fixed / f"fr_dump_{r}", "wb") as fh:
            pickle.dump(d, fh)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(fixed), "-p",
                           "fr_dump_", "-o", str(tmp / "fr.pkl")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp / "fr.pkl", "rb") as fh:
        _types, db = pickle.load(fh)
    first: dict[str, tuple] = {}
    for c in db.collectives:
        if c.missing_ranks or c.type_of_mismatch or c.mismatch_collectives:
            first.setdefault(c.pg_desc, (c.pg_desc.split(":")[0], c.collective_seq_id, frozenset(c.missing_ranks or ())))
    return set(first.values())


def test_fr_trace_names_the_same_first_mismatches(job, tmp_path):
    out, _ = job
    ours = {(m.group, m.seq, frozenset(m.not_reached)) for m in _report(out / "s.db").flight.mismatches}
    raw = out / "dumps"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(raw), "-p",
                           "fr_dump_"], capture_output=True, text=True, timeout=120)
    assert "KeyError" in proc.stderr, "torch 2.13's fr_trace cannot read gloo dumps as written; we can"
    assert _fr_trace_first_mismatches(raw, tmp_path) == ours and len(ours) == 4


def test_import_folder_of_dumps_pickle_and_json_any_names(job, tmp_path):
    out, _ = job
    folder = tmp_path / "dumps"
    folder.mkdir()
    shutil.copy(out / "dumps" / "fr_dump_0", folder / "job.pickle.0")
    shutil.copy(out / "dumps" / "rank1-trace.json.1", folder / "rank1-trace.json.1")  # JSON: no stacks
    (folder / "notes.txt").write_text("not a dump")
    store = tmp_path / "imp.db"
    proc = _cli("import", str(folder), "--store", str(store), "--run", "fr")
    assert proc.returncode == 0, proc.stderr
    assert "Flight Recorder: ranks [0, 1], 24 entries, 0 dropped" in proc.stdout  # 2 barriers a rank: 12 each
    rep = _report(store, "fr")
    agent = _report(out / "s.db")
    assert {(m.group, m.seq, tuple(m.reached), tuple(m.not_reached)) for m in rep.flight.mismatches} == \
        {(m.group, m.seq, tuple(m.reached), tuple(m.not_reached)) for m in agent.flight.mismatches}
    proc = _cli("check-ranks", str(store), "--run", "fr")
    assert proc.returncode == 1 and "no compile records for this run" in proc.stdout


def test_a_rank_without_a_dump_is_named_and_the_verdict_incomplete(job, tmp_path):
    out, _ = job
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(out / "dumps" / "fr_dump_0", folder / "fr_dump_0")
    store = tmp_path / "one.db"
    assert _cli("import", str(folder), "--store", str(store), "--run", "fr").returncode == 0
    with Session(open_engine(store)) as s, s.begin():  # the job's 2 ranks (pg_config of gloo names none)
        s.scalar(select(Run).where(Run.name == "fr")).world_size = 2
    from graphdeck.store.db import get_or_create_rank

    with Session(open_engine(store)) as s, s.begin():
        get_or_create_rank(s, s.scalar(select(Run).where(Run.name == "fr")), 1, world_size=2)
    proc = _cli("check-ranks", str(store), "--run", "fr")
    assert proc.returncode == 3, proc.stdout
    assert "INCOMPLETE: rank 1: no Flight Recorder dump" in proc.stdout and "INCOMPLETE" in proc.stdout


def test_without_rank_1s_dump_the_report_says_what_rank_0s_dump_shows(job, tmp_path):
    """Issue 38 item 4: rank 1's dumps gone, the hang report still says what rank 0's dump shows per
    group — its latest collective, where and how it was issued — and joins rank 1's compile records
    (they predict rank 1 skips the mlp all-reduce); no rank condition keeps rank 1 from these
    collectives, so no group is called one-sided (NOTE: [One-sided collectives])."""
    import sqlite3

    out, _ = job
    store = tmp_path / "partial.db"
    with sqlite3.connect(out / "s.db") as src, sqlite3.connect(store) as dst:
        src.backup(dst)  # the store may still hold pages in its WAL: a file copy would miss them
    with sqlite3.connect(store) as db:
        assert db.execute("DELETE FROM compile_events WHERE name = 'flight_recorder' AND rank = 1").rowcount
    rep = _report(store)
    assert not rep.flight.mismatches and set(rep.flight.groups_incomplete) == set(rep.flight.shown)
    shown = {rep.flight.descs.get(g): t for g, t in rep.flight.shown.items()}
    assert shown["loss_sync"].startswith("what the dumps show: rank 0's latest collective of the group is "
                                         "gloo:all_reduce #3 of group ") and \
        f"flight_job.py:{BRANCH_LINE} in main, issued by all_reduce from non-compiled code" in shown["loss_sync"]
    assert shown["loss_sync"].endswith("so these dumps alone do not explain a hang"), shown["loss_sync"]
    assert "no condition on the rank in its stack keeps ranks [1] from it" in shown["default_pg"]
    mlp = shown["mlp"]
    assert "flight_job.py:" in mlp and " in mlp_step inside a compiled graph" in mlp, mlp
    assert "the compile records of ranks [1] predict that they skip it: ranks [1] skip all_reduce #0 of the step" in mlp
    assert "do not explain" not in mlp
    text = rep.to_text()
    assert "    what the dumps show: rank 0's latest collective" in text and rep.verdict == "FAIL"  # the recompile


def _corrupt(log: Path, compile_id: tuple[int, int]) -> int:
    """Break every envelope of compile ``compile_id`` in a TORCH_TRACE log (its records are then
    dropped on import as bad JSON). Returns how many."""
    lines, n = log.read_text().splitlines(keepends=True), 0
    key = f'"frame_id": {compile_id[0]}, "frame_compile_id": {compile_id[1]}'
    for i, t in enumerate(lines):
        if not t.startswith("\t") and key in t:
            lines[i] = t.replace("{", "{{", 1)
            n += 1
    log.write_text("".join(lines))
    return n


def test_schedule_record_dropped_on_import_is_incomplete_never_agree(job, tmp_path):
    out, _ = job
    logs = tmp_path / "logs"
    shutil.copytree(out / "trace", logs)
    rank1 = next(p for p in logs.iterdir() if "rank_1" in p.name)
    # the TORCH_TRACE logs alone agree but for rank 1's recompile; drop that compile's records
    assert _corrupt(rank1, (1, 1)) > 0
    store = tmp_path / "tt.db"
    proc = _cli("import", str(logs), "--store", str(store), "--run", "tt")
    assert proc.returncode == 0, proc.stderr
    rep = _report(store, "tt")
    assert not rep.divergences and rep.verdict == "INCOMPLETE", rep.to_text()
    assert any(re.match(r"rank 1: compile record dropped on import: line \d+: record: bad_json", x)
               for x in rep.missing_evidence), rep.missing_evidence
    proc = _cli("check-ranks", str(store), "--run", "tt")
    assert proc.returncode == 3 and "OK: all ranks agree" not in proc.stdout
    assert "INCOMPLETE" in proc.stdout.splitlines()[-1]


def test_a_graph_record_with_a_bad_md5_is_kept_and_named_with_its_kind_and_compile(job, tmp_path):
    out, _ = job
    logs = tmp_path / "logs"
    shutil.copytree(out / "trace", logs)
    rank1 = next(p for p in logs.iterdir() if "rank_1" in p.name)
    lines = rank1.read_text().splitlines(keepends=True)
    at = next(i for i, t in enumerate(lines) if '"dynamo_output_graph"' in t
              and '"frame_id": 1, "frame_compile_id": 1' in t)
    lines[at + 1] = lines[at + 1].replace("\t", "\tX", 1)  # its first payload line: the md5 no longer matches
    rank1.write_text("".join(lines))
    store = tmp_path / "md5.db"
    assert _cli("import", str(logs), "--store", str(store), "--run", "m").returncode == 0
    rep = _report(store, "m")
    assert f"rank 1: line {at + 1}: dynamo_output_graph compile 1/1: md5_mismatch" in rep.unverified, rep.unverified
    assert not any("dynamo_output_graph" in m for m in rep.missing_evidence), "kept and read (issue 40 item 5)"
    assert rep.verdict == "FAIL", "the recompile still shows: FAIL, the unverified record it rests on named"


def test_predictions_checked_against_the_record(job):
    """Item 3: rank 1 recompiled frame ``mlp_step`` into a graph without the all-reduce; the
    predicted schedule runs that latest compile on rank 1 (not both), so it predicts rank 1 skips
    the ``mlp`` all-reduce — and the record shows rank 1 never reached it: the prediction held.
    The Python-branch groups issue no collective from a compiled graph: not predicted."""
    out, _ = job
    rep = _report(out / "s.db")
    (m,) = rep.collective_mismatches
    assert [v["ranks"] for v in m.variants] == [[0], [1]] and m.variants[1]["collective"] is None
    assert m.variants[0]["collective"]["compile_id"] == "1/0"
    assert rep.schedules[1] == [], "rank 1 runs compile 1/1 (no all_reduce), not 1/0 and 1/1"
    by = {p.desc: p for p in rep.predictions}
    mlp = by["mlp"]
    assert (mlp.outcome, mlp.predicted_skipping, mlp.recorded_not_reached) == ("held", [1], [1])
    assert mlp.predicted_segments[0] == [{"compile_id": "1/0", "source": "graph", "count": len(rep.schedules[0])}]
    line = mlp.line()
    assert line.startswith(f"group {mlp.group} (mlp): predicted: ranks [1] skip all_reduce #0 of the step "
                           "(ranks [0] issue it from compile 1/0; ranks [1] run compile 1/1 of that frame)")
    assert line.endswith("— recorded: ranks [1] never reached gloo:all_reduce #3 of group mlp: held")
    assert by["loss_sync"].outcome == "not predicted" and by["opt_sync"].outcome == "not predicted"
    # rank 1's 1/0 (4 rows, all_reduce) stays in Dynamo's cache beside the static 1/1 (5 rows): the
    # compile records cannot tell whether 4-row batches come back — named, not guessed
    assert any(x.startswith("rank 1 frame mlp_step") and "whether compile 1/0 still runs cannot be told" in x
               for x in rep.missing_evidence), rep.missing_evidence
    text = rep.to_text()
    assert "Predicted vs recorded, per process group:" in text and f"  {line}" in text
    assert rep.to_dict()["predictions"][[p.desc for p in rep.predictions].index("mlp")]["outcome"] == "held"


def test_flight_section_and_prediction_name_the_same_recompile(job, tmp_path):
    """Issue 34: the same question — which compile made rank 1 skip the ``mlp`` all-reduce — was
    answered twice: the predicted-hang section from the ranks' steady-state compiles (rank 1 runs
    compile 1/1), the Flight Recorder section from the frames the dumps' stacks pass through. A
    stack that does not name the compiled frame (here: the dumps' ``mlp_step`` frames renamed, as a
    recorder's bounded stack of a deep compiled call loses its user frames) made the Flight section
    say "no compile explains this" beside a prediction naming the recompile. Now the prediction's
    answer is the one both show (NOTE: [One answer to "which compile explains this hang"])."""
    import sqlite3

    out, _ = job
    store = tmp_path / "s.db"
    with sqlite3.connect(out / "s.db") as src, sqlite3.connect(store) as db:
        src.backup(db)
        for rid, payload in db.execute("SELECT id, payload FROM compile_events WHERE name = 'flight_recorder'").fetchall():
            assert " in mlp_step" in payload
            db.execute("UPDATE compile_events SET payload = ? WHERE id = ?",
                       (payload.replace(" in mlp_step", " in step_body"), rid))
    rep = _report(store)
    m = _by_desc(rep)["mlp"]
    why = " ".join(m.why[1])
    assert "no compile explains this" not in why, why
    pred = {p.desc: p for p in rep.predictions}["mlp"]
    assert f"the predicted schedule of group {m.group} explains it: {pred.predicted}" in why, why
    assert "ranks [1] run compile 1/1 of that frame" in why
    assert "no compile explains this" not in rep.to_text().split("HANG group 3 (mlp)")[1].split("HANG")[0]


def test_every_surface_gives_the_hangs_the_same_verdicts(job):
    """Issue 34: CLI text and exit code, --json and the HTTP API agree on every check (tests/verdict_surfaces.py)."""
    from tests.verdict_surfaces import disagreements

    out, _ = job
    assert not disagreements(out / "s.db", ["hangs"])
