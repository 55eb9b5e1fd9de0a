"""graphdeck: a debugger for compiled graphs in distributed PyTorch training."""

__version__ = "0.1.0"


def _source_tree_path() -> None:
    """Make ``graphdeck.store``, ``graphdeck.analysis``... importable when this package is the
    ``graphdeck/`` folder of a source tree, whose sub-packages live beside it (pyproject.toml's
    ``package-dir``: ``graphdeck.store`` is ``store/``...).

    # NOTE: [Running from the repository root] ``python -m graphdeck.cli`` run in the repository
    # root puts the root first on ``sys.path``, so its ``graphdeck/`` folder shadows an installed
    # (non-editable) graphdeck, and that folder holds no ``store/``: ``No module named
    # 'graphdeck.store'``. An editable install maps the sub-packages with a finder of its own;
    # without one, the root itself is added to this package's ``__path__`` so every
    # ``graphdeck.X`` resolves to the root's ``X/``, the same files the install was built from.
    # An installed copy (sub-packages inside it) is left as it is."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "store")):
        return  # an installed package: its sub-packages are inside it
    if os.path.isfile(os.path.join(root, "store", "schema.py")) and os.path.isdir(os.path.join(root, "analysis")):
        if root not in __path__:
            __path__.append(root)


_source_tree_path()


def __getattr__(name: str):
    """``from graphdeck import validate_backward`` / ``graphdeck.open`` import the analysis (and
    torch, pandas) only when used."""
    if name == "validate_backward":
        from graphdeck.analysis.gradients.core import validate_backward

        return validate_backward
    if name == "open":  # graphdeck.open(store): the notebook API (graphdeck.notebook)
        from graphdeck.notebook import open as open_store

        return open_store
    raise AttributeError(f"module 'graphdeck' has no attribute {name!r}")
