"""Kernels by stack trace match nodes whatever installation filled the FX graph cache (issue 34:
a fresh venv's demo mapped 44% because its warm cache's stack traces named another prefix)."""

from __future__ import annotations

from types import SimpleNamespace

from graphdeck.analysis.traces.mapping import _by_stacks, _portable_stack

LINE = ', line 1024, in forward\n    hidden = self.c_fc(x)\n'


def _stack(prefix: str) -> str:
    return f'  File "{prefix}/site-packages/transformers/models/gpt2/modeling_gpt2.py"{LINE}'


def test_a_cached_kernel_from_another_installation_maps_to_its_node():
    cached = _stack("/root/.pyenv/versions/3.11.7/lib/python3.11")  # the installation that filled the cache
    live = _stack("/tmp/nc-venv/lib/python3.11")  # this run's nodes
    assert _portable_stack(cached) == _portable_stack(live)
    graph = SimpleNamespace(id=7, kind="aot_backward")
    best, rows = _by_stacks([("extern_kernels.mm:3", (cached,))], [graph], {7: [("mm", live), ("view", live)]}, set())
    assert best is graph and rows == [("extern_kernels.mm:3", ("mm",))]


def test_user_code_paths_stay_whole():
    a = '  File "/home/a/train.py", line 3, in step\n'
    assert _portable_stack(a) == a and _portable_stack(a) != _portable_stack(a.replace("/home/a", "/home/b"))
