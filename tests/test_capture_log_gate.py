"""The capture makes torch build only the structured records it keeps (NOTE: [Only the kept
records are built]), and a user's own trace listener still gets every record."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from sqlalchemy import select
from sqlalchemy.orm import Session
from torch._logging._internal import trace_log, trace_structured

from graphdeck.capture import Agent
from graphdeck.capture.compile_log import KEPT_COMPILE_EVENTS
from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent


class _Built:
    """Counts the payloads torch builds, by record name."""

    def __init__(self):
        self.names: list[str] = []

    def payload(self, name):
        def build():
            self.names.append(name)
            return f"payload of {name}"
        return build


def _emit(built: _Built) -> None:
    trace_structured("dynamo_output_graph", payload_fn=built.payload("dynamo_output_graph"),
                     expect_trace_id=False)
    trace_structured("artifact", metadata_fn=lambda: {"name": "fx_graph_runnable", "encoding": "string"},
                     payload_fn=built.payload("fx_graph_runnable"), expect_trace_id=False)
    trace_structured("artifact", metadata_fn=lambda: {"name": "inductor_output_code", "encoding": "string"},
                     payload_fn=built.payload("inductor_output_code"), expect_trace_id=False)
    trace_structured("recompile_reasons", payload_fn=built.payload("recompile_reasons"), expect_trace_id=False)


class LazyTraceHandler(logging.Handler):
    """As torch's handler of that name without a trace folder: it removes itself from the
    trace log at its first record (while the log walks its handler list)."""

    root_dir = None
    stream = None

    def emit(self, record):
        trace_log.removeHandler(self)


def test_only_kept_records_are_built_and_a_users_listener_gets_all(tmp_path):
    assert "dynamo_output_graph" not in KEPT_COMPILE_EVENTS and "fx_graph_runnable" not in KEPT_COMPILE_EVENTS
    lazy = LazyTraceHandler()  # a fresh process's state: the lazy handler is still there
    trace_log.addHandler(lazy)
    before = list(trace_log.handlers)
    agent = Agent(store=tmp_path / "s.db", run="gate")
    try:
        built = _Built()
        _emit(built)
        # kept records are built (and kept), the rest are not formatted at all
        assert built.names == ["inductor_output_code", "recompile_reasons"]

        # a user's own listener (TORCH_TRACE, a test handler) sees every record, as without graphdeck
        got: list[logging.LogRecord] = []

        class Listener(logging.Handler):
            def emit(self, record):
                got.append(record)

        mine = Listener()
        trace_log.addHandler(mine)
        try:
            built = _Built()
            _emit(built)
            assert built.names == ["dynamo_output_graph", "fx_graph_runnable", "inductor_output_code",
                                   "recompile_reasons"]
            assert len(got) == 4
        finally:
            trace_log.removeHandler(mine)
        # other callers testing the list (torch's partitioner on a failed min-cut) see the truth
        assert bool(trace_log.handlers) is True
    finally:
        agent.close()
    # a plain list again, without graphdeck's handler (torch's lazy handler may have gone: it
    # removes itself at its first record when no trace folder is set)
    assert type(trace_log.handlers) is list
    assert [h for h in trace_log.handlers if h not in before] == [] and lazy not in trace_log.handlers
    with Session(open_engine(tmp_path / "s.db", read_only=True)) as s:
        kept = sorted(s.scalars(select(CompileEvent.name)))
    assert "graphdeck_output_code" in kept and kept.count("recompile_reasons") == 2, kept


def test_a_real_compile_keeps_its_records_while_torch_builds_no_other(tmp_path):
    """A real compile through the gate still stores what the analysis reads (compile metrics,
    dynamo_start), and no record the agent does not keep reaches torch's trace log."""
    torch._dynamo.reset()
    store = tmp_path / "s.db"
    agent = Agent(store=store, run="real")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    agent.watch(model)
    compiled = torch.compile(model, backend=agent.backend("aot_eager"))
    logged: list[str] = []
    real_debug = trace_log.debug

    def counting(msg, *args, extra=None, **kw):
        meta = (extra or {}).get("metadata") or {}
        art = meta.get("artifact")
        logged.append(art.get("name") if isinstance(art, dict) else next(iter(meta), "?"))
        return real_debug(msg, *args, extra=extra, **kw)

    trace_log.debug = counting
    try:
        compiled(torch.randn(4, 8)).sum().backward()
    finally:
        del trace_log.debug
        agent.close()
        torch._dynamo.reset()
    with Session(open_engine(store, read_only=True)) as s:
        names = set(s.scalars(select(CompileEvent.name)))
    assert {"dynamo_start", "compilation_metrics"} <= names, names
    assert logged and set(logged) <= KEPT_COMPILE_EVENTS, sorted(set(logged) - KEPT_COMPILE_EVENTS)


def test_a_closed_agent_stops_listening_and_dumping(tmp_path):
    """After close(), torch's trace log is plain again and a later exception, SIGTERM or exit in
    the same process dumps no Flight Recorder state into the closed agent's run."""
    from graphdeck.capture import flight

    agent = Agent(store=tmp_path / "s.db", run="closed")
    fd = agent._flight
    assert fd is None or fd in flight._LIVE
    agent.close()
    assert fd is None or fd not in flight._LIVE
    assert not any(type(h).__name__ == "_CompileEventHandler" for h in trace_log.handlers)
