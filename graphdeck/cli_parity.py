"""``graphdeck parity``: a sharded run against its unsharded reference, one optimizer step
(issue 35, item 3; analysis in graphdeck/analysis/gradients/parity.py, evidence NOTE: [Parity
evidence] in capture/parity.py). Registered on the ``graphdeck`` group by
graphdeck/cli.py (:data:`COMMANDS`).

Two forms:

* ``graphdeck parity RUN_A RUN_B --store S``: compare two stored runs (RUN_A sharded, RUN_B the
  reference), both recorded with parity evidence;
* ``graphdeck parity --store S [--nproc N] [--step K] [--run NAME] -- script.py ARGS``: run the
  script twice under torchrun, at N ranks (``NAME-sharded``) and at 1 rank (``NAME-reference``),
  with parity evidence on at step K, then compare them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from graphdeck.cli_common import DEFAULT_STORE, _fail, _store_arg
from graphdeck.errors import GraphdeckError


@click.command("parity", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--store", default=DEFAULT_STORE, show_default=True, help="SQLite path or URL: the runs' store.")
@click.option("--nproc", type=click.IntRange(min=2), default=2, show_default=True,
              help="Launch form: ranks of the sharded run (the reference runs at 1).")
@click.option("--step", type=click.IntRange(min=0), default=0, show_default=True,
              help="Launch form: the optimizer step recorded (0: the first).")
@click.option("--run", "run_name", default=None,
              help="Launch form: name of the run pair (NAME-sharded, NAME-reference); default parity-<time>.")
@click.option("--max-elements", "max_elements", type=click.IntRange(min=0), default=None,
              help="Launch form: store values of tensors up to this many local elements (default 65536); "
                   "larger ones keep a norm only (compared by norm: a differing norm is a FAIL, an agreeing "
                   "one is INCOMPLETE).")
@click.option("--allow-incomplete", "allow_incomplete", is_flag=True,
              help="Exit 0 when nothing differs although something could not be compared.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--output", "-o", "output", type=click.Path(dir_okay=False), default=None,
              help="Write the report to this file (text still goes to stdout).")
def parity_cmd(args: tuple[str, ...], store: str, nproc: int, step: int, run_name: str | None,
               max_elements: int | None, allow_incomplete: bool, fmt: str, output: str | None) -> None:
    """Reference parity: the same model and batch, sharded and unsharded, one optimizer step.

    Per parameter the gradient difference (sharded gradients made whole from their recorded
    placements) and the first backward node whose value differs, with its forward source line.
    RUN_A RUN_B --store S compares two stored runs; -- script.py ARGS launches the pair.
    Exit 0 PASS, 1 FAIL (a gradient differs beyond its dtype's tolerance), 3 INCOMPLETE (evidence
    missing or not comparable; --allow-incomplete: 0), 2 bad input.
    """
    from graphdeck.errors import UsageError

    try:
        store = _store_arg(store)
        launch = bool(args) and (args[0] == "-m" or args[0].endswith(".py") or Path(args[0]).is_file())
        if launch:
            run_a, run_b = _launch(args, store, nproc, step, run_name, max_elements)
        elif len(args) == 2:
            if run_name or max_elements is not None or step or nproc != 2:
                raise UsageError("--run, --step, --nproc and --max-elements apply to the launch form "
                                 "(graphdeck parity --store S -- script.py ARGS)")
            run_a, run_b = args
        else:
            raise UsageError("give two stored runs (graphdeck parity RUN_A RUN_B --store S) or a script "
                             "(graphdeck parity --store S --nproc N -- script.py ARGS)")
        report = _report(store, run_a, run_b)
    except GraphdeckError as exc:
        _fail(exc)
    text = report.to_json() if fmt == "json" else report.to_text()
    if output:
        try:
            Path(output).write_text(text + "\n")
        except OSError as exc:
            _fail(UsageError(f"cannot write the report to {output}: {exc.strerror or exc}"))
        click.echo(report.to_text() if fmt != "text" else text)
    else:
        click.echo(text)
    code = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}[report.verdict]
    sys.exit(0 if code == 3 and allow_incomplete else code)


def _report(store: str, run_a: str, run_b: str):
    from sqlalchemy.orm import Session

    from graphdeck.analysis.gradients.core import find_run
    from graphdeck.analysis.gradients.parity import parity_report
    from graphdeck.errors import NotFoundError
    from graphdeck.store.db import open_engine

    if "://" not in store and not Path(store).exists():
        raise NotFoundError(f"store {store} not found")
    with Session(open_engine(store, read_only=True)) as s:
        return parity_report(s, find_run(s, run_a), find_run(s, run_b))


def _launch(args: tuple[str, ...], store: str, nproc: int, step: int, run_name: str | None,
            max_elements: int | None) -> tuple[str, str]:
    """Run the script at ``nproc`` ranks and at 1 rank with parity evidence on; the two run names.
    Raises UsageError when a run of that name exists or a job fails."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.capture.parity import DEFAULT_MAX_ELEMENTS
    from graphdeck.errors import UsageError
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    prefix = run_name or time.strftime("parity-%Y%m%d-%H%M%S")
    names = (f"{prefix}-sharded", f"{prefix}-reference")
    with Session(open_engine(store)) as s:
        taken = [n for n in names if s.scalar(select(Run.id).where(Run.name == n)) is not None]
    if taken:
        raise UsageError(f"run {taken[0]!r} exists in {store}: give another --run, or delete it "
                         f"(graphdeck delete-run {store} --run {taken[0]})")
    cap = DEFAULT_MAX_ELEMENTS if max_elements is None else max_elements
    for name, role, n in ((names[0], "sharded", nproc), (names[1], "reference", 1)):
        env = dict(os.environ, GRAPHDECK_PARITY=f"{step},{cap}", GRAPHDECK_PARITY_ROLE=role,
                   GRAPHDECK_PARITY_STORE=store, GRAPHDECK_PARITY_RUN=name)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
        click.echo(f"[graphdeck] parity: {role} run {name!r} at {n} rank{'s' if n > 1 else ''}: "
                   + " ".join(args), err=True)
        import subprocess  # not at import: a command that starts nothing does not load it (issue 41 goal 4)

        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "")[-4000:]
            raise UsageError(f"the {role} run ({n} rank{'s' if n > 1 else ''}) exited with status "
                             f"{proc.returncode}; the script must run at world size 1 too (size its mesh from "
                             f"the world size):\n{tail}")
    return names


COMMANDS = (parity_cmd,)
