"""torch's debug server's periodic dump folder as an import source (issue 38 item 1).

# NOTE: [Debug-server dumps]
# ``torch.distributed.debug.start_debug_server(dump_dir=D, dump_interval=S)`` (torch 2.13,
# torch/distributed/debug/__init__.py) starts, on rank 0 only, a frontend process whose
# ``PeriodicDumper`` (debug/_frontend.py ``PeriodicDumper._run``) asks every rank's worker server
# every S seconds and writes one text file per handler and time into D:
# ``<handler>_<YYYYmmdd_HHMMSS>.txt`` (local time of rank 0's host), handlers ``stacks``,
# ``fr_trace`` and ``torchcomms_health_check`` by default. A ``stacks`` file is, per rank,
#
#     === Rank <r>: <worker url> ===
#     <faulthandler.dump_traceback(all_threads=True) text, or "Error: <HTTP status>">
#
# preceded by ``PARTIAL DATA: k/n workers responded`` and a line per rank that did not answer.
# The faulthandler text is, per thread, ``Current thread 0x… (most recent call first):`` (the
# worker's own request thread) or ``Thread 0x… (most recent call first):``, then ``  File "f",
# line N in fn`` lines, innermost first.
#
# Read here: the ``stacks`` files. Each rank's latest answered snapshot is stored as its
# ``graphdeck_stacks`` record (the live watch's form, graphdeck/capture/heartbeat.py
# ``python_stacks``: frames outermost first, the main thread marked), with how many consecutive
# snapshots, over how many seconds, showed its main thread at the same place (``same_for``):
# a rank stuck in a collective shows the same stack in every dump since it got stuck. The main
# thread is the one not started by ``threading`` (outermost frame not ``threading.py``) that is not
# the request's own thread. Source lines are read from the files when they exist here (linecache).
#
# Not read: ``fr_trace`` files are a summary table (tabulate text of torch's flight_recorder
# ``build_db``), not the ranks' entries, and on gloo the dumper cannot write them at all: its
# ``build_db`` raises ``KeyError`` for every gloo group, whose recorder ``pg_config`` is empty
# (torch/distributed/flight_recorder/components/builder.py:212 in ``build_collectives``, called by
# debug/_debug_handlers.py:368 ``FlightRecorderHandler.dump``; the dumper logs it and writes no
# file, debug/_frontend.py:305). They are skipped, named; import the ranks' own Flight Recorder
# dumps (``_dump_fr_trace``) for the collectives.
"""

from __future__ import annotations

import json
import linecache
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

#: The compile_events name of a rank's Python stacks (the live watch's, capture/heartbeat.py).
STACKS = "graphdeck_stacks"
_NAME = re.compile(r"^(?P<handler>[a-z_]+)_(?P<ts>\d{8}_\d{6})\.txt$")
_RANK = re.compile(r"^=== Rank (\d+): (.*) ===$")
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*)\])? \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
#: Largest dump file read (a stacks file of 1,024 ranks of 100 frames is a few MiB).
MAX_BYTES = 64 << 20


def dump_kind(path: str | Path) -> str | None:
    """``"stacks"``, ``"fr_trace"``, another handler's name, or None: whether ``path`` is a file
    torch's periodic dumper wrote (its name, and for ``stacks`` its first line)."""
    m = _NAME.match(Path(path).name)
    if not m:
        return None
    if m["handler"] == "stacks":
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                head = fh.readline().rstrip("\n")
        except OSError:
            return None
        return "stacks" if (_RANK.match(head) or head.startswith("PARTIAL DATA: ") or head == "") else None
    return m["handler"]


def parse_stacks(text: str) -> tuple[dict[int, dict], dict[int, str]]:
    """One ``stacks`` file → (``{rank: {"url", "threads": [{"name", "main", "frames": [[file,
    line, fn, source], ...]}]}}`` outermost frame first, ``{rank: why}`` for ranks that did not
    answer). Lines it does not know are ignored; a rank section without a thread is no answer."""
    ranks: dict[int, dict] = {}
    failed: dict[int, str] = {}
    rank = None
    sections: list[tuple[int, str, list[str]]] = []
    for line in text.splitlines():
        m = _RANK.match(line)
        if m:
            rank = int(m[1])
            sections.append((rank, m[2], []))
        elif rank is not None:
            sections[-1][2].append(line)
    for rank, url, lines in sections:
        threads, current = [], None
        for line in lines:
            t = _THREAD.match(line)
            if t:
                current = {"name": t[3] or t[2], "current": t[1] == "Current thread", "frames": []}
                threads.append(current)
                continue
            f = _FRAME.match(line)
            if f and current is not None:
                current["frames"].append([f[1], int(f[2]), f[3], (linecache.getline(f[1], int(f[2])) or "").strip()])
        if not threads:
            failed[rank] = next((ln.strip() for ln in lines if ln.strip()), "no answer")
            continue
        for th in threads:
            th["frames"].reverse()  # faulthandler: innermost first; stored: outermost first
        main = [th for th in threads if not th["current"] and th["frames"]
                and not th["frames"][0][0].endswith("threading.py")]
        main.sort(key=lambda th: th["frames"][0][2] != "<module>")  # the script's own thread first
        for th in threads:
            th["main"] = bool(main) and th is main[0]
        threads.sort(key=lambda th: not th["main"])
        ranks[rank] = {"url": url, "threads": [{k: th[k] for k in ("name", "main", "frames")} for th in threads]}
    return ranks, failed


def _main(stacks: dict) -> list:
    return next((th["frames"] for th in stacks["threads"] if th["main"]), [])


@dataclass
class DebugImport:
    """What :func:`import_debug_dumps` stored: ``ranks`` (a stacks record each), ``snapshots``
    (stacks files read), ``first``/``last`` (the first and last of their names), ``no_answer`` (rank → why, in
    the latest snapshot), ``skipped`` ("file: why")."""

    run_id: int
    ranks: list[int] = field(default_factory=list)
    snapshots: int = 0
    first: str = ""
    last: str = ""
    no_answer: dict[int, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def import_debug_dumps(engine: Engine, files: list[str], *, run_name: str) -> DebugImport:
    """Store the latest answered stack of each rank found in the debug server's ``stacks`` files
    among ``files`` (NOTE: [Debug-server dumps]) as run ``run_name`` (created if missing); other
    dumper files are skipped, named. Raises :class:`~graphdeck.errors.BadInputError` when no
    ``stacks`` file holds a rank's stack."""
    from sqlalchemy import insert, select
    from sqlalchemy.orm import Session

    from graphdeck.errors import BadInputError
    from graphdeck.store.db import get_or_create_run
    from graphdeck.store.schema import CompileEvent, Rank

    snaps: list[tuple[float, str, dict, dict]] = []
    skipped: list[str] = []
    for f in files:
        kind = dump_kind(f)
        name = Path(f).name
        if kind != "stacks":
            skipped.append(f"{name}: torch.distributed.debug's {kind} dump, not read" if kind else f"{name}: not a "
                           "torch.distributed.debug dump")
            continue
        if Path(f).stat().st_size > MAX_BYTES:
            skipped.append(f"{name}: larger than {MAX_BYTES >> 20} MiB")
            continue
        ranks, failed = parse_stacks(Path(f).read_text(encoding="utf-8", errors="replace"))
        if not ranks:
            skipped.append(f"{name}: no rank's stack in it" + (f" ({'; '.join(f'rank {r}: {w}' for r, w in sorted(failed.items()))})"
                                                              if failed else ""))
            continue
        t = time.mktime(time.strptime(_NAME.match(name)["ts"], "%Y%m%d_%H%M%S"))
        snaps.append((t, name, ranks, failed))
    if not snaps:
        raise BadInputError("no torch.distributed.debug stacks dump with a rank's stack found"
                            + (f" (skipped: {'; '.join(skipped[:10])})" if skipped else ""), skipped_files=skipped)
    snaps.sort(key=lambda s: (s[0], s[1]))
    latest: dict[int, tuple[int, dict]] = {}
    for i, (_t, _n, ranks, _f) in enumerate(snaps):
        for r, st in ranks.items():
            latest[r] = (i, st)
    rows = []
    for r, (i, st) in sorted(latest.items()):
        j = i  # back over the snapshots that show this rank's main thread at the same place
        while j > 0 and r in snaps[j - 1][2] and _main(snaps[j - 1][2][r]) == _main(st):
            j -= 1
        same = sum(1 for k in range(j, i + 1) if r in snaps[k][2])
        payload = {"t": snaps[i][0], "threads": st["threads"], "url": st["url"],
                   "source": f"torch.distributed.debug {snaps[i][1]}",
                   "same_for": {"snapshots": same, "seconds": snaps[i][0] - snaps[j][0]}}
        rows.append({"rank": r, "name": STACKS, "compile_id": None, "payload": json.dumps(payload, separators=(",", ":")),
                     "metadata_json": json.dumps({"reason": "debug server dump", "file": snaps[i][1]})})
    with Session(engine) as s, s.begin():
        run = get_or_create_run(s, run_name, meta={"source": "torch.distributed.debug"})
        existing = set(s.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
        new = [{"run_id": run.id, "rank": r, "world_size": 1, "meta_json": "{}"} for r in sorted(latest)
               if r not in existing]
        if new:
            s.execute(insert(Rank), new)
        s.execute(insert(CompileEvent), [{**row, "run_id": run.id} for row in rows])
        if (run.world_size or 0) < max(latest) + 1:
            run.world_size = max(latest) + 1
        last = snaps[-1]
        return DebugImport(run_id=run.id, ranks=sorted(latest), snapshots=len(snaps), first=snaps[0][1],
                           last=last[1], no_answer=dict(last[3]), skipped=skipped)


# NOTE: [Debug-server endpoints]
# While the job runs, the frontend (rank 0's ``port``, debug/_frontend.py ``FrontendServer``)
# answers ``GET /stacks`` and ``GET /fr_trace_json`` by asking every rank's worker server
# (``/handler/dump_traceback``, ``/handler/fr_trace_json``: served by a C++ thread, so a rank
# whose Python thread is blocked in a collective still answers) and rendering one HTML page:
# per rank ``<h2>Rank <r>: <worker url></h2>`` then, for a rank that did not answer,
# ``<p>Failed to fetch: status=<code></p>``, and ``<pre>`` holding the answer — the faulthandler
# text (as in a ``stacks`` dump file) or the recorder's JSON (``_dump_fr_trace_json``: entries
# without stack frames; on gloo an empty ``pg_config``). torch 2.13's Jinja environment does not
# escape them (a ``<module>`` frame stays as is); an escaped page is unescaped. ``graphdeck watch
# --debug-server URL`` reads both pages (:func:`parse_debug_page`) and stores what they show as
# the live watch stores its own evidence (:func:`store_debug_snapshot`).
_SECTION = re.compile(r"<h2>Rank (\d+): (.*?)</h2>\s*(?:<p>Failed to fetch: status=(\d+)</p>\s*)?<pre>(.*?)</pre>",
                      re.S)


def parse_debug_page(page: str) -> list[tuple[int, str, int | None, str]]:
    """One debug-server page (NOTE: [Debug-server endpoints]) → ``[(rank, worker url, failed HTTP
    status or None, body text)]`` in page order; [] for a page without rank sections."""
    import html

    out = []
    for rank, url, status, body in _SECTION.findall(page):
        if "&lt;" in body or "&quot;" in body or "&#" in body:
            body = html.unescape(body)
        out.append((int(rank), html.unescape(url), int(status) if status else None, body))
    return out


def stacks_from_page(page: str) -> tuple[dict[int, dict], dict[int, str]]:
    """The ``/stacks`` page → :func:`parse_stacks`'s ``(ranks, failed)``."""
    text = []
    for rank, url, status, body in parse_debug_page(page):
        text += [f"=== Rank {rank}: {url} ===", body if status is None else f"Error: {status}"]
    return parse_stacks("\n".join(text))


def flight_from_page(page: str) -> tuple[dict[int, dict], dict[int, str]]:
    """The ``/fr_trace_json`` page → ``({rank: the recorder's dump as torch's JSON gives it, with
    its "rank"}, {rank: why not})``: a rank that did not answer, or whose answer is not a Flight
    Recorder dump torch writes, is named with why."""
    from graphdeck.store.fr_types import dump_problem

    dumps: dict[int, dict] = {}
    failed: dict[int, str] = {}
    for rank, _url, status, body in parse_debug_page(page):
        if status is not None:
            failed[rank] = f"no answer (HTTP {status})"
            continue
        try:
            d = json.loads(body)
        except ValueError as exc:
            failed[rank] = f"not JSON ({exc})"
            continue
        problem = dump_problem(d) if isinstance(d, dict) else "not a JSON object"
        if problem or not isinstance(d.get("entries"), list):
            failed[rank] = f"not a Flight Recorder dump: {problem or 'no entries list'}"
            continue
        d["rank"] = rank
        dumps[rank] = d
    return dumps, failed


def in_flight(dump: dict) -> list[tuple[str, int]]:
    """``[(group, collective seq)]`` of the dump's entries neither retired nor completed."""
    out = []
    for e in dump.get("entries") or []:
        if isinstance(e, dict) and not e.get("retired") and e.get("state") != "completed" and not e.get("is_p2p"):
            g = e.get("process_group")
            out.append((str(g[0] if isinstance(g, (list, tuple)) else g), int(e.get("collective_seq_id") or 0)))
    return out


def store_debug_snapshot(engine: Engine, run_id: int, url: str, dumps: dict[int, dict],
                         stacks: dict[int, dict], same_for: dict[int, dict] | None = None) -> None:
    """Store one snapshot of the debug server at ``url`` under run ``run_id``: each rank's Flight
    Recorder dump as a ``flight_recorder`` record (normalised as the importer does, reason ``debug
    server``) and its stacks as a ``graphdeck_stacks`` record (the live watch's form;
    ``same_for``: rank → ``{"snapshots", "seconds"}`` it has not moved). Ranks the run lacks are
    added."""
    from sqlalchemy import insert, select
    from sqlalchemy.orm import Session

    from graphdeck.store.db import retrying
    from graphdeck.store.fr_import import EVENT_NAME, normalise, seq_index
    from graphdeck.store.schema import CompileEvent, Rank, Run

    now = time.time()
    rows = []
    for r, d in sorted(dumps.items()):
        norm = normalise(d, f"debug server {url}")
        norm["format"] = "json"
        rows.append({"rank": r, "name": EVENT_NAME, "compile_id": None,
                     "payload": json.dumps(norm, separators=(",", ":")),
                     "metadata_json": json.dumps({"reason": "debug server", "url": url, "entries": len(norm["entries"]),
                                                  "dropped": len(norm["dropped"]), "fr_index": seq_index(norm)})})
    for r, st in sorted(stacks.items()):
        payload = {"t": now, "threads": st["threads"], "url": st.get("url"), "source": f"torch.distributed.debug {url}"}
        if same_for and r in same_for:
            payload["same_for"] = same_for[r]
        rows.append({"rank": r, "name": STACKS, "compile_id": None, "payload": json.dumps(payload, separators=(",", ":")),
                     "metadata_json": json.dumps({"reason": "debug server", "url": url})})
    ranks = {row["rank"] for row in rows}

    def do():
        with Session(engine) as s, s.begin():
            existing = set(s.scalars(select(Rank.rank).where(Rank.run_id == run_id)))
            new = [{"run_id": run_id, "rank": r, "world_size": 1, "meta_json": "{}"} for r in sorted(ranks - existing)]
            if new:
                s.execute(insert(Rank), new)
            if rows:
                s.execute(insert(CompileEvent), [{**row, "run_id": run_id} for row in rows])
            run = s.get(Run, run_id)
            if ranks and run is not None and (run.world_size or 0) < max(ranks) + 1:
                run.world_size = max(ranks) + 1

    retrying(do)


__all__ = ["DebugImport", "STACKS", "dump_kind", "flight_from_page", "import_debug_dumps", "in_flight",
           "parse_debug_page", "parse_stacks", "stacks_from_page", "store_debug_snapshot"]
