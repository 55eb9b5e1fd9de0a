"""Compile health of a run, per rank and in total (issue 21 item 1; ``graphdeck check-compile``,
``GET /api/runs/{id}/compile-health``, the run page's "Compile health" panel).

# NOTE: [Compile health]
From the compile records the TORCH_TRACE import and the capture agent store (``compile_events``:
``dynamo_start``, ``compilation_metrics``, ``bwd_compilation_metrics``,
``dynamo_graph_break_reason``, ``recompile_reasons``, ``dynamo_error`` and the FX/AOT cache
artifacts; texts read by :mod:`graphdeck.analysis.compilation.rules`):

* graph breaks, grouped by (reason class, source line) and counted, each with the compiled frames
  it hit, the user frame of the traceback and a hint. Breaks inside torch or the standard library
  (DDP's intended breaks) are kept apart (``library``) and not counted by ``--max-graph-breaks``;
  nor are breaks inside an installed framework (``framework``: transformers' logging call), which
  are named as that framework's (NOTE: [Framework graph breaks] in rules.py);
* recompiles per code object (Dynamo's ``frame_id``; label ``name (file.py:line)``): compiles
  used vs the ``recompile_limit`` in force (read from the records' ``dynamo_config``, else
  torch's default 8, said as assumed), the guard that failed at each recompile, the same guard
  failing again and again (a storm: 3 or more times), the classes (shape, grad mode, dtype,
  Python value, ...) that consumed the budget, and a hint. A frame that has not hit the limit yet
  is projected to hit it when a Python value is specialised (every new value is a new graph;
  limits up to 64) or when a shape guard storms and half the budget is spent;
* frames that fell back to eager (recompile limit hit, a graph break Dynamo could not handle,
  a failed compile) and restarts;
* compile time and cache hits/misses per rank (Inductor FX graph cache and AOTAutograd cache,
  local and remote, from the metrics' counters, else from the cache artifacts) and their spread;
* compiled DDP whose one backward graph feeds several gradient buckets, so no all-reduce can
  overlap the backward (``ddp_overlap``; NOTE: [DDP overlap by construction] in ddp_overlap.py),
  with its cost measured from a trace where one exists.

Verdict: FAIL when a threshold is passed; else INCOMPLETE when evidence is missing (a rank of the
run without compile records, records dropped on import, a compile started and never finished);
else WARN when no gate covers a hit recompile limit, an eager fallback or a failed compile, or
when compiled DDP cannot overlap its communication (a performance finding, never a FAIL); else
PASS. Pure: reads the store, returns data.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.compilation.rules import (
    GUARD_HINTS,
    failure_kind,
    frame_label,
    guard_class,
    guard_key,
    guard_source,
    guard_text,
    parse_break,
    split_reasons,
)
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import CompileEvent, Rank, Run

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads

#: torch._dynamo.config.recompile_limit's default (torch 2.13; ``cache_size_limit`` before 2.6).
DEFAULT_RECOMPILE_LIMIT = 8
STORM_MIN = 3
#: A frame specialising on a Python value is projected to hit a limit up to this size.
PROJECT_LIMIT_MAX = 64
CACHE_ARTIFACTS = {"fx_graph_cache_hit": ("fx_graph", "hit"), "fx_graph_cache_miss": ("fx_graph", "miss"),
                   "fx_graph_cache_bypass": ("fx_graph", "bypass"),
                   "aotautograd_cache_hit": ("aot_autograd", "hit"), "aotautograd_cache_miss": ("aot_autograd", "miss"),
                   "aotautograd_cache_bypass": ("aot_autograd", "bypass")}
METRICS = ("compilation_metrics", "bwd_compilation_metrics")
EVENTS = (*METRICS, "dynamo_start", "dynamo_graph_break_reason", "recompile_reasons", "dynamo_error",
          *CACHE_ARTIFACTS)
_CID_RE = re.compile(r"^(!\d+/)?(\d+)/(\d+)(?:_(\d+))?$")


@dataclass
class Thresholds:
    """CI gates; None = not checked. ``max_graph_breaks`` counts distinct user-code breaks."""

    max_graph_breaks: int | None = None
    max_recompiles_per_frame: int | None = None
    fail_on_eager_fallback: bool = False
    fail_on_ddp_no_overlap: bool = False  # compiled DDP that cannot overlap its all-reduces (ddp_overlap.py)

    def __post_init__(self) -> None:
        for name in ("max_graph_breaks", "max_recompiles_per_frame"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0 (got {v!r})")


@dataclass
class BreakGroup:
    reason_class: str
    source_line: str | None
    headline: str
    hint: str
    count: int = 0
    library: bool = False
    framework: str | None = None  # the installed package the break is in (NOTE: [Framework graph breaks])
    user_frame: str | None = None
    gb: str | None = None
    eager_fallback: bool = False
    frames: list[str] = field(default_factory=list)
    compile_ids: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    file: str | None = None


@dataclass
class FrameBudget:
    """One code object's compiles on one rank (or, in ``total``, the worst rank's)."""

    frame: str
    frame_id: str
    file: str | None
    compiles: int = 0  # compile ids of the frame (attempts merged)
    recompiles: int = 0  # compile ids f/c with c > 0
    used: int = 0  # compiles that took a cache entry (not refused by the limit)
    limit: int = DEFAULT_RECOMPILE_LIMIT
    limit_source: str = "assumed: torch's default recompile_limit (no dynamo_config recorded)"
    limit_hit: bool = False
    will_hit_limit: bool = False
    steps: list[dict] = field(default_factory=list)  # per recompile: compile_id, failed guard, classes
    guards: list[dict] = field(default_factory=list)  # {guard, class, count, storm, example}
    classes: dict[str, int] = field(default_factory=dict)
    hint: str | None = None
    ranks: list[int] = field(default_factory=list)
    # merged frames (``CompileHealth.frames``): each rank's own numbers, ``{rank: {"compiles",
    # "recompiles", "used"}}`` — the fields above are the worst rank's (``worst_rank``); text,
    # JSON and the page read the others from here, never from the worst rank's fields.
    per_rank: dict[int, dict] = field(default_factory=dict)
    worst_rank: int | None = None


@dataclass
class Fallback:
    rank: int
    compile_id: str
    frame: str
    kind: str  # "recompile limit" | "graph break not handled" | "compile error"
    fail_type: str | None
    reason: str


@dataclass
class RankStats:
    rank: int
    compiles: int = 0
    #: seconds compiling, frames and backward graphs: ``frame_compile_s`` (``compilation_metrics``,
    #: a frame's forward compile, what the compile index and frame metrics count) plus
    #: ``bwd_compile_s`` (``bwd_compilation_metrics``: a backward compiled lazily, at its first run)
    compile_s: float = 0.0
    frame_compile_s: float = 0.0
    bwd_compile_s: float = 0.0
    cache: dict = field(default_factory=lambda: {k: {"hit": 0, "miss": 0, "bypass": 0} for k in
                                                 ("fx_graph", "fx_graph_remote", "aot_autograd", "aot_autograd_remote")})
    cache_source: str = "none recorded"

    def hit_rate(self, key: str) -> float | None:
        c = self.cache[key]
        n = c["hit"] + c["miss"]
        return c["hit"] / n if n else None


@dataclass
class RankHealth:
    rank: int
    breaks: list[BreakGroup] = field(default_factory=list)
    frames: list[FrameBudget] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    stats: RankStats | None = None


@dataclass
class CompileHealth:
    run: str
    run_id: int
    ranks: dict[int, RankHealth]
    breaks: list[BreakGroup]  # all ranks, merged by (class, source line)
    frames: list[FrameBudget]  # all ranks, merged by frame label (the most compiles of any rank)
    fallbacks: list[Fallback]
    spread: dict
    missing_evidence: list[str]
    thresholds: Thresholds
    findings: list[str] = field(default_factory=list)  # threshold failures
    ddp_overlap: list = field(default_factory=list)  # NoOverlap (analysis.compilation.ddp_overlap), one per compiled frame
    warnings: list[str] = field(default_factory=list)  # what no gate was given for but a user must see
    unverified: list[str] = field(default_factory=list)  # records read though their md5 failed
    no_graph: object = None  # NoGraph (analysis.compilation.no_graph): ranks where nothing was compiled
    verdict: str = "PASS"

    @property
    def user_breaks(self) -> list[BreakGroup]:
        return [b for b in self.breaks if not b.library and not b.framework]

    @property
    def framework_breaks(self) -> list[BreakGroup]:
        return [b for b in self.breaks if b.framework]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = {str(r): asdict(v) for r, v in self.ranks.items()}
        d["summary"] = self.summary()
        return d

    def summary(self) -> dict:
        return {"graph_breaks": len(self.user_breaks), "graph_break_records": sum(b.count for b in self.breaks),
                "library_breaks": sum(1 for b in self.breaks if b.library),
                "framework_breaks": len(self.framework_breaks),
                "frameworks": sorted({b.framework for b in self.framework_breaks}),
                "frames": len(self.frames), "recompiles": sum(f.recompiles for f in self.frames),
                "max_recompiles_per_frame": max((f.recompiles for f in self.frames), default=0),
                "limit_hit": [f.frame for f in self.frames if f.limit_hit],
                "will_hit_limit": [f.frame for f in self.frames if f.will_hit_limit],
                "eager_fallbacks": len(self.fallbacks),
                "ddp_no_overlap": len(self.ddp_overlap),
                "no_graph_ranks": list(self.no_graph.ranks) if self.no_graph else [],
                "restarts": sum(len(r.restarts) for r in self.ranks.values())}


def _cid(cid: str | None) -> tuple[str, int, int] | None:
    """``"3/2_1"`` → ("3", 2, 1); compiled-autograd ids keep their ``!n/`` prefix in the frame."""
    m = _CID_RE.match(cid or "")
    return ((m.group(1) or "") + m.group(2), int(m.group(3)), int(m.group(4) or 0)) if m else None


def _body(name: str, meta_json: str | None) -> dict:
    try:
        meta = _loads(meta_json or "{}")
    except ValueError:
        return {}
    if not isinstance(meta, dict):
        return {}
    inner = meta.get(name)
    return inner if isinstance(inner, dict) else meta


def _limit_of(body: dict) -> int | None:
    cfg = body.get("dynamo_config")
    if not isinstance(cfg, str) or "limit" not in cfg:
        return None
    try:
        cfg = _loads(cfg)
    except ValueError:
        return None
    for key in ("recompile_limit", "cache_size_limit"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def compile_health(session: Session, run: Run, thresholds: Thresholds | None = None) -> CompileHealth:
    """The run's compile health (NOTE: [Compile health]). Raises NotFoundError for ``run`` None."""
    if run is None:
        raise NotFoundError("compile_health: no such run", resource="run", id=None)
    th = thresholds or Thresholds()
    rows = session.execute(select(CompileEvent.rank, CompileEvent.name, CompileEvent.compile_id,
                                  CompileEvent.metadata_json, CompileEvent.payload)
                           .where(CompileEvent.run_id == run.id, CompileEvent.name.in_(EVENTS))
                           .order_by(CompileEvent.rank, CompileEvent.id)).all()
    per_rank: dict[int, list] = defaultdict(list)
    for r in rows:
        per_rank[r[0]].append(r)
    built = [_rank_health(r, evs) for r, evs in sorted(per_rank.items())]
    healths = [h for _, h, _ in built]
    out = CompileHealth(run=run.name, run_id=run.id, ranks={h.rank: h for h in healths},
                        breaks=_merge_breaks([b for h in healths for b in h.breaks]),
                        frames=_merge_frames([f for h in healths for f in h.frames]),
                        fallbacks=[f for h in healths for f in h.fallbacks],
                        spread=_spread([h.stats for h in healths]),
                        missing_evidence=_missing(session, run, set(per_rank)) + [m for _, _, ms in built for m in ms],
                        thresholds=th)
    from graphdeck.analysis.compilation.ddp_overlap import find as ddp_no_overlap

    out.ddp_overlap = ddp_no_overlap(session, run)
    from graphdeck.analysis.compilation.no_graph import find as no_graph

    out.no_graph = no_graph(session, run, per_rank)
    from graphdeck.analysis.ranks.flight import unverified_evidence

    out.unverified = unverified_evidence(session, run.id)
    _verdict(out)
    return out


def _rank_health(rank: int, events: list) -> tuple[int, RankHealth, list[str]]:
    h = RankHealth(rank=rank, stats=RankStats(rank=rank))
    started: dict[str, dict] = {}  # frame_id -> {"label", "file"}
    compiles: dict[tuple[str, int], dict] = {}  # (frame, compile) -> {"metrics", "reasons", "started"}
    breaks: dict[tuple, BreakGroup] = {}
    limit, limit_src = None, None
    metric_cache = False
    artifact_cache: Counter = Counter()
    for _r, name, cid, meta_json, payload in events:
        key = _cid(cid)
        if name == "dynamo_start" and key:
            stack = _body(name, meta_json).get("stack") or []
            last = stack[-1] if stack and isinstance(stack[-1], dict) else {}
            started.setdefault(key[0], {"name": last.get("name"), "filename": last.get("filename"),
                                        "line": last.get("line")})
            compiles.setdefault(key[:2], {}).setdefault("started", True)
        elif name in METRICS:
            body = _body(name, meta_json)
            t = body.get("duration_us")
            t = t / 1e6 if isinstance(t, (int, float)) else body.get("entire_frame_compile_time_s")
            t = float(t) if isinstance(t, (int, float)) else 0.0
            h.stats.compile_s += t
            if name == "bwd_compilation_metrics":
                h.stats.bwd_compile_s += t
            else:
                h.stats.frame_compile_s += t
            if limit is None and (got := _limit_of(body)) is not None:
                limit, limit_src = got, "recorded (dynamo_config.recompile_limit of the job)"
            for what, where in (("fx_graph", "inductor_fx_{}_cache_{}_count"),
                                ("aot_autograd", "aotautograd_{}_cache_{}_count")):
                for loc, suffix in (("local", ""), ("remote", "_remote")):
                    for kind in ("hit", "miss"):
                        v = body.get(where.format(loc, kind))
                        if isinstance(v, int):
                            metric_cache = True
                            h.stats.cache[what + suffix][kind] += v
            h.stats.compiles += name == "compilation_metrics"
            if name == "compilation_metrics" and key:
                c = compiles.setdefault(key[:2], {})
                c["metrics"] = body
                c.setdefault("cid", cid)
                if body.get("co_name") and key[0] not in started:
                    started[key[0]] = {"name": body.get("co_name"), "filename": body.get("co_filename"),
                                       "line": body.get("co_firstlineno")}
                elif body.get("co_filename") and isinstance(started.get(key[0], {}).get("filename"), int):
                    started[key[0]]["filename"] = body["co_filename"]  # an interned id never resolved
                for why in body.get("restart_reasons") or []:
                    h.restarts.append({"compile_id": cid, "reason": str(why)[:2000]})
        elif name == "recompile_reasons" and key:
            c = compiles.setdefault(key[:2], {})
            c.setdefault("reasons", []).extend(split_reasons(payload))
        elif name == "dynamo_graph_break_reason":
            info = parse_break(payload or "")
            g = breaks.get((info["reason_class"], info["source_line"]))
            if g is None:
                g = breaks[(info["reason_class"], info["source_line"])] = BreakGroup(
                    reason_class=info["reason_class"], source_line=info["source_line"], headline=info["headline"],
                    hint=_framework_hint(info["framework"], info["hint"]), library=info["library"],
                    framework=info["framework"], user_frame=info["user_frame"], gb=info["gb"],
                    file=info["file"], ranks=[rank])
            g.count += 1
            g.eager_fallback = g.eager_fallback or info["eager_fallback"]
            g.compile_ids.append(cid)
            if key:
                g.frames.append(key[0])  # frame ids; labelled below
        elif name == "dynamo_error" and key:
            compiles.setdefault(key[:2], {})["error"] = (payload or "").strip()
        elif name in CACHE_ARTIFACTS:
            artifact_cache[CACHE_ARTIFACTS[name]] += 1
    if not metric_cache and artifact_cache:
        for (what, kind), n in artifact_cache.items():
            h.stats.cache[what][kind] += n
    h.stats.cache_source = ("compilation_metrics counters" if metric_cache
                            else "cache artifacts (fx_graph_cache_*, aotautograd_cache_*)" if artifact_cache
                            else "none recorded")
    labels = {f: frame_label(s.get("name"), s.get("filename"), s.get("line")) for f, s in started.items()}
    files = {f: s.get("filename") if isinstance(s.get("filename"), str) else None for f, s in started.items()}
    for g in breaks.values():
        g.frames = list(dict.fromkeys(labels.get(f, f"frame {f}") for f in g.frames))
    h.breaks = sorted(breaks.values(), key=_break_order)
    h.stats.compiles += sum(1 for c in compiles.values() if c.get("started") and "metrics" not in c)
    missing = [f"rank {rank}: compile {fid}/{n} started (dynamo_start) but has no compilation_metrics record "
               "(the job died mid-compile, or the record was lost)"
               for (fid, n), c in sorted(compiles.items()) if c.get("started") and "metrics" not in c
               and "error" not in c]
    by_frame: dict[str, list] = defaultdict(list)
    for (fid, n), c in sorted(compiles.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        by_frame[fid].append((n, c))
        m = c.get("metrics") or {}
        kind = failure_kind(m.get("fail_type"), m.get("fail_reason")) or ("compile error" if c.get("error") else None)
        if kind:
            h.fallbacks.append(Fallback(rank=rank, compile_id=c.get("cid") or f"{fid}/{n}",
                                        frame=labels.get(fid, f"frame {fid}"), kind=kind,
                                        fail_type=m.get("fail_type") or ("dynamo_error" if c.get("error") else None),
                                        reason=str(m.get("fail_reason") or c.get("error") or "")[:2000]))
    for fid, items in by_frame.items():
        h.frames.append(_budget(rank, fid, labels.get(fid, f"frame {fid}"), files.get(fid), items,
                                limit if limit is not None else DEFAULT_RECOMPILE_LIMIT, limit_src))
    scalar_lines = {g.source_line for g in h.breaks if g.reason_class == "scalar output"}
    for f in h.frames:  # a constant specialised from an .item() result: N8
        lines = sorted({g["source_line"] for g in f.guards if g["class"] == "python value"} & scalar_lines)
        if lines:
            f.hint = (f"the specialised value comes from Tensor.item() at {', '.join(lines)}: set "
                      "torch._dynamo.config.capture_scalar_outputs=True (no constant, no guard) or keep the count "
                      "a tensor; " + (f.hint or ""))
    h.frames.sort(key=lambda f: (-f.recompiles, f.frame))
    return rank, h, missing


def _budget(rank: int, fid: str, label: str, file, items: list, limit: int, limit_src: str | None) -> FrameBudget:
    f = FrameBudget(frame=label, frame_id=fid, file=file, limit=limit, ranks=[rank])
    if limit_src:
        f.limit_source = limit_src
    f.compiles = len(items)
    f.recompiles = sum(1 for n, _ in items if n > 0)
    guards: dict[str, dict] = {}
    classes: Counter = Counter()
    for n, c in items:
        m = c.get("metrics") or {}
        refused = failure_kind(m.get("fail_type"), m.get("fail_reason")) == "recompile limit"
        f.limit_hit = f.limit_hit or refused
        f.used += 0 if refused else 1
        reasons = c.get("reasons") or ([str(m["recompile_reason"])] if m.get("recompile_reason") else [])
        if n == 0 or not reasons:
            continue
        step_classes = sorted({guard_class(r) for r in reasons})
        classes.update(step_classes)
        f.steps.append({"compile_id": c.get("cid") or f"{fid}/{n}", "failed_guard": guard_text(reasons[0]),
                        "source_line": guard_source(reasons[0]),
                        "class": guard_class(reasons[0]), "classes": step_classes, "guards_failed": len(reasons),
                        "refused": refused})
        for key, r in {guard_key(r): r for r in reversed(reasons)}.items():
            g = guards.setdefault(key, {"guard": key, "class": guard_class(r), "count": 0, "example": guard_text(r),
                                        "source_line": guard_source(r)})
            g["count"] += 1
    for g in guards.values():
        g["storm"] = g["count"] >= STORM_MIN
    f.guards = sorted(guards.values(), key=lambda g: -g["count"])
    f.classes = dict(classes.most_common())
    if classes:
        f.hint = "; ".join(f"{k}: {GUARD_HINTS[k]}" for k in f.classes)
        value = "python value" in f.classes and f.limit <= PROJECT_LIMIT_MAX  # a new value, a new graph
        shapes = any(g["storm"] and g["class"] == "shape" for g in f.guards) and f.limit - f.used <= f.used
        f.will_hit_limit = not f.limit_hit and (value or shapes)
    return f


def _break_order(g: BreakGroup) -> tuple:
    """User code first, then frameworks', then torch/stdlib; the most frequent first."""
    return (g.library, g.framework is not None, -g.count, g.source_line or "")


def _framework_hint(framework: str | None, hint: str) -> str:
    if not framework:
        return hint
    return (f"the break is in {framework}'s code, not yours (not counted by --max-graph-breaks): look for the "
            f"{framework} setting or version that avoids the call; {hint}")


def _merge_breaks(groups: list[BreakGroup]) -> list[BreakGroup]:
    out: dict[tuple, BreakGroup] = {}
    for g in groups:
        k = (g.reason_class, g.source_line)
        if k not in out:
            out[k] = BreakGroup(**{**asdict(g), "frames": list(g.frames), "compile_ids": [],
                                   "ranks": [], "count": 0})
        m = out[k]
        m.count += g.count
        m.ranks = sorted(set(m.ranks) | set(g.ranks))
        m.frames = list(dict.fromkeys(m.frames + g.frames))
        m.compile_ids = list(dict.fromkeys(m.compile_ids + [f"{g.ranks[0]}:{c}" for c in g.compile_ids]))
        m.eager_fallback = m.eager_fallback or g.eager_fallback
    return sorted(out.values(), key=_break_order)


def _merge_frames(frames: list[FrameBudget]) -> list[FrameBudget]:
    """Per frame label, the rank with the most recompiles (``worst_rank``; its numbers are the
    merged frame's fields), the ranks that compiled it, and each rank's own numbers
    (``per_rank``), so no rank is shown with another rank's counts."""
    out: dict[str, FrameBudget] = {}
    per_rank: dict[str, dict[int, dict]] = {}
    for f in frames:
        mine = per_rank.setdefault(f.frame, {})
        for r in f.ranks:
            mine[r] = {"compiles": f.compiles, "recompiles": f.recompiles, "used": f.used}
        best = out.get(f.frame)
        if best is None or f.recompiles > best.recompiles:
            out[f.frame] = FrameBudget(**{**asdict(f), "ranks": sorted(set(f.ranks) | set(best.ranks if best else [])),
                                          "worst_rank": f.ranks[0] if f.ranks else None})
        else:
            best.ranks = sorted(set(best.ranks) | set(f.ranks))
    for label, f in out.items():
        f.per_rank = dict(sorted(per_rank[label].items()))
    return sorted(out.values(), key=lambda f: (-f.recompiles, f.frame))


def _spread(stats: list[RankStats]) -> dict:
    """Compile seconds and hit rates across ranks: min, max, and max - min (``None`` with one rank
    or when no rank recorded the value)."""
    out: dict = {}
    times = {s.rank: s.compile_s for s in stats}
    if times:
        lo, hi = min(times, key=times.get), max(times, key=times.get)
        out["compile_s"] = {"min": times[lo], "min_rank": lo, "max": times[hi], "max_rank": hi,
                            "spread": times[hi] - times[lo] if len(times) > 1 else None}
    for key in ("fx_graph", "fx_graph_remote", "aot_autograd", "aot_autograd_remote"):
        rates = {s.rank: s.hit_rate(key) for s in stats if s.hit_rate(key) is not None}
        if rates:
            out[f"{key}_hit_rate"] = {"min": min(rates.values()), "max": max(rates.values()),
                                      "spread": max(rates.values()) - min(rates.values()) if len(rates) > 1 else None,
                                      "ranks": {str(r): v for r, v in rates.items()}}
    return out


def _missing(session: Session, run: Run, with_records: set[int]) -> list[str]:
    from graphdeck.analysis.ranks.flight import missing_evidence

    out = []
    known = set(session.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
    expected = known | set(range(run.world_size or 0))
    for r in sorted(expected - with_records):
        out.append(f"rank {r}: no compile records (nothing to check on this rank)")
    if not with_records and not expected:
        out.append("the run has no compile records")
    return out + missing_evidence(session, run.id)


def _verdict(h: CompileHealth) -> None:
    th = h.thresholds
    if th.max_graph_breaks is not None and len(h.user_breaks) > th.max_graph_breaks:
        h.findings.append(f"{len(h.user_breaks)} distinct graph break(s) in user code > --max-graph-breaks "
                          f"{th.max_graph_breaks}: " + "; ".join(f"{b.source_line} ({b.reason_class}, {b.count}x)"
                                                                  for b in h.user_breaks))
    if th.max_recompiles_per_frame is not None:
        for f in h.frames:
            if f.recompiles > th.max_recompiles_per_frame:
                h.findings.append(f"frame {f.frame}: {f.recompiles} recompile(s) > --max-recompiles-per-frame "
                                  f"{th.max_recompiles_per_frame} ({f.used} of {f.limit} compiles used; "
                                  f"{', '.join(f.classes) or 'no reason recorded'})")
    if th.fail_on_eager_fallback and h.fallbacks:
        h.findings.append(f"{len(h.fallbacks)} frame(s) fell back to eager: " + "; ".join(
            f"rank {x.rank} {x.compile_id} {x.frame}: {x.kind}" for x in h.fallbacks))
    if h.no_graph is not None:  # NOTE: [No graph produced]: WARN, FAIL under --fail-on-eager-fallback
        (h.findings if th.fail_on_eager_fallback else h.warnings).append(h.no_graph.message)
    if th.fail_on_ddp_no_overlap and h.ddp_overlap:
        h.findings += [f"--fail-on-ddp-no-overlap: {f.message}" for f in h.ddp_overlap]
    for f in h.frames:
        if f.limit_hit:
            h.warnings.append(f"frame {f.frame}: recompile limit hit ({f.used} of {f.limit} compiles used)")
    raised = [x for x in h.fallbacks if "FailOnRecompile" in (x.fail_type or "")]
    if raised:
        h.warnings.append(f"{len(raised)} compile(s) raised to the job (fullgraph=True): " + "; ".join(
            f"rank {x.rank} {x.compile_id} {x.frame}" for x in raised[:5]))
    if len(h.fallbacks) > len(raised):
        h.warnings.append(f"{len(h.fallbacks) - len(raised)} frame(s) fell back to eager or failed to compile")
    if not th.fail_on_ddp_no_overlap:
        h.warnings += [f.message for f in h.ddp_overlap]  # a performance finding: WARN unless gated
    # NOTE: [WARN is not PASS]: with no gate for them, a hit limit or a failed compile still is no
    # PASS (the job ran eagerly or raised): WARN, exit 0; a gate (--max-*, --fail-on-*) makes it FAIL.
    h.verdict = ("FAIL" if h.findings else "INCOMPLETE" if h.missing_evidence
                 else "WARN" if h.warnings else "PASS")
