"""Issue 40 item 4 (newcomer report): an explicit ``torch._dynamo.graph_break()`` is classified as
such by ``check-compile``, not as a ``[scalar output]`` break with an ``.item()`` hint (the user
code traceback's source line held ``loss.item()``: the class was read from the user's code, not
the reason); and the recomputation advice says where to put the break (not inside a loop).

Input: a real CPU job (``aot_eager`` through the capture agent), a graph break inside the loop
over the traversals as the newcomer wrote it, the model called on a line that prints ``.item()``.
"""

from __future__ import annotations

import subprocess
import sys

from graphdeck.analysis.compilation.rules import BREAK_HINTS

JOB = r"""
import sys, torch
from graphdeck.capture import Agent

class Net(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    def forward(s, x):
        for t in range(2):
            if t == 1: torch._dynamo.graph_break()
            for b in s.blocks:
                x = torch.relu(b(x))
        return x

agent = Agent(store=sys.argv[1], run="gb")
m = agent.watch(Net())
cm = torch.compile(m, backend=agent.backend("aot_eager"))
for i in range(2):
    loss = cm(torch.randn(4, 8)).sum(); loss.backward(); print(i, loss.item())
agent.close()
"""


def test_explicit_graph_break_is_classified_as_such(tmp_path):
    store, job = tmp_path / "gb.db", tmp_path / "job.py"
    job.write_text(JOB)  # a file: the break is in user code and its traceback shows the source lines
    made = subprocess.run([sys.executable, str(job), str(store)], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-compile", str(store), "--run", "gb"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 1, 3), out.stderr
    assert "[explicit graph_break()" in out.stdout, out.stdout
    assert "[scalar output" not in out.stdout and "capture_scalar_outputs" not in out.stdout, out.stdout
    assert "inside a loop" in BREAK_HINTS["explicit graph_break()"]
