"""Replay runs: where ``graphdeck replay`` stores what it measures (a store concern: the store's
``delete_run`` reads them; formerly ``graphdeck.replay.runs``, moved so the store imports no
higher package).

# NOTE: [Replay runs]
A replay (the one-worker executor or a pipeline of K workers) is a run of its own, a *replay
run*, linked to the captured run it re-ran; it never writes a row into that source run. Before
(issue 36 item 1) the executor's traces went into the source run under the graph's rank, so every
view of that run — check-ranks, the overview's trace coverage and slowest steps, the aligned run
timeline and its collectives, ``export-trace``, the time overlay, the notebook's
``run.trace(rank)`` — read the replay as the rank's newest trace.

- One replay run per ``graphdeck replay`` (or :func:`graphdeck.replay.executor.execute_graph` /
  :func:`graphdeck.replay.pipeline.run_pipeline` call without a run given), named
  ``<source> replay <n>`` (n = 1, 2, … the first free).
- The link is the replay run's ``meta_json``, whose first key is ``replay`` = ``{"source_run_id",
  "source_run", "graph_id", "workers"}`` (:func:`replay_meta`), not a column: a store of an
  older graphdeck needs no migration and still opens read-only, and an older graphdeck reading a
  newer store sees a plain run. Lookups match the JSON's fixed prefix (:func:`_prefix`), then parse it.
- Its traces keep their names (``executor graph <id>``, ``… worker s/K``, ``… batch <b>``); the
  graph id in the name says which graph they time. A one-worker trace is filed under the graph's
  rank; a pipeline worker's under its worker rank (a K-worker replay is a K-rank run).
- Readers that want a graph's executor traces look in the replay runs of the graph's run
  (:func:`executor_traces`); the run page lists a run's replays (``GET /api/runs/<id>`` ``replays``)
  and a run names the run it replays (``source_run``). Deleting a run deletes its replay runs
  (:func:`graphdeck.store.db.delete_run`): their traces time graphs that are gone.
"""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Graph, Run, Trace

EXECUTOR_PREFIX = "executor graph "


def replay_meta(source: Run, graph_id: int, workers: int) -> dict:
    """The ``meta_json`` of a replay run of ``source`` (``replay`` first: :func:`_prefix` matches it)."""
    return {"replay": {"source_run_id": source.id, "source_run": source.name, "graph_id": graph_id,
                       "workers": workers}}


def _prefix(source_run_id: int) -> str:
    """The start of the ``meta_json`` of every replay run of run ``source_run_id`` (``json.dumps``
    of :func:`replay_meta`)."""
    return '{"replay": {"source_run_id": %d, ' % int(source_run_id)


def replay_info(run: Run) -> dict | None:
    """The ``replay`` object of ``run``'s meta (:func:`replay_meta`); None for a run that is not a replay."""
    try:
        info = json.loads(run.meta_json or "{}").get("replay")
    except (ValueError, AttributeError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("source_run_id"), int) else None


def create_replay_run(engine: Engine, graph_id: int, *, workers: int = 1) -> str:
    """Create the replay run of one replay of graph ``graph_id`` (NOTE: [Replay runs]), after moving
    any executor trace an older graphdeck left in the graph's run (:func:`adopt_legacy_traces`);
    returns its name. Raises NotFoundError (no such graph)."""
    from sqlalchemy.exc import IntegrityError

    from graphdeck.store.db import retrying, write_session

    def make() -> str:
        with write_session(engine) as s:
            g = s.get(Graph, graph_id)
            if g is None:
                raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
            src = s.get(Run, g.run_id)
            taken = set(s.scalars(select(Run.name).where(Run.name.like(f"{src.name} replay %"))))
            n = 1
            while (name := f"{src.name} replay {n}") in taken:
                n += 1
            s.add(Run(name=name, world_size=workers, meta_json=json.dumps(replay_meta(src, graph_id, workers))))
            s.flush()
            return name

    with Session(engine) as s:
        g = s.get(Graph, graph_id)
        if g is None:
            raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
        source_run_id = g.run_id
    adopt_legacy_traces(engine, source_run_id)

    for _ in range(5):  # another replay of the same run took the name first
        try:
            return retrying(make)
        except IntegrityError:
            continue
    return retrying(make)


def adopt_legacy_traces(engine: Engine, source_run_id: int) -> str | None:
    """Move executor traces that an older graphdeck stored in run ``source_run_id`` itself
    (``executor graph …``, before NOTE: [Replay runs]) into a replay run of it, ``<source> replay
    (moved)``, with their node-time sets and kernel links; returns that run's name, None when there
    were none. Every replay does this first, so a run an older replay corrupted shows its own
    traces again."""
    from sqlalchemy import update

    from graphdeck.store.db import retrying, write_session
    from graphdeck.store.schema import NodeTimeSet, TraceLinks

    def move() -> str | None:
        with write_session(engine) as s:
            tids = list(s.scalars(select(Trace.id).where(Trace.run_id == source_run_id,
                                                         Trace.name.startswith(EXECUTOR_PREFIX))))
            if not tids:
                return None
            src = s.get(Run, source_run_id)
            name = f"{src.name} replay (moved)"[:200]
            run = s.scalar(select(Run).where(Run.name == name))
            if run is None:
                run = Run(name=name, world_size=None, meta_json=json.dumps(replay_meta(src, None, None)))
                s.add(run)
                s.flush()
            for model, col in ((Trace, Trace.id), (NodeTimeSet, NodeTimeSet.trace_id), (TraceLinks, TraceLinks.trace_id)):
                s.execute(update(model).where(col.in_(tids)).values(run_id=run.id))
            return name

    return retrying(move)


def replay_runs(session: Session, source_run_id: int) -> list[Run]:
    """The replay runs of run ``source_run_id``, oldest first."""
    rows = session.scalars(select(Run).where(Run.meta_json.startswith(_prefix(source_run_id), autoescape=True))
                           .order_by(Run.id))
    return [r for r in rows if (replay_info(r) or {}).get("source_run_id") == source_run_id]


def replay_run_ids(session: Session, source_run_id: int) -> list[int]:
    """Ids of the replay runs of run ``source_run_id``, oldest first."""
    return [r.id for r in replay_runs(session, source_run_id)]


def executor_traces(session: Session, graph: Graph, *, single_only: bool = False) -> list[tuple[int, str]]:
    """``(trace id, name)`` of the executor traces of ``graph`` (``executor graph <id>``, ``…
    worker s/K``; ``single_only``: the one-worker traces at the recorded batch) in its run's
    replay runs, oldest first; complete or truncated traces only."""
    prefix = f"{EXECUTOR_PREFIX}{graph.id}"
    name_ok = (Trace.name == prefix) if single_only else ((Trace.name == prefix) | Trace.name.like(prefix + " worker %"))
    runs = replay_run_ids(session, graph.run_id)
    if not runs:
        return []
    return [(t, n) for t, n in session.execute(
        select(Trace.id, Trace.name).where(Trace.run_id.in_(runs), name_ok, Trace.status.in_(("ok", "truncated")))
        .order_by(Trace.id))]


def replays_of(session: Session, run: Run) -> list[dict]:
    """The replay runs of ``run`` for its page: ``[{"id", "name", "created_at", "graph_id", "workers",
    "traces": [{"id", "rank", "name", "status", "num_events"}]}]``, oldest first."""
    out = []
    for r in replay_runs(session, run.id):
        meta = replay_info(r) or {}
        traces = session.execute(select(Trace.id, Trace.rank, Trace.name, Trace.status, Trace.num_events)
                                 .where(Trace.run_id == r.id, Trace.status != "ingesting").order_by(Trace.id)).all()
        out.append({"id": r.id, "name": r.name, "created_at": r.created_at.isoformat() if r.created_at else None,
                    "graph_id": meta.get("graph_id"), "workers": meta.get("workers"),
                    "traces": [{"id": t, "rank": k, "name": n, "status": st, "num_events": e}
                               for t, k, n, st, e in traces]})
    return out


def source_of(session: Session, run: Run) -> dict | None:
    """``{"id", "name", "graph_id"}`` of the run ``run`` replays; None for a run that is not a replay
    (or whose source is gone)."""
    info = replay_info(run)
    src = session.get(Run, info["source_run_id"]) if info else None
    return {"id": src.id, "name": src.name, "graph_id": info.get("graph_id")} if src is not None else None
