"""The framework integrations' own helpers (graphdeck.integrations, issue 39 item 2); the
callbacks themselves run for real in tests/test_frameworks.py (HF Trainer and Lightning on 2 gloo
ranks, one launch each)."""

from __future__ import annotations

import pytest
import torch

from graphdeck.errors import UsageError
from graphdeck.integrations import inner_backend, profile_window


def test_profile_window_profiles_the_named_steps():
    # steps A..B numbered from 0, one warm-up step before A when there is one
    assert profile_window("2:2") == {"wait_steps": 1, "warmup_steps": 1, "active_steps": 1}
    assert profile_window((0, 1)) == {"wait_steps": 0, "warmup_steps": 0, "active_steps": 2}
    assert profile_window("5:7") == {"wait_steps": 4, "warmup_steps": 1, "active_steps": 3}
    assert profile_window(None) is None
    for bad in ("3", "3:1", "a:b", "-1:2"):
        with pytest.raises(UsageError):
            profile_window(bad)


def test_inner_backend_is_the_backend_the_compile_named(tmp_path):
    """What the callbacks wrap with the agent's backend: the name the user gave, Inductor's own
    wrapper when a mode configured it, None when the compile already goes through graphdeck."""
    from graphdeck.capture import Agent

    lin = torch.nn.Linear(2, 2)

    def named(**kw):  # torch.compile is lazy: nothing compiles here
        return inner_backend(torch.compile(lin, **kw).dynamo_ctx.callback)

    def custom(gm, example_inputs):
        return gm

    assert named(backend="aot_eager") == "aot_eager"
    assert named() == "inductor" and named(backend="inductor") == "inductor"
    configured = named(backend="inductor", mode="max-autotune-no-cudagraphs")
    assert type(configured).__name__ == "_TorchCompileInductorWrapper" and configured.config
    assert named(backend=custom) is custom
    assert named(backend="graphdeck") is None
    agent = Agent(store=tmp_path / "s.db", run="r")
    try:
        assert named(backend=agent.backend("aot_eager")) is None
    finally:
        agent.close()
