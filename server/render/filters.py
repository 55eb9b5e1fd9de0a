"""``filter_by_op``: which nodes match op patterns, and which lie on a path between matches.

A pattern is a Python regular expression that must match *all* of a node's short op name
(``mm``, ``all_reduce``), its full target (``aten.mm.default``) or its FX name: ``mm`` keeps
``mm`` nodes but not ``addmm``; ``.*mm`` keeps both; ``all_reduce|wait_tensor`` keeps both ops.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable

from graphdeck.errors import UsageError
from graphdeck.server.views import GraphView, short_target

#: Longest pattern accepted (a guard against pathological input, not a limit anyone meets).
MAX_PATTERN_CHARS = 500


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern]:
    """Compile ``patterns`` (empty strings skipped).

    Raises:
        UsageError: a pattern is not a valid regular expression or is too long (HTTP 400);
            the message names the pattern and the regex error.
    """
    out = []
    for text in patterns:
        if not text:
            continue
        if len(text) > MAX_PATTERN_CHARS:
            raise UsageError(f"filter_by_op pattern is {len(text)} characters (limit {MAX_PATTERN_CHARS})")
        try:
            out.append(re.compile(text))
        except re.error as exc:
            raise UsageError(f"filter_by_op {text!r} is not a valid regular expression: {exc}") from exc
    return out


def filter_nodes(view: GraphView, patterns: list[re.Pattern]) -> tuple[set[str], set[str]]:
    """``(matched, on_path)``: node ids matching any pattern, and the other node ids on a directed
    path from one match to another (reachable from a match and reaching a match). O(nodes + edges)."""
    if not patterns:
        return set(), set()
    matched = {n.id for n in view.nodes
               if any(p.fullmatch(short_target(n.target)) or p.fullmatch(n.target) or p.fullmatch(n.id) for p in patterns)}
    succ: dict[str, list[str]] = {}
    pred: dict[str, list[str]] = {}
    for e in view.edges:
        succ.setdefault(e.src, []).append(e.dst)
        pred.setdefault(e.dst, []).append(e.src)
    after = _reach(matched, succ)
    before = _reach(matched, pred)
    return matched, (after & before) - matched


def _reach(start: set[str], adj: dict[str, list[str]]) -> set[str]:
    seen = set(start)
    queue = deque(start)
    while queue:
        for nxt in adj.get(queue.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def neighbourhood(view: GraphView, centre: str, hops: int) -> set[str]:
    """Node ids within ``hops`` edges (either direction) of ``centre``."""
    adj: dict[str, list[str]] = {}
    for e in view.edges:
        adj.setdefault(e.src, []).append(e.dst)
        adj.setdefault(e.dst, []).append(e.src)
    seen = {centre}
    frontier = [centre]
    for _ in range(hops):
        frontier = [m for n in frontier for m in adj.get(n, ()) if m not in seen]
        seen.update(frontier)
    return seen
