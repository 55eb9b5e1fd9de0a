"""graphdeck: a debugger for compiled graphs in distributed PyTorch training."""

__version__ = "0.1.0"
