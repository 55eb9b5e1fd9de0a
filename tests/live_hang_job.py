"""A job that hangs while graphdeck watches it (issue 38 item 1): 2 gloo ranks on CPU, a tiny
compiled model (aot_eager) with an optimizer, a 15 s collective timeout; at step 2 rank 1 sleeps
40 s inside its step, before the step's gradient all-reduce, so rank 0 waits in that all-reduce
until gloo's timeout ends it. Captured as run ``live`` with a 1 s heartbeat and a 4 s watch
threshold (set by the test's environment)::

    torchrun --standalone --nproc-per-node 2 tests/live_hang_job.py STORE OUT_DIR [GATE]

With GATE (a file path), both ranks wait after step 0 until that file exists (at most 120 s),
outside any collective: a watcher sees the job running at step 1 before it hangs. The sleeping
line's comment is markup (the dashboard must show it as text). Each rank writes
``OUT_DIR/rank<r>.json`` as it goes: the wall time it issued each step's all-reduce and, on
rank 0, the time the timeout error reached it (``timeout_at``) and its text.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=15)


def train_step(model, opt, x, rank: int, step: int, group) -> None:
    loss = model(x).sum()
    loss.backward()
    if rank == 1 and step == 2:
        time.sleep(40)  # SLEEPING_FRAME <img src=x onerror="window.__pwned=1">
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)  # GRAD_ALL_REDUCE
    opt.step()
    opt.zero_grad()


def wait_for(gate: str | None) -> None:
    """Until ``gate`` exists (at most 120 s): between two steps, no collective in flight."""
    deadline = time.time() + 120
    while gate and not os.path.exists(gate) and time.time() < deadline:
        time.sleep(0.1)


def main() -> None:
    store, out = sys.argv[1], sys.argv[2]
    gate = sys.argv[3] if len(sys.argv) > 3 else None
    os.makedirs(out, exist_ok=True)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    agent = Agent(store=store, run="live")
    grads = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="grads")
    torch.manual_seed(0)
    net = agent.watch(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    model = torch.compile(net, backend=agent.backend("aot_eager"))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model(torch.ones(4, 8))  # compiled before the first timed collective (a loaded machine's compile skew)
    dist.barrier()
    record: dict = {"rank": rank, "issued": {}}

    def save():
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(record, fh)

    try:
        for step in range(5):
            if step == 1:
                wait_for(gate)
            record["issued"][step] = time.time()
            save()
            train_step(model, opt, torch.ones(4, 8), rank, step, grads)
    except RuntimeError as exc:
        record["timeout_at"], record["error"] = time.time(), str(exc)[:300]
        save()
        raise
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
