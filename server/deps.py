"""Request dependencies: engines, sessions, and the resources a URL names.

Handlers never look a resource up themselves: they declare ``run: Run = Depends(resolve_run)``
and receive the row, or the request ends with :class:`~graphdeck.errors.NotFoundError` (404,
rendered by the app's one error handler). The pattern is datasette's ``resolve_table``.

Everything reads through ``app.state.read_engine`` (``PRAGMA query_only``); only upload routes
take ``app.state.engine``, the one writer.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Depends, Path, Request
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

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


def find_run(session: Session, run_id: str | int) -> Run:
    """The run whose id is ``run_id`` or, failing that, whose name is ``run_id``.

    An all-digit ``run_id`` is tried as an id first, so a run literally named ``"3"`` is reached
    by its id (or its name when no run has id 3).

    Raises:
        NotFoundError: no run has that id or name.
    """
    text = str(run_id)
    run = None
    if text.isdigit():
        run = session.get(Run, int(text))
    if run is None:
        run = session.scalar(select(Run).where(Run.name == text))
    if run is None:
        raise NotFoundError(f"run {text!r} not found", resource="run", id=text)
    return run


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


def resolve_graph(
    graph_id: int = Path(description="A graph's numeric id"),
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
