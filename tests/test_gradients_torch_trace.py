"""Graph mode over imported TORCH_TRACE logs (../shared/data/torch_trace/generated_torch2.13_cpu_gloo,
2 gloo ranks, torch.compile(DDP(model)) with Inductor): the verdicts its SOURCES.md gives.

The model (SOURCES.md): emb, blk1, blk2, head, aux (Linear each). ``ddp``: all 10 parameters get
gradients on both ranks. ``detach``: blk2.weight/bias get none, the cut is the ``detach`` at the
generator's line 20. ``unused``: aux.weight/bias are not graph inputs (a log has no parameter
list, so the expected names are passed) and step 1 raises DDP's "Expected to have finished
reduction" on both ranks.
"""

from __future__ import annotations

import pytest

from graphdeck import validate_backward
from graphdeck.store.db import open_engine
from tests.conftest import shared_path

torch_trace = pytest.importorskip("graphdeck.store.torch_trace", reason="the TORCH_TRACE importer (issue #6)")

NAMES = [f"{m}.{p}" for m in ("emb", "blk1", "blk2", "head", "aux") for p in ("weight", "bias")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    base = shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo")
    engine = open_engine(tmp_path_factory.mktemp("tt") / "tt.db")
    for scenario in ("ddp", "unused", "detach"):
        torch_trace.import_torch_trace(engine, sorted((base / scenario).glob("*.log")), run_name=scenario, strict=False)
    return engine


def statuses(rep):
    return {(r.rank, r.fqn): r.status for r in rep}


def test_ddp_baseline_all_parameters_get_gradients(store):
    rep = validate_backward(store, "ddp", expected_params=NAMES)
    assert statuses(rep) == {(rank, n): "OK" for rank in (0, 1) for n in NAMES}, rep.to_text()
    # A log holds no run-time gradient evidence: nothing failed, but that is not a PASS.
    assert rep.verdict == "INCOMPLETE" and len(rep.gaps) == 1 and "run-time gradient evidence" in rep.gaps[0]
    rep.allow_incomplete = True
    assert rep.ok


def test_detach_cuts_blk2_at_line_20(store):
    rep = validate_backward(store, "detach")
    bad = {k: v for k, v in statuses(rep).items() if v != "OK"}
    assert bad == {(r, f"blk2.{p}"): "NO_GRAD" for r in (0, 1) for p in ("weight", "bias")}, rep.to_text()
    # Its job ran with find_unused_parameters=True and finished: no asserted DDP error (issue 24.2),
    # and the note says why DEAD_END cannot be told, truly of an imported run (issue 24.1).
    assert not [f for f in rep.findings if f.kind == "DDP_UNUSED_ERROR"]
    assert any(n.startswith("this run was imported from compile logs") for n in rep.notes), rep.notes
    for row in rep:
        if row.status == "NO_GRAD":
            assert row.cut.kind == "detach" and row.cut.source == "ddp_trace.py:20", row.cut


def test_unused_aux_is_not_in_graph_and_predicts_the_ddp_error(store):
    rep = validate_backward(store, "unused", expected_params=NAMES)
    bad = {k: v for k, v in statuses(rep).items() if v != "OK"}
    assert bad == {(r, f"aux.{p}"): "NOT_IN_GRAPH" for r in (0, 1) for p in ("weight", "bias")}, rep.to_text()
    # A log does not say which DDP options ran (issue 24.2): both outcomes are said, neither asserted.
    assert not [f for f in rep.findings if f.kind == "DDP_UNUSED_ERROR"]
    ddp = [f for f in rep.findings if f.kind == "DDP_UNUSED_DEPENDS"]
    assert len(ddp) == 1 and ddp[0].params == ["aux.bias", "aux.weight"]
    assert "Expected to have finished reduction" in ddp[0].message and "find_unused_parameters=True" in ddp[0].message
    assert "does not say which DDP options ran" in ddp[0].message
    without = validate_backward(store, "unused")
    assert not any(r.fqn.startswith("aux.") for r in without), \
        "without the expected names, parameters no graph reads are invisible in a log"
    # ... and the report says so: never PASS (issue 17: it printed "PASS · OK 16").
    assert without.verdict == "INCOMPLETE", without.to_text()
    assert any("parameter list is incomplete" in g for g in without.gaps)


def test_unused_log_import_without_expected_names_exits_incomplete(store, tmp_path):
    """The CLI on the imported ``unused`` log (its job crashed with DDP's reduction error): exit 3,
    INCOMPLETE naming what it could not see and how to get it; --allow-incomplete exits 0."""
    from click.testing import CliRunner

    from graphdeck.cli import main as cli

    url = str(store.url)
    res = CliRunner().invoke(cli, ["check-grads", url, "--run", "unused"])
    assert res.exit_code == 3, res.output
    first = res.output.splitlines()[0]
    assert "INCOMPLETE" in first and "PASS" not in first
    assert "--expect-params" in res.output and "Agent.watch" in res.output
    res = CliRunner().invoke(cli, ["check-grads", url, "--run", "unused", "--allow-incomplete"])
    assert res.exit_code == 0, res.output
