"""``graphdeck import`` held at a declared seam, for a test to SIGKILL it there.

Usage: ``python tests/programs/killed_import.py ARGS...`` (the arguments of ``graphdeck import``).

The real CLI runs the real import into the real store; the one seam: when the import is about to
read its second log (the first rank's rows committed, as a long import leaves them), it prints
``holding`` and sleeps, so the test can kill it there (between ranks, as a kill mid-way leaves a
store).
"""

from __future__ import annotations

import sys
import time

import graphdeck.store.torch_trace as tt
from graphdeck.cli import main

_orig = tt._import_file
_files = []


def _held(*args, **kwargs):
    if _files:
        print("holding", flush=True)
        time.sleep(600)
    _files.append(args[2])
    return _orig(*args, **kwargs)


tt._import_file = _held
sys.exit(main(["import", *sys.argv[1:]]))
