"""The old import path of :mod:`graphdeck.analysis.gradients.report` (``docs/check-grads.md`` named it
before issue 37 dropped the package prefix from module names); kept for users' code. Importing it
gives the same module object, with a ``DeprecationWarning``."""

import sys
import warnings

from graphdeck.analysis.gradients import report as _report

warnings.warn("graphdeck.analysis.gradients.grad_report is now graphdeck.analysis.gradients.report",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _report
