"""``filter_by_op``: which nodes match op patterns, and which lie on a path between matches.

A pattern is a regular expression that must match *all* of a node's short op name
(``mm``, ``all_reduce``), its full target (``aten.mm.default``) or its FX name: ``mm`` keeps
``mm`` nodes but not ``addmm``; ``.*mm`` keeps both; ``all_reduce|wait_tensor`` keeps both ops.

Patterns come from any reader of the server, so they are compiled with RE2 (``google-re2``),
whose matching is linear in the text: Python's ``re`` backtracks exponentially on patterns such
as ``([a-z_]+)+!`` (0.6 s for one 22-character target, minutes for a 30-character one, per node).
RE2 has Python's syntax minus backreferences and lookaround (a 400 names it). Without the package
installed, Python's ``re`` is used.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable

from graphdeck.errors import UsageError

try:
    import re2 as _re2  # linear-time matching (NOTE in the module docstring)
except ImportError:  # pragma: no cover - google-re2 is in the server extra
    _re2 = None
from graphdeck.analysis.graphs.view import GraphView, short_target

#: Longest pattern accepted (a guard against pathological input, not a limit anyone meets).
MAX_PATTERN_CHARS = 500


def _re2_options():
    """RE2 options that keep a bad pattern's parse error out of the server log: RE2 writes it to
    stderr through absl (with an ``absl::InitializeLog()`` warning) unless ``log_errors`` is off;
    the error still reaches the caller as a 400 naming the pattern."""
    options = _re2.Options()
    options.log_errors = False
    return options


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
            out.append(_re2.compile(text, _re2_options()) if _re2 is not None else re.compile(text))
        except re.error as exc:
            raise UsageError(f"filter_by_op {text!r} is not a valid regular expression: {exc}") from exc
        except Exception as exc:  # re2's error: Python syntax RE2 lacks (backreferences, lookaround)
            if _re2 is None or not isinstance(exc, _re2.error):
                raise
            detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
            raise UsageError(f"filter_by_op {text!r} is not a valid regular expression (RE2 syntax: no "
                             f"backreferences or lookaround): {detail}") from exc
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
