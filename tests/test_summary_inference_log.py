"""Issue 40 item 5 (newcomer report): ``summary`` on an inference-only TORCH_TRACE log (a model
compiled and run under ``torch.no_grad()``, no backward anywhere) says gradient paths are not
applicable (N/A) instead of FAIL with NO_GRAD for every parameter.

Input: a real job made here (``aot_eager``, CPU, ``TORCH_TRACE`` set), imported with the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys

JOB = r"""
import torch
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
cm = torch.compile(m, backend="aot_eager")
with torch.no_grad():
    for _ in range(2):
        cm(torch.randn(4, 8))
print("ok")
"""


def test_summary_of_an_inference_only_log_is_not_a_gradient_fail(tmp_path):
    env = dict(os.environ, TORCH_TRACE=str(tmp_path / "trace"))
    (tmp_path / "job.py").write_text(JOB)
    made = subprocess.run([sys.executable, str(tmp_path / "job.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    store = tmp_path / "s.db"
    cli = [sys.executable, "-m", "graphdeck.cli"]
    imp = subprocess.run([*cli, "import", str(tmp_path / "trace"), "--store", str(store), "--run", "inf",
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert imp.returncode == 0, imp.stderr
    out = subprocess.run([*cli, "summary", str(store), "--run", "inf"], capture_output=True, text=True, timeout=300)
    grads = next(ln for ln in out.stdout.splitlines() if " gradients " in ln)
    assert grads.startswith("N/A") and "no backward in this run" in grads, out.stdout
    assert "FAIL" not in out.stdout.splitlines()[0], out.stdout
