"""DDP's gradient buckets as graphdeck records them, against the reducer's own buckets.

Run as ``python tests/programs/ddp_buckets.py`` (one gloo process): for DDP with and without
``find_unused_parameters`` (rebuilt buckets vs the initial ones, which that flag keeps), trains
3 steps and prints one JSON line per case: ``{"find_unused", "recorded": [[fqn, ...], ...],
"reducer": [[fqn, ...], ...]}`` (the reducer's buckets via ``_get_zeros_like_grad_buckets``).
"""

import json
import os

import torch
import torch.distributed as dist

from graphdeck.capture.comm_groups import ddp_buckets


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo", rank=0, world_size=1)
    for find_unused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 200),
                                    *[torch.nn.Linear(200, 200) for _ in range(5)])
        model[1].weight.requires_grad_(False)  # not in the reducer's list
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.3, find_unused_parameters=find_unused)
        for _ in range(3):
            ddp(torch.randn(4, 300)).sum().backward()
        name = {id(p): n for n, p in model.named_parameters()}
        reducer = [[name[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]
        recorded = [b["params"] for b in ddp_buckets(ddp) or []]
        print(json.dumps({"find_unused": find_unused, "recorded": recorded, "reducer": reducer}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
