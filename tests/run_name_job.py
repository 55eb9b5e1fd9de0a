"""A tiny captured job for tests/test_capture_run_names.py: ``Agent(store, RUN)`` records a watched
model's parameters on each rank (gloo when WORLD_SIZE > 1) and closes; prints the run it wrote
(``rank R wrote RUN``).

    python tests/run_name_job.py STORE RUN          (under tests/launch.py run_ranks, or alone)
"""

from __future__ import annotations

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # as the other jobs

from graphdeck.capture import Agent  # noqa: E402


def main() -> None:
    store, run = sys.argv[1], sys.argv[2]
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if multi:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    agent = Agent(store=store, run=run)
    agent.watch(torch.nn.Linear(2, 2))
    agent.writer  # noqa: B018 - open the store: the run is claimed here
    print(f"rank {os.environ.get('RANK', '0')} wrote {agent.run}", flush=True)
    agent.close()
    if multi:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
