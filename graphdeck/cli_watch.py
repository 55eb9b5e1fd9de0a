"""``graphdeck watch STORE --run RUN`` (or ``RUN --store STORE``): follow a captured job while it
runs, from the store its agents write (NOTE: [Live watch] in graphdeck/capture/heartbeat.py).
Registered through its ``COMMANDS`` (graphdeck/cli.py's ``COMMAND_MODULES``)."""

from __future__ import annotations

import json
import sys
import time

import click

from graphdeck.cli_common import store_and_run
from graphdeck.errors import GraphdeckError


def _stalled(beats: dict[int, dict], now: float, threshold_s: float | None) -> bool | dict | None:
    """True: a rank says it is stalled (the agents answer it themselves). Else, with ``threshold_s``,
    the oldest collective in flight that long (confirmed by its rank from the recorder's entries:
    gloo's completed count lags) as ``{"group", "desc", "seq", "since", "for_s"}``; else None."""
    if any(b.get("stalled") and not b.get("ended") for b in beats.values()):
        return True
    oldest = None
    for b in beats.values():
        if threshold_s is None or b.get("ended"):
            continue
        for g, v in (b.get("groups") or {}).items():
            since = float(v.get("since") or now)
            if v.get("in_flight") and now - since > threshold_s and (oldest is None or since < oldest["since"]):
                oldest = {"group": g, "desc": v.get("desc"), "seq": v.get("enqueued"), "since": since,
                          "for_s": round(now - since, 3)}
    return oldest


class DebugServer:
    """``graphdeck watch --debug-server URL``: the job's torch debug server polled for every rank's
    stacks and Flight Recorder (NOTE: [Debug-server endpoints] in store/debug_dumps.py). A rank is
    still when its main thread's stack and its recorder's entries read the same as at its previous
    snapshot; :meth:`stalled` — every rank still for longer than the threshold, with a collective in
    flight on one of them — is a hang seen from outside the job."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.dumps: dict[int, dict] = {}
        self.stacks: dict[int, dict] = {}
        self.failed: dict[int, str] = {}
        self.answered_at: float | None = None
        self.error: str | None = None
        self._sig: dict[int, tuple] = {}
        self.still_since: dict[int, float] = {}
        self.snapshots: dict[int, int] = {}

    def _get(self, path: str) -> str:
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as resp:  # noqa: S310 - the user's URL
            return resp.read().decode("utf-8", errors="replace")

    def poll(self, now: float) -> bool:
        """Read both pages; False (and ``error``) when the server does not answer."""
        from graphdeck.store.debug_dumps import flight_from_page, stacks_from_page

        try:
            stacks, failed = stacks_from_page(self._get("/stacks"))
            dumps, fr_failed = flight_from_page(self._get("/fr_trace_json"))
        except Exception as exc:  # noqa: BLE001 - a job that ended, a wrong URL: said, the watch goes on
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        self.error, self.answered_at = None, now
        self.stacks, self.dumps = stacks, dumps
        self.failed = {**fr_failed, **failed}
        for r in set(stacks) | set(dumps):
            main = next((th["frames"] for th in stacks.get(r, {}).get("threads", []) if th.get("main")), [])
            ents = dumps.get(r, {}).get("entries") or []
            sig = (tuple(tuple(f[:3]) for f in main), len(ents),
                   tuple((e.get("record_id"), e.get("retired"), e.get("state")) for e in ents[-1:]))
            if self._sig.get(r) != sig:
                self._sig[r], self.still_since[r], self.snapshots[r] = sig, now, 0
            self.snapshots[r] += 1
        return True

    def stalled(self, now: float, threshold_s: float) -> dict | None:
        """``{"group", "seq", "since", "for_s", "ranks"}`` when every rank that answered has been
        still for more than ``threshold_s`` and one has a collective in flight; else None."""
        from graphdeck.store.debug_dumps import in_flight

        if not self._sig or any(now - t <= threshold_s for t in self.still_since.values()):
            return None
        pending = sorted((g, seq, r) for r, d in self.dumps.items() for g, seq in in_flight(d))
        if not pending:
            return None
        g, seq, _r = pending[0]
        since = min(self.still_since.values())
        return {"group": g, "seq": seq, "since": since, "for_s": round(now - since, 3),
                "ranks": sorted(r for r, d in self.dumps.items() if (g, seq) in in_flight(d))}

    def store(self, engine, run_id: int) -> None:
        from graphdeck.store.debug_dumps import store_debug_snapshot

        same = {r: {"snapshots": self.snapshots.get(r, 1), "seconds": round(self.answered_at - t, 3)}
                for r, t in self.still_since.items() if self.answered_at}
        store_debug_snapshot(engine, run_id, self.url, self.dumps, self.stacks, same)


def _debug_url(url: str | None) -> str | None:
    if url is None:
        return None
    from urllib.parse import urlparse

    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        click.echo(f"error: --debug-server must be an http(s) URL of the job's torch debug server "
                   f"(e.g. http://host:25999), got {url!r}", err=True)
        sys.exit(2)
    return url


@click.command("watch")
@store_and_run(run_help="Run name or id (the agents' run).")
@click.option("--threshold-s", type=float, default=None,
              help="Call a collective pending this long a hang (default: the agents' threshold, half the "
                   "collective timeout).")
@click.option("--poll-s", type=float, default=1.0, show_default=True, help="Seconds between two reads of the store.")
@click.option("--wait-s", type=float, default=120.0, show_default=True,
              help="How long to wait for the store and the run to appear.")
@click.option("--stale-s", type=float, default=None,
              help="No heartbeat from a rank that did not end for this long: the job is gone (default: 10 "
                   "heartbeat intervals, at least 30 s).")
@click.option("--json", "as_json", is_flag=True, help="Print the hang report as JSON.")
@click.option("--debug-server", "debug_server", default=None, metavar="URL",
              help="The job's torch debug server (torch.distributed.debug.start_debug_server, e.g. "
                   "http://host:25999): every rank's stacks and Flight Recorder are read from it; when every "
                   "rank has been still past the threshold (--threshold-s, else the agents', else 30 s) with a "
                   "collective in flight, they are stored in the run (created if missing) and the hang report "
                   "written. Works for a job without graphdeck's agent too.")
def watch_cmd(store: str, run_name: str, threshold_s: float | None, poll_s: float, wait_s: float,
              stale_s: float | None, as_json: bool, debug_server: str | None) -> None:
    """Follow a running captured job: each rank's step and collectives per group as its heartbeat
    gives them, and the hang report the moment one is written (the agents write it while the job
    still hangs; with ``--threshold-s`` the watch also computes it itself from what the ranks
    stored). Never signals the job. Exit 0: every rank ended healthy (closed or exited); 1: a hang
    report; 2: bad input (no store or run within ``--wait-s``); 3: the ranks stopped beating
    without ending and without a hang report (the job died, or froze holding the GIL)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks import live
    from graphdeck.cli_common import _store_arg
    from graphdeck.store.db import display_url, open_engine
    from graphdeck.store.schema import Run

    store = _store_arg(store)
    debug = DebugServer(_debug_url(debug_server)) if debug_server else None
    start = time.time()
    engine, run_id, world = None, None, None
    if debug is not None:  # a job without the agent has no run: the watch makes it
        from graphdeck.store.db import get_or_create_run, write_session

        try:
            with write_session(open_engine(store)) as s:
                get_or_create_run(s, run_name, meta={"source": "torch.distributed.debug"})
        except GraphdeckError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
    while run_id is None:
        try:
            engine = engine or open_engine(store, read_only=True, create=False)
            with Session(engine) as s:
                run = s.scalar(select(Run).where(Run.name == run_name))
                if run is None and run_name.isdigit():
                    run = s.get(Run, int(run_name))
                if run is not None:
                    run_id, world = run.id, run.world_size
        except GraphdeckError:
            engine = None
        except Exception:  # noqa: BLE001 - a store being created by the job right now
            engine = None
        if run_id is None:
            if time.time() - start > wait_s:
                click.echo(f"error: run {run_name!r} did not appear in {display_url(store)} within {wait_s:g} s",
                           err=True)
                sys.exit(2)
            time.sleep(poll_s)
    click.echo(f"watching run {run_name!r} in {display_url(store)}")
    shown: list[str] = []
    stall_seen: float | None = None
    while True:
        now = time.time()
        with Session(engine) as s:
            beats = live.heartbeats(s, run_id)
            report = live.stored_report(s, run_id)
        stall = _stalled(beats, now, threshold_s) if report is None else None
        if debug is not None and report is None:
            report = _debug_poll(debug, store, run_id, beats, now, threshold_s)
            if debug.answered_at is None and now - start > wait_s:
                click.echo(f"error: the debug server {debug.url} did not answer within {wait_s:g} s ({debug.error})",
                           err=True)
                sys.exit(2)
            if report is None and debug.error and debug.answered_at is not None \
                    and now - debug.answered_at > live.stale_limit_s(beats, stale_s) and not beats:
                click.echo(f"the debug server stopped answering ({debug.error}) for "
                           f"{now - debug.answered_at:.0f} s without a hang: the job ended (no heartbeat says how)",
                           err=True)
                sys.exit(3)
        if stall and report is None:
            interval = max((float(b.get("interval_s") or 0) for b in beats.values()), default=1.0)
            if stall_seen is None:
                stall_seen = now
                if stall is not True:  # seen by the watch alone: the agents are asked for their evidence
                    try:
                        live.request_evidence(open_engine(store, create=False), run_id, stall, poll_s, threshold_s)
                        click.echo(f"collective #{stall['seq']} of group {stall['group']} in flight "
                                   f"{stall['for_s']:.0f} s: asked the ranks for their stacks and recorder")
                    except Exception as exc:  # noqa: BLE001 - a store the watch cannot write: its own report
                        click.echo(f"could not ask the ranks ({type(exc).__name__}: {exc})", err=True)
            if now - stall_seen > 6 * interval + 2:  # no report from the agents: the watch's own, from the store
                with Session(engine) as s:
                    report = live.live_hang(s, run_id, detected_at=stall_seen, threshold_s=threshold_s).to_dict()
                report["by"] = "graphdeck watch"
        if report is not None:
            click.echo(json.dumps(report, indent=1, default=str) if as_json else "\n".join(report["lines"]))
            written = report.get("written_at")
            if written and not as_json:
                click.echo(f"(report written {time.strftime('%H:%M:%S', time.localtime(written))}"
                           f"{'' if report.get('by') else ' by the agents'}; graphdeck does not stop the job)")
            sys.exit(1)
        lines = live.progress_lines(beats, now)
        if [ln.split("; beat")[0] for ln in lines] != [ln.split("; beat")[0] for ln in shown]:
            click.echo("\n".join(lines))
            shown = lines
        if beats and len(beats) >= (world or 1) and all(b.get("ended") for b in beats.values()):
            click.echo("run ended healthy: every rank closed")
            sys.exit(0)
        limit = live.stale_limit_s(beats, stale_s)
        if beats and all(b.get("ended") or now - float(b.get("t") or now) > limit for b in beats.values()):
            click.echo(f"the ranks stopped beating (none for {limit:g} s) without ending and without a hang report: "
                       "the job died (or froze holding the GIL)", err=True)
            sys.exit(3)
        time.sleep(poll_s)


#: The threshold of a watch of the debug server alone (no --threshold-s, no agents' heartbeats).
DEBUG_THRESHOLD_S = 30.0


def _debug_poll(debug: DebugServer, store: str, run_id: int, beats: dict, now: float,
                threshold_s: float | None) -> dict | None:
    """One read of the debug server; when the ranks are stalled past the threshold, their stacks
    and recorders are stored and the hang report written: returned (else None)."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks import live
    from graphdeck.store.db import open_engine

    if not debug.poll(now):
        return None
    thr = threshold_s or next((float(b["threshold_s"]) for b in beats.values() if b.get("threshold_s")), None) \
        or DEBUG_THRESHOLD_S
    stall = debug.stalled(now, thr)
    if stall is None:
        return None
    engine = open_engine(store, create=False)
    debug.store(engine, run_id)
    live.write_hang_report(engine, run_id, rank=min(debug.dumps or debug.stacks), detected_at=now, threshold_s=thr)
    with Session(engine) as s:
        report = live.stored_report(s, run_id)
    if report is not None:
        report["by"] = f"graphdeck watch (torch debug server {debug.url})"
    return report


COMMANDS = (watch_cmd,)
