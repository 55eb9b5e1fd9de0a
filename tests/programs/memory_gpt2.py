"""Measured CPU memory of one GPT-2 (2 layers) training step, for the memory view's known answers.

argv: STORE OUT_JSON. Captures the model compiled with aot_eager into STORE (run "mem"), then
profiles one forward+backward step with ``profile_memory=True`` three ways — compiled; eager;
eager with block 0 under activation checkpointing (``torch.utils.checkpoint``, non-reentrant) —
and writes each step's peak of the profiler's ``Total Allocated`` (bytes allocated since the
profiler started: the step's own allocations, parameters excluded) to OUT_JSON.
"""

import json
import sys

import torch
import torch.utils.checkpoint
from torch.profiler import ProfilerActivity, profile

from graphdeck.capture import Agent
from graphdeck.demo import build_model


def step_peak_bytes(fn, name: str) -> int:
    """Peak ``Total Allocated`` of one step; its Kineto trace is kept as OUT_JSON.<name>.trace.json."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = f"{sys.argv[2]}.{name}.trace.json"
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def main() -> None:
    store, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    agent = Agent(store=store, run="mem")
    model = agent.watch(build_model(n_layer=2, n_embd=128, vocab_size=2048, n_positions=64))
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    tokens = torch.randint(0, 2048, (4, 64))

    def run(m):
        def step():
            m(input_ids=tokens, labels=tokens).loss.backward()
        return step

    run(compiled)()  # compile (captured)
    agent.close()
    results = {}
    for name, m in (("compiled", compiled), ("eager", model)):
        model.zero_grad(set_to_none=True)
        results[name] = step_peak_bytes(run(m), name)
    block = model.transformer.h[0]
    plain_forward = block.forward
    block.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(plain_forward, *a, use_reentrant=False, **k)
    model.zero_grad(set_to_none=True)
    results["eager_checkpoint_block0"] = step_peak_bytes(run(model), "eager_checkpoint_block0")
    json.dump(results, open(out, "w"))


if __name__ == "__main__":
    main()
