"""``torch.compile(DDP(nn.Sequential(...)))`` compiles nothing (NOTE: [No graph produced]): check-compile
says so (WARN; FAIL under --fail-on-eager-fallback), and the other checks tell the truth about a
CPU job that ran eagerly. One real 2-rank gloo job (aot_eager) and its compiled control, run together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphdeck.cli import main as cli
from tests.launch import Ranks, wait_all

JOB = Path(__file__).with_name("no_graph_job.py")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no_graph")
    seq, own = tmp / "seq.db", tmp / "own.db"
    done = wait_all({"seq": Ranks([JOB, seq, "seq"], 2), "own": Ranks([JOB, own, "own", "own"], 2)}, timeout=600)
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name}: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return seq, own


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow
def test_check_compile_says_no_graph_was_produced(stores):
    seq, own = stores
    res = _cli("check-compile", seq, "--run", "seq")
    assert res.exit_code == 0, res.output  # WARN: a report, exit 0
    first, warn = res.output.splitlines()[:2]
    assert first.startswith("check-compile seq: WARN"), res.output
    assert warn.startswith("WARN: no graph produced: the compiled function called at no_graph_job.py:"), warn
    assert "ran eagerly on ranks [0, 1]" in warn and "nothing is compiled and the job runs eager" in warn
    # the reasons: Dynamo's own rule for the model's forward, and what torch recorded about DDP's forward
    assert "torch.nn.modules.container.Sequential.forward (container.py), is skipped by Dynamo as a frame of " \
           "its own (file matches MOD_SKIPLIST (torch/nn))" in warn, warn
    assert "DistributedDataParallel._inside_ddp_forward" in warn and "skip reason: file matches MOD_SKIPLIST" in warn
    assert "hint: compile the model DDP wraps rather than the wrapper (DDP(torch.compile(model)))" in res.output
    res = _cli("check-compile", seq, "--run", "seq", "--fail-on-eager-fallback")
    assert res.exit_code == 1 and res.output.startswith("check-compile seq: FAIL\nFAIL: no graph produced"), res.output
    data = json.loads(_cli("check-compile", seq, "--run", "seq", "--format", "json").output)
    assert data["verdict"] == "WARN" and data["summary"]["no_graph_ranks"] == [0, 1]
    assert data["no_graph"]["models"][0]["model"] == "torch.nn.modules.container.Sequential"
    # the control: the same layers under a forward of the job's own are compiled, and no such finding
    res = _cli("check-compile", own, "--run", "own")
    assert res.exit_code == 0 and "no graph produced" not in res.output, res.output
    assert json.loads(_cli("check-compile", own, "--run", "own", "--format", "json").output)["no_graph"] is None


@pytest.mark.slow
def test_summary_and_check_grads_tell_the_truth(stores):
    seq, own = stores
    res = _cli("summary", seq, "--run", "seq")
    assert res.exit_code == 0, res.output  # WARN, nothing missing or failing
    assert res.output.startswith("graphdeck summary seq in "), res.output
    assert ": WARN\n" in res.output
    assert "GPU" not in res.output, res.output  # a CPU job: nothing here is a GPU
    lines = {ln.split()[1]: ln for ln in res.output.splitlines() if ln[:1].isupper() and len(ln.split()) > 1}
    assert lines["compile"].startswith("WARN") and "no graph produced on ranks [0, 1]" in lines["compile"]
    assert lines["traces"].startswith("N/A") and "nothing compiled to map: no rank produced a graph, so the 2 CPU " \
                                                  "trace(s) hold only eager work" in lines["traces"], lines["traces"]
    res = _cli("check-grads", seq, "--run", "seq")
    assert res.exit_code == 0 and res.output.startswith("gradient paths of seq (eager mode), ranks [0, 1]: PASS")
    assert "note: no compiled graph in this run: the job ran eagerly" in res.output
    # the control keeps graph mode and a mapped trace
    res = _cli("check-grads", own, "--run", "own")
    assert res.output.startswith("gradient paths of own (graph mode)"), res.output
    res = _cli("summary", own, "--run", "own")
    assert "no graph produced" not in res.output and "nothing compiled to map" not in res.output, res.output


@pytest.mark.slow
def test_durations_under_a_second_read_in_human_units(stores):
    """The straggler note of this job said "waited 0.00 s" for a wait of milliseconds, and the
    compile-time spread "0.00 s" (NOTE: [Human durations]): no text rounds a duration to zero."""
    import re

    seq, _own = stores
    for args in (("check-ranks", seq, "--run", "seq"), ("check-compile", seq, "--run", "seq"),
                 ("summary", seq, "--run", "seq")):
        out = _cli(*args).output
        assert not re.search(r"(?<![\d.])0\.0+ (s|ms)\b", out), (args[0], out)
