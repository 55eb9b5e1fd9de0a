"""Both Flight Recorder hang cases in one torchrun job (2 gloo ranks, CPU, 3 s collective timeout),
captured by the graphdeck agent as run ``hangs``:

    torchrun --standalone --nproc-per-node 2 tests/flight_job.py STORE DUMP_DIR

1. **branch** (groups ``loss_sync``/``grad_sync``): a compiled forward, then Python code that
   all-reduces the loss only when it is positive; at step 2 rank 1's data makes it negative, so
   rank 1 issues one collective fewer and goes on to the grad all-reduce: both ranks time out.
   The script catches that timeout (as a trainer that retries would) and goes on.
2. **recompile** (groups ``mlp``/``opt_sync``): a compiled step whose graph all-reduces its
   activations when the batch is even; at step 2 rank 1's batch has 5 rows, so rank 1 recompiles
   into a graph without the all-reduce: both ranks time out, uncaught — the job fails, and the
   agent dumps the recorder into the store on the exception.

Compile skew before the first timed collective is waited out on the default group (long
timeout); torchrun's SIGTERM during case 2 waits until the rank's raw dumps are written.
Each rank also writes its raw dump to ``DUMP_DIR`` (rank 0 as ``fr_dump_0``, a pickle; rank 1 as
a pickle ``fr_dump_1`` and as JSON ``rank1-trace.json.1``) before re-raising.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdeck.capture import Agent  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=3)


def write_raw(out: str, rank: int) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"fr_dump_{rank}"), "wb") as fh:
        fh.write(torch._C._distributed_c10d._dump_fr_trace())
    if rank == 1:
        with open(os.path.join(out, "rank1-trace.json.1"), "wb") as fh:
            fh.write(torch._C._distributed_c10d._dump_fr_trace_json())


def main() -> None:
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # only the named groups hang
    agent = Agent(store=store, run="hangs")  # turns the recorder on (TORCH_FR_BUFFER_SIZE unset)
    rank = dist.get_rank()
    loss_sync = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="loss_sync")
    grad_sync = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="grad_sync")
    mlp_group = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="mlp")
    opt_sync = dist.new_group([0, 1], timeout=TIMEOUT, group_desc="opt_sync")
    torch.manual_seed(0)

    # ---- case 1: a data-dependent branch in Python issues one collective fewer on rank 1
    net = torch.nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        net.weight.abs_()
    agent.watch(net)
    fwd = torch.compile(net, backend=agent.backend("aot_eager"))
    fwd(torch.ones(4, 8))  # compiled before the first timed collective: a loaded machine's compile skew
    dist.barrier()  # is not a hang (default group, long timeout)
    try:
        for step in range(4):
            sign = -1.0 if (rank == 1 and step == 2) else 1.0
            loss = fwd(torch.full((4, 8), sign)).sum()
            if loss.item() > 0:  # BRANCH: only ranks whose loss is positive log it
                dist.all_reduce(loss.detach().clone(), group=loss_sync)
            dist.all_reduce(net.weight.detach().clone(), group=grad_sync)
    except RuntimeError as exc:
        print(f"rank {rank}: case 1 timed out: {str(exc)[:120]}", flush=True)

    # ---- case 2: rank 1 recompiles into a graph without the all-reduce
    w = torch.ones(8, 8)

    def mlp_step(x):
        y = torch.relu(x @ w)
        if y.shape[0] % 2 == 0:  # static shapes: an odd batch recompiles into a graph without it
            y = funcol.all_reduce(y, "sum", mlp_group)  # MLP_ALL_REDUCE
        return y.sum()

    step_fn = torch.compile(mlp_step, backend=agent.backend("aot_eager"), dynamic=False)
    dist.barrier()  # both ranks out of case 1's timeouts
    # torchrun's SIGTERM (sent once the other rank has failed) waits until this rank's raw dumps
    # are written, then goes to the agent's handler, which dumps into the store and ends the rank.
    deferred: list = []
    agent_term = signal.signal(signal.SIGTERM, lambda *_: deferred.append(1))
    try:
        for step in range(4):
            rows = 5 if (rank == 1 and step == 2) else 4
            total = step_fn(torch.ones(rows, 8))
            dist.all_reduce(total.reshape(1).clone(), group=opt_sync)
    except RuntimeError:
        write_raw(out, rank)
        raise
    finally:
        signal.signal(signal.SIGTERM, agent_term)
        if deferred:
            os.kill(os.getpid(), signal.SIGTERM)
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
