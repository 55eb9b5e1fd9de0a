"""Issue 40 item 1: the loss code's branch that skipped a model output is named (NOTE: [The branch
that skipped an output] in capture/grad_branch.py). One real single-process job
(tests/grad_branch_job.py): compiled (aot_eager) and eager, the branch in a helper of the loss, an
``if not ...: continue`` in a per-sample loop, a dict output behind an earlier unrelated branch.
The 2-rank DDP form is asserted in tests/test_gradients_evidence.py (its shared torchrun job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphdeck import validate_backward
from tests.conftest import REPO
from tests.launch import run_python_job

JOB = REPO / "tests" / "grad_branch_job.py"


def _line(text: str) -> int:
    return next(i for i, s in enumerate(JOB.read_text().splitlines(), 1) if s.strip() == text)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    db = tmp_path_factory.mktemp("branch") / "branch.db"
    proc = run_python_job([JOB, db], env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return db


CASES = {
    "compiled_helper": ("DEAD_END", "box_term", "if fg_mask.sum():"),
    "eager_helper": ("NO_GRAD", "box_term", "if fg_mask.sum():"),
    "compiled_continue": ("DEAD_END", "per_sample_loss", "if not labels[i] > 0:"),
    "eager_continue": ("NO_GRAD", "per_sample_loss", "if not labels[i] > 0:"),
    "eager_dict": ("NO_GRAD", "dict_loss", "if fg.any():"),
}


def test_the_branch_that_skipped_the_output_is_named(store):
    for run, (status, fn, text) in CASES.items():
        rep = validate_backward(store, run)
        assert rep.verdict == "FAIL", (run, rep.to_text())
        bad = {r.fqn: r for r in rep if r.status != "OK"}
        assert set(bad) == {"box_head.weight", "box_head.bias"}, (run, rep.to_text())
        shown = f"{text} continue" if text.endswith("> 0:") else text
        want = f"the loss code skipped it at the branch {JOB}:{_line(text)} in {fn}: `{shown}`"
        for r in bad.values():
            assert r.status == status and "step(s) 1" in r.reason, (run, r.reason)
            assert want in r.reason, (run, r.reason)
        # The same sentence in the CLI's text and JSON (one verdict, shown the same).
        out = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-grads", str(store), "--run", run,
                              "--json"], capture_output=True, text=True)
        assert out.returncode == 1, out.stderr
        assert want.replace("`", "") in json.dumps(json.loads(out.stdout)).replace("`", ""), out.stdout[:2000]
