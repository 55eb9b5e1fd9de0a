"""2 gloo ranks on CPU under torch's debug server with a periodic dump folder (issue 38 item 1:
the folder as an import source; NOTE: [Debug-server dumps] in store/debug_dumps.py)::

    torchrun --standalone --nproc-per-node 2 tests/debug_server_job.py DUMP_DIR RELEASE PORT

``start_debug_server(dump_dir=DUMP_DIR, dump_interval=1)`` with the stacks and Flight Recorder
dumps; after one all-reduce on group ``grads``, rank 1 waits until the file RELEASE exists while
rank 0 waits in the next all-reduce (a hang the test releases). The Flight Recorder is on.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    dump_dir, release, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    from torch.distributed.debug import start_debug_server, stop_debug_server

    start_debug_server(port=port, dump_dir=dump_dir, dump_interval=1.0, enabled_dumps={"stacks", "fr_trace"})
    grads = dist.new_group([0, 1], group_desc="grads")
    t = torch.ones(8)
    dist.all_reduce(t, group=grads)
    deadline = time.time() + 120
    while rank == 1 and not os.path.exists(release) and time.time() < deadline:
        time.sleep(0.1)  # RANK1_WAITS
    dist.all_reduce(t, group=grads)  # RANK0_WAITS
    dist.barrier()
    if rank == 0:
        stop_debug_server()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
