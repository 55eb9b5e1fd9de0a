"""A 64-rank run from the scale harness (bench/scale_harness.py, issue 26 item 1): every check that
reads a run finds what the harness put there.

The run: records of the 2-rank CPU DDP capture (tests/data/scale_cpu2) for 64 ranks, each rank's
Kineto trace (its gloo collectives) cut to ~1,000 events, clocks skewed, one straggler, one rank
whose collective #5 moves twice the elements (and whose DDP bucket record says so), one rank with
no trace; ingested by graphdeck's own ingest in 2 processes into one SQLite store. PostgreSQL: the
same harness into a PostgreSQL database, alignment and matching only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_harness import make_scale_run  # noqa: E402
from graphdeck.analysis.traces.collectives import align_and_match  # noqa: E402
from graphdeck.store.db import open_engine  # noqa: E402
from graphdeck.store.schema import Run  # noqa: E402

N = 64
EVENTS = 1000


@pytest.fixture(scope="module")
def scale64(tmp_path_factory):
    store = tmp_path_factory.mktemp("scale") / "scale64.db"
    run = make_scale_run(str(store), N, seed=26, traces="cpu", events_per_rank=EVENTS, workers=2)
    engine = open_engine(store)
    with Session(engine) as s:
        aligned = align_and_match(s, run.run_id)
    return run, engine, aligned


def test_every_traced_rank_is_ingested_and_matched(scale64):
    run, _engine, a = scale64
    assert sorted(a["ranks"]) == [r for r in range(N) if r != run.missing]
    assert all(e > 0 for *_x, e in run.ingest)
    assert not any(a["unmatched"].values()), a["unmatched"]
    ok = [c for c in a["collectives"] if c["suspect"] is None]
    assert ok and all(len(c["ranks"]) == N - 1 for c in a["collectives"])


def test_clocks_aligned_by_the_collectives(scale64):
    """Rank r's clock was skewed by the harness's offset; copies of one source rank must be
    aligned to each other within 1 µs (the two source ranks' own clocks differ by an unknown
    amount, so ranks are compared to rank 0 or 1 of their own source)."""
    run, _engine, a = scale64
    off = a["offsets"]
    for r in a["ranks"]:
        src = r % 2
        want_us = run.clock_offsets_us[r] - run.clock_offsets_us[src]
        got_ns = off[r]["offset_ns"] - off[src]["offset_ns"]
        assert abs(got_ns - want_us * 1000) < 1000, (r, got_ns, want_us)
        assert off[r]["method"] in ("reference", "collective_end_median")


def test_the_straggler_is_found(scale64):
    run, _engine, a = scale64
    assert a["timing"]["straggler"] == run.straggler
    assert f"straggler: rank {run.straggler} " in a["timing"]["message"]
    named = [s["straggler"] for s in a["stragglers"] if s["straggler"] is not None]
    assert named and set(named) == {run.straggler}
    # 63 ranks: the message names the three that waited most and sums the rest, not 62 clauses
    assert f"{N - 2} ranks waited" in a["timing"]["message"]


def test_the_divergent_rank_at_its_collective(scale64):
    run, _engine, a = scale64
    assert [(d["rank"], d["group"], d["seq"]) for d in a["divergent"]] == [(run.divergent, "0", run.diverge_seq)]
    d = a["divergent"][0]
    assert d["nelems"] == 2 * d["expected_nelems"] and d["agreeing_ranks"] == N - 2
    assert f"rank {run.divergent} diverges at collective #{run.diverge_seq} of group '0'" in a["timing"]["message"]


def test_the_rank_without_a_trace_is_incomplete_never_pass(scale64):
    run, _engine, a = scale64
    assert a["missing_ranks"] == [run.missing]
    assert a["verdict"] == "INCOMPLETE" and a["timing"]["verdict"] == "INCOMPLETE"
    assert f"INCOMPLETE: rank(s) {run.missing} of the run have no usable trace" in a["timing"]["message"]


def test_check_ranks_names_the_divergent_rank_and_the_missing_trace(scale64):
    from graphdeck.analysis.ranks.core import rank_report

    run, engine, _a = scale64
    with Session(engine) as s:
        report = rank_report(s, s.get(Run, run.run_id))
    text = report.to_text()
    assert report.verdict == "FAIL"
    bucket = run.diverge_seq % 3  # the CPU run's DDP reducer has 3 buckets
    assert f"rank {run.divergent}: all_reduce" in text and f"DDP reducer bucket {bucket}" in text
    assert f"all ranks but {run.divergent}: all_reduce" in text and "(graph None)" not in text
    # both numberings of the one divergence: the predicted step's and the traces'
    assert "of the predicted step differs" in text
    assert f"in the traces: collective #{run.diverge_seq} of group 0" in text
    assert f"straggler: rank {run.straggler} " in text
    assert f"INCOMPLETE: rank(s) {run.missing} " in text
    # the straggler, the divergence and the missing rank each on a note line of its own (newcomer)
    notes = [ln for ln in text.splitlines() if ln.startswith("note: ")]
    for start in ("note: straggler:", "note: diverged:", "note: INCOMPLETE:"):
        assert sum(ln.startswith(start) for ln in notes) == 1, notes
    # 64 ranks condense (docs/large-runs.md): identical per-rank lines grouped, rank lists as ranges
    assert f"ranks 0-{N - 1}: " in text and f"{N} ranks [0-{N - 1}]" in text
    _assert_condensed(text)


def _assert_condensed(text: str, most: int = 9) -> None:
    """No line spells out more than ``most`` rank numbers one by one (a list of 64 would)."""
    import re

    for line in text.splitlines():
        spelled = re.findall(r"(?:\[|, )(\d+)(?=[,\]])", line)
        assert len(spelled) <= most, line[:300]


def test_check_grads_over_64_ranks(scale64):
    from graphdeck.analysis.gradients.core import validate_backward

    run, engine, _a = scale64
    report = validate_backward(engine, run.run_name)
    assert report.verdict == "PASS", report.to_text()[:2000]
    assert len({r for r in report.ranks}) == N
    text = report.to_text()  # ranks that saw the same steps: one entry, ranges (not 64 "rank N: steps ..." clauses)
    assert f"ranks [0-{N - 1}]: PASS" in text and f"saw: ranks 0-{N - 1}: steps 0–" in text, text[:600]
    _assert_condensed(text)


def test_check_compile_text_condenses(scale64):
    """check-compile over 64 ranks: restarts, breaks and per-rank times one line per kind, ranks
    as ranges (issue 26)."""
    from graphdeck.analysis.compilation.health import Thresholds, compile_health
    from graphdeck.analysis.compilation.text import to_text

    run, engine, _a = scale64
    with Session(engine) as s:
        text = to_text(compile_health(s, s.get(Run, run.run_id), Thresholds()))
    assert f"on rank(s) 0-{N - 1}: " in text and f"  ranks [0-{N - 1}]: " in text, text[:1500]
    _assert_condensed(text)
    assert len(text.splitlines()) < 40, text[:1500]


def test_run_timeline_draws_the_worst_lanes_and_takes_others(scale64):
    """63 traced ranks: the run timeline draws 8 lanes, the straggler's first among them (the most
    late), and any others on request; a rank without a trace is a 400 naming it."""
    from fastapi.testclient import TestClient

    from graphdeck.server.app import create_app
    from graphdeck.server.settings import Settings

    run, engine, _a = scale64
    with TestClient(create_app(Settings(store=engine.url.database))) as c:
        fig = c.get(f"/api/runs/{run.run_name}/timeline", params={"max_shapes": 400}).json()
        lanes = fig["layout"]["meta"]["lanes"]
        assert lanes["chosen"] == "worst" and lanes["traced"] == N - 1 and len(lanes["shown"]) == 8
        assert run.straggler in lanes["shown"] and run.missing not in lanes["shown"]
        # the documented order (docs/large-runs.md): the latest arrivals, straggler first, then the
        # reference rank — in the API and in the lanes drawn top to bottom
        assert lanes["shown"][0] == run.straggler and 0 in lanes["shown"], lanes["shown"]
        rows = fig["layout"]["yaxis"]["categoryarray"]
        assert rows[0].startswith(f"rank {run.straggler} ·"), rows[:3]
        assert f"8 of {N - 1} traced ranks" in fig["layout"]["title"]["text"], fig["layout"]["title"]
        two = c.get(f"/api/runs/{run.run_name}/timeline", params={"ranks": "0,5", "max_shapes": 200}).json()
        assert two["layout"]["meta"]["lanes"] == {"shown": [0, 5], "traced": N - 1, "chosen": "requested"}
        bad = c.get(f"/api/runs/{run.run_name}/timeline", params={"ranks": str(run.missing)})
        assert bad.status_code == 400 and f"{run.missing}" in bad.json()["error"] and "no usable trace" in bad.json()["error"]


def test_postgresql_store(pg_url):
    """The harness into PostgreSQL (records merged, traces ingested by 2 processes): the same
    findings from the same seed."""
    run = make_scale_run(pg_url, 8, seed=26, traces="cpu", events_per_rank=EVENTS, workers=2)
    with Session(open_engine(pg_url)) as s:
        a = align_and_match(s, run.run_id)
    assert a["timing"]["straggler"] == run.straggler
    assert [d["rank"] for d in a["divergent"]] == [run.divergent]
    assert a["missing_ranks"] == [run.missing] and a["verdict"] == "INCOMPLETE"
