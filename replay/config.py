"""The executor's config file (``graphdeck replay RUN GRAPH --config executor.json``).

Format (JSON, one object; every key of ``executor`` optional, no other key allowed)::

    {"executor": {"num_workers": 8,                          # int >= 1: pipeline stages, one process each
                  "graph_partition_strategy": "auto",        # "auto" | "layerwise" | "memory_aware"
                  "pipeline_microbatch_size": 4,             # int >= 1: batch rows per microbatch
                  "communication_backend": "gloo",           # "gloo" | "nccl"
                  "enable_heterogeneous_fusion": true}}      # bool (NOTE: [Heterogeneous fusion])

The keys are the design notes' names of the ``replay`` flags ``--workers``, ``--strategy``,
``--microbatch-size``, ``--backend`` and ``--heterogeneous-fusion/--no-heterogeneous-fusion``.
Precedence: a flag given on the command line > the file > the flag's default.

Validation is pydantic's (``extra="forbid"``, strict types: ``8.0`` or ``"8"`` is not an int,
``1`` is not a bool); every problem is reported in one :class:`~graphdeck.errors.UsageError`
whose message names the key (``executor.num_workers: ...``), an unknown key, or the missing
``executor`` object.

# NOTE: [Heterogeneous fusion]
The executor runs a stage on one device. A stored graph whose compute nodes were recorded on
more than one device type (a CUDA graph with CPU-side work, ``_to_copy`` to ``cpu`` and back)
has *segments*: maximal runs of compute nodes, in graph order, recorded on one device type.
``enable_heterogeneous_fusion: true`` fuses them: every segment runs on the replay ``--device``
inside the stage the strategy gives it (device arguments are mapped to that device, so the
copies between segments become same-device copies), and the summary lists the fused segments
with their stages. It can mean nothing, and is refused with the reason, when the graph's compute
nodes were all recorded on one device type. ``false`` refuses a mixed graph (it cannot be run
without fusing its segments here: per-segment device placement is not implemented); absent
keeps the default, which fuses without reporting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from graphdeck.errors import UsageError

# config key -> replay() keyword argument (and the CLI flag's parameter name)
KEYS = {"num_workers": "workers", "graph_partition_strategy": "strategy",
        "pipeline_microbatch_size": "microbatch_size", "communication_backend": "backend",
        "enable_heterogeneous_fusion": "heterogeneous_fusion"}


def _models():
    from pydantic import BaseModel, ConfigDict, Field

    class ExecutorSettings(BaseModel):
        """The ``executor`` object. Unset keys stay None (``model_fields_set`` says which were given)."""

        model_config = ConfigDict(extra="forbid", strict=True)
        num_workers: int = Field(None, ge=1, description="pipeline stages, one worker process each")
        graph_partition_strategy: Literal["auto", "layerwise", "memory_aware"] = Field(None)
        pipeline_microbatch_size: int = Field(None, ge=1, description="batch rows per microbatch")
        communication_backend: Literal["gloo", "nccl"] = Field(None)
        enable_heterogeneous_fusion: bool = Field(None)

    class ConfigFile(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        executor: ExecutorSettings

    return ConfigFile


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _describe(err: dict) -> str:
    loc, kind = tuple(err.get("loc", ())), err.get("type", "")
    if kind == "extra_forbidden":
        parent = "executor" if loc[:1] == ("executor",) else "the top level"
        allowed = ", ".join(KEYS) if parent == "executor" else "executor"
        return f"unknown key {_where(loc)!r} in {parent} (allowed: {allowed})"
    if kind == "missing" and loc == ("executor",):
        return "missing the \"executor\" object: the file must be {\"executor\": {...}}"
    if kind == "json_invalid":
        return f"not JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
    if kind == "model_type" and not loc:
        return "the file must hold a JSON object {\"executor\": {...}}"
    return f"{_where(loc)}: {err.get('msg')} (got {err.get('input')!r})"


def parse_config(text: str, *, source: str = "config") -> dict:
    """The given keys of a config text as ``replay()`` keyword arguments (``{"workers": 8, ...}``).

    Raises UsageError naming every bad key, type or value, an unknown key, or a missing
    ``executor`` object (``source`` prefixes the message)."""
    try:
        from pydantic import ValidationError
    except ImportError as exc:  # pydantic comes with the server extra (FastAPI)
        raise UsageError("--config needs pydantic: pip install 'graphdeck[server]'") from exc
    try:
        cfg = _models().model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in exc.errors())
        raise UsageError(f"{source}: {problems}") from None
    ex = cfg.executor
    return {KEYS[k]: getattr(ex, k) for k in KEYS if k in ex.model_fields_set}


def load_config(path: str | Path) -> dict:
    """:func:`parse_config` of the file at ``path``. Raises UsageError (unreadable file, bad config)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc})") from None
    return parse_config(text, source=f"--config {path}")


def merge(config: dict, flags: dict, given: set[str]) -> dict:
    """The settings a replay runs with: ``flags`` (parameter name → value, defaults included)
    overridden by ``config``, itself overridden by the flags in ``given`` (given on the command
    line). Returns a new dict of replay() keyword arguments."""
    out = dict(flags)
    for key, value in config.items():
        if key not in given:
            out[key] = value
    return out
