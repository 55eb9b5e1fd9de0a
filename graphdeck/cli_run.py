"""``graphdeck run [--store S] [--run NAME] [--profile-steps A:B] [--no-evidence] -- COMMAND...``:
run COMMAND (torchrun, python, a shell script...) with the capture agent in every Python process
it starts, without a line of the training code changed (NOTE: [Capture without code] in
capture/autorun.py). Registered through its ``COMMANDS`` (graphdeck/cli.py's ``COMMAND_MODULES``).

# NOTE: [How graphdeck run reaches every process]
# The command runs as a child with a temporary directory first on ``PYTHONPATH`` that holds one
# ``sitecustomize.py`` (:data:`SITECUSTOMIZE`): every Python interpreter started under it (the
# launcher, each rank, a data-loader worker started by spawn) runs it at start-up and installs the
# import hook of ``graphdeck.capture.autorun``, which imports no torch. The file then runs the
# ``sitecustomize`` that was on the path before (a distribution's or the user's): found on the
# path without this directory, executed under the same name. Settings travel as environment
# variables (``GRAPHDECK_RUN_*``), so launchers pass them on untouched. ``TORCH_FR_BUFFER_SIZE``
# is set here (unless set), so the Flight Recorder is on before any process group exists.
# ``graphdeck run`` exits with the command's status (128+N when a signal N ended it) and passes
# SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2 on to it; SIGINT too, unless it came from the terminal
# (both in its foreground process group: the command got it already).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import click

from graphdeck.cli_common import looks_like_store

#: The file ``graphdeck run`` puts first on ``PYTHONPATH`` (NOTE: [How graphdeck run reaches every process]).
SITECUSTOMIZE = '''"""graphdeck run's start-up hook (graphdeck/cli_run.py); then the sitecustomize it hides."""
import os as _os
import sys as _sys

try:
    from graphdeck.capture.autorun import install as _install

    _install()
except Exception as _exc:  # a Python without graphdeck (another venv): it runs without capture
    _sys.stderr.write(f"graphdeck run: no capture in {_sys.executable}: {type(_exc).__name__}: {_exc}\\n")


def _chain():
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        _sys.modules["sitecustomize"] = mod
        spec.loader.exec_module(mod)


_chain()
'''

FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGINT")


def run_env(store: str, run: str, profile_steps: str | None, evidence: bool, site_dir: str,
            base: dict | None = None, append: bool = False) -> dict:
    """The command's environment: ``base`` (default ``os.environ``) with ``site_dir`` first on
    ``PYTHONPATH`` and the ``GRAPHDECK_RUN_*`` settings; a SQLite path is made absolute (a rank
    may change directory). ``GRAPHDECK_LAUNCH``: a new UUID, so every process of this command is
    one launch (NOTE: [One run per launch]); ``append``: ``GRAPHDECK_RUN_APPEND=1``."""
    import uuid

    from graphdeck.capture import autorun
    from graphdeck.capture.launch import ENV_APPEND, ENV_LAUNCH
    from graphdeck.capture.flight import DEFAULT_BUFFER
    from graphdeck.capture.flight import ENV as FR_ENV

    env = dict(os.environ if base is None else base)
    if "://" not in store:
        store = os.path.abspath(store)
    env["PYTHONPATH"] = os.pathsep.join([site_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[autorun.ENV_STORE], env[autorun.ENV_NAME] = store, run
    env[autorun.ENV_PROFILE] = profile_steps or ""
    env[autorun.ENV_EVIDENCE] = "1" if evidence else "0"
    env.setdefault(FR_ENV, str(DEFAULT_BUFFER))
    env[ENV_LAUNCH] = uuid.uuid4().hex
    if append:
        env[ENV_APPEND] = "1"
    return env


def _from_terminal() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False


def run_command(command: list[str], env: dict) -> int:
    """Run ``command`` with ``env``, forwarding signals; its exit status (128+N for signal N)."""
    import subprocess  # not at import: the other commands do not load it (issue 41 goal 4)

    proc = subprocess.Popen(command, env=env)
    previous = {}

    def forward(signum, _frame):
        if signum == signal.SIGINT and _from_terminal():
            return  # the terminal sent it to the command too
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--store", default="graphdeck.db", show_default=True, help="SQLite path or SQLAlchemy URL.")
@click.option("--run", "run_name", default=None, help="Run name, the same on every rank (default: run-<time>).")
@click.option("--profile-steps", default=None, metavar="A:B",
              help="Profile optimizer steps A..B-1 (0-based, A >= 1; e.g. 2:4) and store the trace per rank.")
@click.option("--no-evidence", is_flag=True, help="No per-step gradient evidence (graphs, layout, FR still).")
@click.option("--append", is_flag=True,
              help="Add to run --run even when another launch made it (default: this launch records as NAME-2).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(store, run_name, profile_steps, no_evidence, append, command):
    """Run COMMAND (after --) with graphdeck's capture in every Python process it starts.

    Example: graphdeck run --store runs.db --run exp1 -- torchrun --nproc_per_node 2 train.py"""
    from graphdeck.capture.autorun import parse_steps

    try:
        parse_steps(profile_steps)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--profile-steps") from None
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise click.UsageError("no command given (graphdeck run [OPTIONS] -- COMMAND...)")
    if looks_like_store(command[0]) and shutil.which(command[0]) is None:
        raise click.UsageError(f"{command[0]} is a store, not a command: graphdeck run takes the store as an option, "
                               f"before the command: graphdeck run --store {command[0]} [--run NAME] -- COMMAND...")
    if shutil.which(command[0]) is None and not os.path.exists(command[0]):
        raise click.UsageError(f"command not found: {command[0]}")
    import tempfile

    site_dir = tempfile.mkdtemp(prefix="graphdeck-run-")
    try:
        with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        env = run_env(store, run_name or time.strftime("run-%Y%m%d-%H%M%S"), profile_steps, not no_evidence, site_dir,
                      append=append)
        rc = run_command(command, env)
    finally:
        shutil.rmtree(site_dir, ignore_errors=True)
    sys.exit(rc)


COMMANDS = [run]
