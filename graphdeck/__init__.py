"""graphdeck: a debugger for compiled graphs in distributed PyTorch training."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``from graphdeck import validate_backward`` / ``graphdeck.open`` import the analysis (and
    torch, pandas) only when used."""
    if name == "validate_backward":
        from graphdeck.analysis.gradients import validate_backward

        return validate_backward
    if name == "open":  # graphdeck.open(store): the notebook API (graphdeck.notebook)
        from graphdeck.notebook import open as open_store

        return open_store
    raise AttributeError(f"module 'graphdeck' has no attribute {name!r}")
