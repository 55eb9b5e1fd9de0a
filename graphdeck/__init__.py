"""graphdeck: a debugger for compiled graphs in distributed PyTorch training."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``from graphdeck import validate_backward`` imports the analysis (and torch) only when used."""
    if name == "validate_backward":
        from graphdeck.analysis.gradients import validate_backward

        return validate_backward
    raise AttributeError(f"module 'graphdeck' has no attribute {name!r}")
