"""One odd name never costs the run its graphs (issue 18, NOTE: [Odd names] in capture/writer.py):
a lone surrogate in a module name (SQLite's UTF-8 refuses it) and NUL in a parameter name
(PostgreSQL's text refuses it) are stored escaped, on both stores, and every graph is kept."""

from __future__ import annotations

import warnings

import torch
from sqlalchemy import text

from graphdeck import validate_backward
from graphdeck.capture import Agent
from graphdeck.store.db import open_engine


class Odd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("blk\ud800", torch.nn.Linear(4, 4))  # a lone surrogate
        self.head = torch.nn.Linear(4, 1)
        self.register_parameter("scale\x00x", torch.nn.Parameter(torch.ones(1)))  # NUL

    def forward(self, x):
        return self.head(torch.relu(getattr(self, "blk\ud800")(x))) * getattr(self, "scale\x00x")


def test_odd_names_are_escaped_and_every_graph_kept(store_url):
    torch._dynamo.reset()
    model = Odd()
    agent = Agent(store=store_url, run="odd")
    agent.watch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "could not record a graph"
        compiled = torch.compile(model, backend=agent.backend("aot_eager"))
        for _ in range(2):
            compiled(torch.randn(2, 4)).sum().backward()
    agent.close()
    with open_engine(store_url, read_only=True).connect() as c:
        kinds = sorted(k for (k,) in c.execute(text("SELECT kind FROM graphs")))
        names = {n for (n,) in c.execute(text("SELECT fqn FROM params"))}
    assert kinds == ["aot_backward", "aot_forward", "dynamo"], kinds
    assert {"blk\\ud800.weight", "blk\\ud800.bias", "scale\\x00x"} <= names, names
    rep = validate_backward(store_url, "odd")
    assert rep.verdict == "PASS", rep.to_text()
