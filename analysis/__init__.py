"""graphdeck.analysis: the checks and analyses, grouped by concern in the packages ``gradients``,
``traces``, ``ranks`` and ``memory`` (each re-exports its public names lazily: :func:`lazy_exports`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, public: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` (PEP 562): each name of ``public`` (name → the
    package's module that defines it) is imported from that module on first use, so importing the
    package loads none of them. Raises ``AttributeError`` for any other name."""

    def __getattr__(name: str):
        if name in public:
            return getattr(importlib.import_module(f"{package}.{public[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
