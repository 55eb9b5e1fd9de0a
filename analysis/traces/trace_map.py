"""The old import path of :mod:`graphdeck.analysis.traces.mapping` (``docs/traces.md`` named it before
issue 37 dropped the package prefix from module names); kept for users' code. Importing it gives
the same module object, with a ``DeprecationWarning``."""

import sys
import warnings

from graphdeck.analysis.traces import mapping as _mapping

warnings.warn("graphdeck.analysis.traces.trace_map is now graphdeck.analysis.traces.mapping",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _mapping
