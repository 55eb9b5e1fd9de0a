"""Measured CPU memory of one GPT-2 training step, for the memory view's known answers.

``memory_gpt2.py STORE OUT_JSON`` — GPT-2 2 layers (n_embd 128, vocab 2048, batch 4 × 64),
captured compiled with aot_eager into STORE (run "mem"); one forward+backward step profiled with
``profile_memory=True`` three ways — compiled; eager; eager with block 0 under activation
checkpointing (``torch.utils.checkpoint``, non-reentrant). OUT_JSON: each step's peak.

``memory_gpt2.py STORE OUT_JSON --checkpoint BACKEND`` — the checkpoint what-if's validation
(GPT-2 2 layers, n_embd 128, vocab 512, batch 8 × 128, so saved activations dominate the step):
the model compiled with BACKEND and captured (run "base"), one step profiled; then block 0 wrapped
in ``torch.utils.checkpoint``, recompiled, captured again (run "ckpt") and one step profiled.
OUT_JSON: ``{"base": peak, "ckpt": peak, "base_phase": ..., "ckpt_phase": ...}``.

A step's peak is the profiler's ``Total Allocated`` counter relative to its value when the
profile starts: the CPU allocator's counter runs on across profiles, and frees made while no
profiler runs (``zero_grad(set_to_none=True)`` of the previous step's gradients) are never
subtracted, so a second profile in one process starts from a leftover offset. The counter's value
before the first event is that event's ``Total Allocated`` minus its ``Bytes``. Parameters,
allocated before profiling, are not counted. The step is ``loss = model(...).loss;
loss.backward()`` — the logits are freed before the backward, as in a training loop.
"""

import json
import sys

import torch
import torch.utils.checkpoint
from torch.profiler import ProfilerActivity, profile, record_function

from graphdeck.capture import Agent
from graphdeck.demo import build_model


def step_peak(fn, trace_path: str) -> tuple[int, str]:
    """Peak allocated bytes of ``fn()`` since the profile started, and where it is
    (``forward``, or ``backward@F`` with F the fraction of the backward's time)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(trace_path)
    events = json.load(open(trace_path))["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    top = max(mem, key=lambda e: e["args"]["Total Allocated"])
    spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and e.get("name") in ("step.forward", "step.backward")}
    phase = "?"
    if "step.backward" in spans:
        b0, b1 = spans["step.backward"]
        phase = "forward" if top["ts"] < b0 else f"backward@{(top['ts'] - b0) / max(b1 - b0, 1):.2f}"
    return top["args"]["Total Allocated"] - start, phase


def training_step(model, tokens):
    def step():
        with record_function("step.forward"):
            loss = model(input_ids=tokens, labels=tokens).loss
        with record_function("step.backward"):
            loss.backward()
    return step


def checkpoint_block(model, index: int) -> None:
    block = model.transformer.h[index]
    plain_forward = block.forward
    block.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(plain_forward, *a, use_reentrant=False, **k)


def validate_checkpoint(store: str, out: str, backend: str, *, layers=2, n_embd=128, vocab=512, batch=8,
                        seq=128) -> dict:
    torch.manual_seed(0)
    model = build_model(n_layer=layers, n_embd=n_embd, vocab_size=vocab, n_positions=seq)
    tokens = torch.randint(0, vocab, (batch, seq))
    results = {}
    for run in ("base", "ckpt"):
        if run == "ckpt":
            checkpoint_block(model, 0)
            torch._dynamo.reset()
        agent = Agent(store=store, run=run)
        agent.watch(model)
        compiled = torch.compile(model, backend=agent.backend(backend))
        training_step(compiled, tokens)()  # compile (captured)
        agent.close()
        model.zero_grad(set_to_none=True)
        results[run], results[f"{run}_phase"] = step_peak(training_step(compiled, tokens), f"{out}.{run}.trace.json")
        model.zero_grad(set_to_none=True)
    json.dump(results, open(out, "w"))
    return results


def main() -> None:
    store, out = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 4 and sys.argv[3] == "--checkpoint":
        validate_checkpoint(store, out, sys.argv[4])
        return
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
        results[name] = step_peak(run(m), f"{out}.{name}.trace.json")[0]
    checkpoint_block(model, 0)
    model.zero_grad(set_to_none=True)
    results["eager_checkpoint_block0"] = step_peak(run(model), f"{out}.eager_checkpoint_block0.trace.json")[0]
    json.dump(results, open(out, "w"))


if __name__ == "__main__":
    main()
