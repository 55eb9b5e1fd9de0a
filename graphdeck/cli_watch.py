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
def watch_cmd(store: str, run_name: str, threshold_s: float | None, poll_s: float, wait_s: float,
              stale_s: float | None, as_json: bool) -> None:
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
    start = time.time()
    engine, run_id, world = None, None, None
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
        if stall:
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


COMMANDS = (watch_cmd,)
