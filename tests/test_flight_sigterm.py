"""NOTE: [A SIGTERM during a dump] (capture/flight.py): torchrun's SIGTERM landing while a rank's
agent is writing its Flight Recorder dump (the excepthook's, after a collective failed), or inside
any store write transaction on the main thread, neither deadlocks on the lock the interrupted
write holds nor loses what it was writing: the interrupted write finishes, then the rank dies by
that SIGTERM. Real processes (one gloo rank for the dump); the signal is sent from inside the
write (the seams: ``flight.dump_now``, SQLAlchemy's ``after_begin`` event), so it lands there
every time."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Run
from tests.conftest import REPO

JOB = r"""
import os, signal, sys, datetime, torch, torch.distributed as dist
from graphdeck.capture import Agent, flight
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[2],
                        timeout=datetime.timedelta(seconds=30))
agent = Agent(store=sys.argv[1], run="term")
group = dist.new_group([0], group_desc="sync")
dist.all_reduce(torch.ones(4), group=group)
real = flight.dump_now
def dump_now():  # torchrun's SIGTERM arrives while the excepthook's dump is being taken
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10_000):  # bytecodes: Python runs the handler here
        pass
    print("dump continues", flush=True)
    return real()
flight.dump_now = dump_now
raise RuntimeError("a collective failed")
"""


def test_sigterm_during_the_exception_dump_keeps_it_and_ends_the_rank(tmp_path):
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-c", JOB, str(store), str(tmp_path / "rdv")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert "dump continues" in proc.stdout, "the handler returned into the interrupted dump"
    with Session(open_engine(store, read_only=True)) as s:
        reasons = [json.loads(m)["reason"] for m in s.scalars(
            select(CompileEvent.metadata_json).where(CompileEvent.name == "flight_recorder"))]
    assert reasons and reasons[0] == "exception", reasons


WRITE_JOB = r"""
import os, signal, sys, torch
from sqlalchemy import event
from sqlalchemy.orm import Session
from graphdeck.capture import Agent
agent = Agent(store=sys.argv[1], run="term-write")
model = agent.watch(torch.nn.Linear(4, 4))
sent = []
@event.listens_for(Session, "after_begin")
def term_inside(session, transaction, connection):  # the first write transaction of the compile
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):
            pass
        print("write continues", flush=True)
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
compiled(torch.randn(2, 4)).sum().backward()
print("not reached", flush=True)
"""


def test_sigterm_inside_a_store_write_keeps_it_and_what_was_being_flushed(tmp_path):
    """The same for a store write transaction on the main thread (here the compile's first
    record, which registers the run): before, the handler's flush began another write behind the
    interrupted one's lock and the store kept nothing of the run; now the interrupted write and
    the records it was flushing are kept, then the rank dies by SIGTERM."""
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-c", WRITE_JOB, str(store)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert "write continues" in proc.stdout and "not reached" not in proc.stdout, proc.stdout
    with Session(open_engine(store, read_only=True)) as s:
        runs = s.scalars(select(Run.name)).all()
        events = s.scalars(select(CompileEvent.name)).all()
    assert runs == ["term-write"] and events, (runs, events)


def test_ctrl_c_inside_a_store_write_loses_no_compile_record(tmp_path):
    """Ctrl-C (KeyboardInterrupt) raised inside the flush of torch's compile records on the
    compiling thread (the store write itself runs on the graphdeck-writer thread, where no signal
    lands: NOTE: [Writes off the compiling thread]; the Ctrl-C lands while the records are handed
    to it): the records go back to the buffer, and the exit flush writes them."""
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-c", CTRL_C_JOB, str(store)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "KeyboardInterrupt" in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    lost = Counter(next(line for line in proc.stdout.splitlines() if line.startswith("interrupted:")).split()[1:])
    with Session(open_engine(store, read_only=True)) as s:
        kept = Counter(s.scalars(select(CompileEvent.name)).all())
    assert lost and not lost - kept, (lost, kept)


CTRL_C_JOB = r"""
import sys, torch
from graphdeck.capture import Agent
from graphdeck.capture.writer_thread import BackgroundWriter
agent = Agent(store=sys.argv[1], run="ctrl-c")
model = agent.watch(torch.nn.Linear(4, 4))
real, first = BackgroundWriter.write_compile_events, []
def write_compile_events(self, events):  # Ctrl-C lands in the first flush of torch's compile records
    if not first and all(e["name"] != "graphdeck_watch" for e in events):  # (the agent's own record: direct)
        first.extend(e["name"] for e in events)
        print("interrupted:", *first, flush=True)
        raise KeyboardInterrupt
    return real(self, events)
BackgroundWriter.write_compile_events = write_compile_events
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
compiled(torch.randn(2, 4)).sum().backward()
"""


CLOSE_JOB = r"""
import os, signal, sys, torch
from graphdeck.capture import Agent
from graphdeck.capture.grad_evidence import GradEvidence
agent = Agent(store=sys.argv[1], run="term-close")
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.temp = torch.nn.Parameter(torch.ones(()))
m = M()
agent.watch(m)
f = torch.compile(m.lin, backend=agent.backend("aot_eager"))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
real, at = GradEvidence._state, [0]
def state(self, w):  # SIGTERM lands while step 3's backward is being judged
    if at[0] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):
            pass
        print("close continues", flush=True)
    return real(self, w)
GradEvidence._state = state
for step in range(6):
    at[0] = step
    loss = f(torch.randn(2, 4)).sum()
    (loss * m.temp if step != 3 else loss).backward()  # temp gets no gradient at step 3
    opt.step()
    opt.zero_grad()
print("not reached", flush=True)
"""


def test_sigterm_while_a_backward_is_judged_keeps_that_steps_row(tmp_path):
    """A SIGTERM landing while the gradient evidence judges a backward (on a CPU, the main
    thread, at the backward's end): before, the handler's flush found the window already taken
    and step 3's row (temp got no gradient) was lost; now it waits for the row, then the rank dies."""
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-c", CLOSE_JOB, str(store)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert "close continues" in proc.stdout and "not reached" not in proc.stdout, proc.stdout
    with open_engine(store, read_only=True).connect() as c:
        rows = c.execute(text("SELECT step_first, step_last, state_json FROM grad_steps ORDER BY id")).all()
    three = [json.loads(s) for first, _last, s in rows if first == 3]
    assert three and three[0]["none"] == ["temp"], rows
