"""Request dependencies: engines, sessions, and the resources a URL names.

Handlers never look a resource up themselves: they declare ``run: Run = Depends(resolve_run)``
and receive the row, or the request ends with :class:`~graphdeck.errors.NotFoundError` (404,
rendered by the app's one error handler). The pattern is datasette's ``resolve_table``.

Everything reads through ``app.state.read_engine`` (``PRAGMA query_only``); only upload routes
take ``app.state.engine``, the one writer.

NOTE: [Run names with '/'] An ASGI server hands the router the *decoded* path, so
``/api/runs/team%2Fexp1/graphs`` is routed as ``/api/runs/team/exp1/graphs`` and matches nothing.
A run is reached by name anyway: routes declared with ``route_class=RunPathRoute`` match on the
raw path's run segment (the run's name URL-encoded, ``%2F`` for ``/``), and :func:`find_run`
also takes the name tilde-encoded (``team~2Fexp1``: ``~`` + the hex of each byte outside
``[A-Za-z0-9_.-]``, as datasette does), which survives any proxy and works on every route.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import unquote

from fastapi import Depends, Path, Query, Request
from fastapi.routing import APIRoute
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from starlette.routing import Match

from graphdeck.errors import NotFoundError
from graphdeck.server.render.svg import SvgCache
from graphdeck.server.settings import Settings
from graphdeck.store.schema import Graph, Node, Run


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    """The read/write engine (uploads, ingest)."""
    return request.app.state.engine


def get_read_engine(request: Request) -> Engine:
    """The read-only engine (``PRAGMA query_only=1``): every GET reads through it."""
    return request.app.state.read_engine


def get_svg_cache(request: Request) -> SvgCache:
    """The app's cache of rendered graph SVGs."""
    return request.app.state.svg_cache


def get_session(engine: Engine = Depends(get_read_engine)) -> Iterator[Session]:
    """One read-only session per request, shared by every dependency of that request."""
    with Session(engine) as session:
        yield session


#: Largest id a route takes (SQLite and PostgreSQL ``INTEGER`` ids); beyond it nothing is found.
MAX_ID = 2**63 - 1
#: Largest rank a ``?rank=`` takes (ranks are 32-bit integers in the store).
MAX_RANK = 2**31 - 1
#: Longest run name the store holds (``runs.name`` is ``String(200)``).
MAX_RUN_NAME = 200
_TILDE = re.compile(r"~([0-9A-Fa-f]{2})")


def tilde_encode(name: str) -> str:
    """``'team/exp~1'`` → ``'team~2Fexp~7E1'`` (see NOTE: [Run names with '/'])."""
    return "".join(ch if re.fullmatch(r"[A-Za-z0-9_.-]", ch) else
                   "".join(f"~{b:02X}" for b in ch.encode("utf-8", "surrogatepass")) for ch in name)


def tilde_decode(text: str) -> str | None:
    """The inverse of :func:`tilde_encode`; ``None`` when ``text`` holds no ``~XX`` or does not
    decode to UTF-8."""
    if not _TILDE.search(text):
        return None
    try:
        return unquote(_TILDE.sub(lambda m: "%" + m.group(1), text.replace("%", "%25")), errors="strict")
    except UnicodeDecodeError:
        return None


def find_run(session: Session, run_id: str | int) -> Run:
    """The run whose id is ``run_id`` or, failing that, whose name is ``run_id`` (as given, then
    tilde-decoded: NOTE: [Run names with '/']).

    An all-digit ``run_id`` is tried as an id first, so a run literally named ``"3"`` is reached
    by its id (or its name when no run has id 3). A text no run name can be (NUL, longer than
    :data:`MAX_RUN_NAME`) is not looked up at all.

    Raises:
        NotFoundError: no run has that id or name.
    """
    text = str(run_id)
    run = None
    if text.isascii() and text.isdigit() and int(text) <= MAX_ID:
        run = session.get(Run, int(text))
    for name in (text, tilde_decode(text)):
        if run is None and name is not None and "\x00" not in name and len(name) <= MAX_RUN_NAME:
            run = session.scalar(select(Run).where(Run.name == name))
    if run is None:
        raise NotFoundError(f"run {text[:MAX_RUN_NAME + 20]!r} not found", resource="run", id=text[:MAX_RUN_NAME + 20])
    return run


class RunPathRoute(APIRoute):
    """A route under ``/api/runs/{run_id}`` that also matches when the run's name holds ``/``,
    sent URL-encoded (``%2F``): the run segment is taken from the raw path and handed on
    tilde-encoded, which :func:`find_run` decodes (NOTE: [Run names with '/']). Use it with
    ``APIRouter(route_class=RunPathRoute)``."""

    _PREFIX = "/api/runs/{run_id}"

    def matches(self, scope):
        match, child = super().matches(scope)
        if match != Match.NONE or not self.path.startswith(self._PREFIX) or scope.get("type") != "http":
            return match, child
        raw = scope.get("raw_path") or b""
        if b"%2f" not in raw.lower() or not raw.startswith(b"/api/runs/"):
            return match, child
        segment, sep, rest = raw[len(b"/api/runs/"):].partition(b"/")
        try:
            name = unquote(segment.decode("ascii"), errors="strict")
            tail = unquote((sep + rest).decode("ascii"), errors="strict")
        except UnicodeError:
            return match, child
        root = scope.get("root_path", "")
        fixed = {**scope, "path": f"{root}/api/runs/{tilde_encode(name)}{tail}"}
        return super().matches(fixed)


def find_graph(session: Session, graph_id: int) -> Graph:
    """Raises :class:`NotFoundError` when no graph has id ``graph_id``."""
    graph = session.get(Graph, graph_id)
    if graph is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    return graph


def resolve_run(
    run_id: str = Path(description="A run's numeric id or its name"),
    session: Session = Depends(get_session),
) -> Run:
    return find_run(session, run_id)


def rank_query(rank: int | None = Query(None, ge=0, le=MAX_RANK, description="only this rank")) -> int | None:
    """A ``?rank=`` filter: a rank past 32 bits (``2**63``) is a 422, not a database overflow."""
    return rank


def resolve_graph(
    graph_id: int = Path(description="A graph's numeric id", ge=-MAX_ID - 1, le=MAX_ID),
    session: Session = Depends(get_session),
) -> Graph:
    return find_graph(session, graph_id)


def resolve_node(
    node_name: str = Path(description="The FX node's name, unique in its graph"),
    graph: Graph = Depends(resolve_graph),
    session: Session = Depends(get_session),
) -> Node:
    node = session.scalar(select(Node).where(Node.graph_id == graph.id, Node.name == node_name))
    if node is None:
        raise NotFoundError(
            f"node {node_name!r} not found in graph {graph.id}", resource="node", id=node_name
        )
    return node
