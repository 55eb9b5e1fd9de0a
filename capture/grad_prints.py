"""Numeric gradient evidence: at chosen optimizer steps, a fingerprint per watched parameter of the
gradient the optimizer is about to consume and of the parameter after the step; and, under DDP,
whether each backward was all-reduced (a helper of :mod:`graphdeck.capture.grad_evidence`, whose
optimizer-step hooks call it).

# NOTE: [Gradient fingerprints]
# Ranks that must hold the same value (DDP replicas after the all-reduce, TP peers of a Replicate
# parameter) are compared by ``check-grads`` from two numbers per tensor: its L2 norm (one
# ``torch._foreach_norm`` per device and dtype, accumulated in float32) and a position-weighted
# sum ``sum_j g_j * w_j`` (``w_j = 1 + (j mod 251) / 251``, in the tensor's dtype; a sign flip or
# a permutation changes it where the norm stays). Everything of a device is stacked and read
# back in one copy. Nothing is written to a gradient or a parameter (views, reductions and a dot
# product, under ``no_grad``), so the job computes what it computed without the capture.
#
# When: the gradient at the optimizer-step pre-hook (after DDP's reduction, FSDP2's
# reduce-scatter: what ``step()`` reads), the parameter at its post-hook. Steps (numbered as
# ``grad_steps`` numbers them: optimizer steps taken before) are fingerprinted by the cadence
# ``first,every`` (default ``5,100``: steps 0–4, then every 100th), and at any step whose DDP
# sync state (below) differs from the previous step's. ``GRAPHDECK_GRAD_PRINTS`` (or
# ``Agent(grad_prints=...)``): ``"5,100"``, ``"all"`` (every step) or ``"off"``.
#
# DDP sync state: DDP all-reduces a backward only when its forward ran with
# ``require_backward_grad_sync`` (outside ``no_sync()``); the forward's decision is left in
# ``require_forward_param_sync`` (``DistributedDataParallel._post_forward``). It is read — an
# attribute, no hook on the module — at the end of each backward the evidence closes (``synced``:
# one flag per backward of the step) and at the optimizer step (``last_synced``: whether the
# gradient the optimizer consumes was reduced).
#
# Records: ``compile_events`` rows ``name = "graphdeck_grad_prints"`` (no schema change), payload
# ``{"first": s, "last": s2, "last_synced": bool | null, "synced": [bool] | null,
# "names": [fqn] (only when the list changed since this rank's previous values row),
# "dtypes": [str], "grad": [[norm, wsum] | null], "param": [[norm, wsum] | null],
# "gplace": {index: [placement]} (gradients that are DTensors), "groups": [[rank, ...]] (DDP
# process groups), "cadence": [first, every]}``; ``grad``/``param``
# only on fingerprinted steps (``first == last``), index-aligned with ``names``. Steps that are
# not fingerprinted and have the same sync state as the previous one extend the previous row
# (``last``). Rows are held in memory and written in one transaction: the first at once, then
# every ``PERSIST_EVERY_S`` or ``PERSIST_ROWS`` rows, and at close and interpreter exit (a write
# per fingerprinted step cost more than the fingerprint); a job killed by SIGKILL loses the rows
# of its last ``PERSIST_EVERY_S``.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Any

import torch

EVENT = "graphdeck_grad_prints"
DEFAULT_CADENCE = (5, 100)
PERSIST_EVERY_S = 30.0
PERSIST_ROWS = 64  # at GRAPHDECK_GRAD_PRINTS=all: one write per 64 steps (4-5 ms each on the demo's CPU)
_PERIOD = 251
_CHUNK = _PERIOD * 4096  # weights cached per device and dtype up to this many elements; longer tensors in
# chunks of this length, a multiple of the period so that every position keeps its weight w_{j mod 251}
_BATCH_ELEMS = 1 << 24  # batched path: one float32 staging buffer of at most this many elements (64 MiB)


def parse_cadence(spec: str | None) -> tuple[int, int] | None:
    """``"5,100"`` → ``(5, 100)``; ``"all"`` → ``(0, 1)``; ``"off"``/``"0"`` → None; None or
    ``""`` → the default. Raises ``ValueError`` for anything else."""
    if spec is None or not str(spec).strip():
        return DEFAULT_CADENCE
    s = str(spec).strip().lower()
    if s in ("off", "0", "none", "false"):
        return None
    if s in ("all", "every", "1"):
        return (0, 1)
    first, _, every = s.partition(",")
    first_n, every_n = int(first), int(every or 0)
    if first_n < 0 or every_n < 0:
        raise ValueError(f"grad prints cadence {spec!r}: expected FIRST,EVERY (non-negative), 'all' or 'off'")
    return (first_n, every_n)


class Fingerprinter:
    """``(norm, weighted sum)`` of tensors: per device and dtype one ``_foreach_norm`` and one dot
    per tensor (no copy: views of the tensor and of cached weights), and one read-back per device.

    # NOTE: [Fingerprint cost]
    # The work is two passes over the tensors' memory (the norm and the dot), the floor on any
    # device; what is cut is the rest: per-tensor Python (one ``view`` and one ``dot`` a tensor,
    # the weights a cached view per (device, dtype, length)), one stack and one ``float`` per
    # group, and on CUDA no synchronisation: :meth:`launch` queues the reductions and a
    # non-blocking copy into pinned memory on the current stream (in stream order, so they read
    # the values the optimizer reads), and :meth:`Pending.values` waits for that copy only when
    # the values are needed (when the row is written: the first at once, later ones in batches,
    # by then long done).
    """

    # NOTE: [Batched fingerprints on accelerators]
    # On a GPU the per-tensor dot is not bound by memory but by launches: GPT-2's 148 tensors
    # cost ~15 ms of host time a fingerprinted step on an H100 (+75% of an 19 ms step) for a few
    # hundred kernels. There, tensors up to a quarter of ``_BATCH_ELEMS`` are copied (one
    # ``_foreach_copy_``, in their own dtype, then one conversion) into slots of a staging buffer, each slot starting at a
    # multiple of the weights' period and zero-padded to the next one, so that one ``mv`` of the
    # buffer viewed as rows of ``_PERIOD`` against the period's weights gives every row's
    # weighted sum, and a float64 running sum read at each tensor's last row (``diff``) adds
    # each tensor's rows. That is a handful of launches per 64 MiB whatever the tensor count,
    # none that waits for the GPU (``segment_reduce`` checks its lengths on the host),
    # deterministic (no atomics), and the same definition (position ``j`` of the tensor, weight
    # ``w_{j mod 251}`` in the tensor's dtype), accumulated in float32. Larger tensors keep the
    # per-tensor path (they are few). On CPU the per-tensor path stays: there the cost is the
    # passes over memory, which the staging copy would add to.

    def __init__(self, batched: bool | None = None):
        self._weights: dict[tuple, torch.Tensor] = {}
        self._batched = batched  # None: on accelerators only (NOTE above); True/False: always/never
        self._layouts: dict[tuple, tuple] = {}  # (device, sizes) -> (slot offsets, rows per tensor on device)

    def _w(self, device, dtype, n: int) -> torch.Tensor:
        """The first ``n`` weights (``n`` ≤ ``_CHUNK``) for ``device``/``dtype``, a cached view."""
        key = (device, dtype, n)
        w = self._weights.get(key)
        if w is None:
            full = self._weights.get((device, dtype))
            if full is None or full.numel() < n:
                size = min(max(n, 1024), _CHUNK)
                full = (1 + (torch.arange(size, device=device, dtype=torch.float32) % _PERIOD) / _PERIOD).to(dtype)
                self._weights = {(device, dtype): full}  # views of a smaller buffer go with it
            w = self._weights[key] = full[:n]
        return w

    def _wsum(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
        n = flat.numel()
        if n <= _CHUNK:
            return torch.dot(flat, self._w(t.device, t.dtype, n))
        w = self._w(t.device, t.dtype, _CHUNK)
        m = n // _CHUNK
        out = torch.mv(flat[: m * _CHUNK].view(m, _CHUNK), w).sum()
        rest = n - m * _CHUNK
        return out + torch.dot(flat[m * _CHUNK:], self._w(t.device, t.dtype, rest)) if rest else out

    def _wsums_batched(self, ts: list) -> torch.Tensor:
        """``[len(ts)]`` float32 weighted sums of same-device, same-dtype ``ts`` (NOTE: [Batched
        fingerprints on accelerators]); tensors over a quarter of ``_BATCH_ELEMS`` go through
        :meth:`_wsum`. The plan (slots, batches, the order of the results) is cached per list of
        shapes: a training step fingerprints the same tensors every time."""
        device, dtype = ts[0].device, ts[0].dtype
        key = (device, dtype, tuple(tuple(t.shape) for t in ts))
        plan = self._layouts.get(key)
        if plan is None:
            plan = self._layouts[key] = self._plan(ts, device)
            if len(self._layouts) > 64:  # a changing set of tensors keeps the newest plans
                self._layouts.pop(next(iter(self._layouts)))
        batches, alone, order = plan
        w = self._w(device, dtype, _PERIOD).float()
        parts = []
        for idx, offs, rows, lengths in batches:  # lengths: each tensor's last row
            # staged in the tensors' own dtype: _foreach_copy_ between equal dtypes is one fused
            # launch; across dtypes it falls back to a copy_ per tensor (the host cost it cuts)
            buf = torch.zeros(rows * _PERIOD, dtype=dtype, device=device)
            slots = [buf.as_strided(ts[i].shape, _contiguous_strides(ts[i].shape), o) for i, o in zip(idx, offs)]
            torch._foreach_copy_(slots, [ts[i] for i in idx])
            rows_f32 = buf.view(-1, _PERIOD) if dtype == torch.float32 else buf.view(-1, _PERIOD).float()
            per_row = torch.mv(rows_f32, w)
            ends = torch.cumsum(per_row, 0, dtype=torch.float64).index_select(0, lengths)
            parts.append(torch.diff(ends, prepend=ends.new_zeros(1)).float())  # no check that reads back
        if alone:
            parts.append(torch.stack([self._wsum(ts[i]).float() for i in alone]))
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        return flat if order is None else flat.index_select(0, order)

    @staticmethod
    def _plan(ts: list, device) -> tuple:
        """``(batches, alone, order)``: batches ``[(indices, slot offsets, rows, each tensor's last
        row, on the device)]`` each within ``_BATCH_ELEMS``; ``alone``: indices of the tensors too large to
        stage; ``order``: where each input's sum is in the concatenated results (None: in order)."""
        batches, alone, idx, offs, lens = [], [], [], [], []
        rows = 0

        def close():
            nonlocal idx, offs, lens, rows
            if idx:
                batches.append((idx, offs, rows, torch.tensor(lens, device=device)))
            idx, offs, lens, rows = [], [], [], 0

        for i, t in enumerate(ts):
            n = t.numel()
            if n > _BATCH_ELEMS // 4:
                alone.append(i)
                continue
            r = -(-n // _PERIOD)
            if (rows + r) * _PERIOD > _BATCH_ELEMS:
                close()
            idx.append(i)
            offs.append(rows * _PERIOD)
            rows += r
            lens.append(rows - 1)
        close()
        got = [i for b in batches for i in b[0]] + alone
        order = None
        if got != list(range(len(ts))):
            pos = {i: k for k, i in enumerate(got)}
            order = torch.tensor([pos[i] for i in range(len(ts))], device=device)
        return batches, alone, order

    @torch._disable_dynamo
    def launch(self, tensors: list) -> "Pending":
        """Queue the fingerprints of ``tensors`` (None, non-float and empty tensors give None);
        :meth:`Pending.values` returns them."""
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            if t is None:
                continue
            t = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard (its own value)
            if not t.is_floating_point() or t.numel() == 0:
                continue
            tensors[i] = t
            groups.setdefault((t.device, t.dtype), []).append(i)
        parts: dict = {}
        with torch.no_grad():
            for (device, dtype), idx in groups.items():
                ts = [tensors[i] for i in idx]
                norms = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32))
                batched = self._batched if self._batched is not None else device.type != "cpu"
                sums = (self._wsums_batched(ts) if batched
                        else torch.stack([self._wsum(t) for t in ts]).float())
                parts.setdefault(device, []).append((idx, torch.cat((norms, sums))))
        reads = []
        for device, got in parts.items():
            flat = torch.cat([v for _, v in got]) if len(got) > 1 else got[0][1]
            event = None
            if flat.device.type == "cuda":
                stream = torch.cuda.current_stream(flat.device)  # the stream the copy is queued on
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                flat = host
            elif flat.device.type != "cpu":
                flat = flat.cpu()
            reads.append(([idx for idx, _ in got], flat, event))
        return Pending(len(tensors), reads)

    def __call__(self, tensors: list) -> list:
        """Per tensor (None passes through as None): ``[norm, wsum]`` as Python floats (now)."""
        return self.launch(tensors).values()


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class Pending:
    """Fingerprints queued by :meth:`Fingerprinter.launch`; :meth:`values` waits for them once."""

    def __init__(self, n: int, reads: list):
        self._n, self._reads, self._out = n, reads, None

    def values(self) -> list:
        """Per tensor ``[norm, wsum]`` (Python floats) or None, in the order given."""
        if self._out is None:
            out: list = [None] * self._n
            for groups, flat, event in self._reads:
                if event is not None:
                    event.synchronize()
                vals = flat.tolist()
                k = 0
                for idx in groups:
                    n = len(idx)
                    for j, i in enumerate(idx):
                        out[i] = [vals[k + j], vals[k + n + j]]
                    k += 2 * n
            self._out, self._reads = out, []
        return self._out


class GradPrints:
    """One rank's fingerprints (NOTE: [Gradient fingerprints]), written through ``agent.writer``."""

    def __init__(self, agent: Any, params: list, cadence: tuple[int, int]):
        self.agent = agent
        self._params = params  # GradEvidence._params: [(fqn, weak ref)] (shared, grows with add_model)
        self.cadence = cadence
        self._fp = Fingerprinter()
        self._ddps: list = []  # weak refs to DDP wrappers
        self.groups: list[list[int]] = []
        self.ignored: set[str] = set()  # DDP's parameters_to_ignore (not reduced: not comparable)
        self._synced: list[bool] = []  # one flag per backward since the last step
        self._prev_last: bool | None = None
        self._pending: dict | None = None  # the step being fingerprinted (between pre and post hooks)
        self._row: dict | None = None  # the row being extended: {"id" (None: not written), "payload", "dirty"}
        self._rows: list[dict] = []  # rows new or grown since the last write
        self._written = 0
        self._names_written: list[str] | None = None
        self._last_persist = time.monotonic()
        self.failed = False

    @classmethod
    def from_env(cls, agent: Any, params: list, spec: str | None = None) -> "GradPrints | None":
        cadence = parse_cadence(spec if spec is not None else os.environ.get("GRAPHDECK_GRAD_PRINTS"))
        return None if cadence is None else cls(agent, params, cadence)

    # ------------------------------------------------------------------ DDP sync state
    def note_ddp(self, ddp) -> None:
        """Remember a ``DistributedDataParallel`` wrapper and its process group's ranks."""
        if any(r() is ddp for r in self._ddps):
            return
        self._ddps.append(weakref.ref(ddp))
        try:
            import torch.distributed as dist

            # parameters DDP was told to ignore are not reduced: they may differ (names as the store's)
            inner = getattr(ddp, "module", None)
            prefix = getattr(self.agent, "_prefixes", {}).get(id(inner), "")
            self.ignored.update(prefix + n for n in getattr(ddp, "parameters_to_ignore", ()) or ())
            pg = getattr(ddp, "process_group", None) or dist.group.WORLD
            ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
            if ranks not in self.groups:
                self.groups.append(ranks)
        except Exception:  # noqa: BLE001 - the analysis falls back to the layout / every rank
            pass

    def _sync_state(self) -> bool | None:
        flags = [getattr(d, "require_forward_param_sync", True) for d in (r() for r in self._ddps) if d is not None]
        return None if not flags else all(flags)

    def note_backward(self) -> None:
        """A backward ended (the evidence closed its window): whether DDP reduced it."""
        s = self._sync_state()
        if s is not None and len(self._synced) < 4096:
            self._synced.append(bool(s))

    # ------------------------------------------------------------------ optimizer step
    def _wants(self, step: int, last: bool | None) -> bool:
        first, every = self.cadence
        return step < first or (every > 0 and step % every == 0) or (
            last is not None and self._prev_last is not None and last != self._prev_last)

    def _tensors_of(self, opt) -> tuple[list[str], list]:
        held = {id(p) for g in getattr(opt, "param_groups", ()) or () for p in g["params"]} if opt is not None else None
        names, tensors = [], []
        for fqn, ref in self._params:
            p = ref()
            if p is None or not p.requires_grad or (held is not None and id(p) not in held):
                continue
            names.append(fqn)
            tensors.append(p)
        return names, tensors

    def before_step(self, opt, step: int) -> None:
        """The optimizer-step pre-hook: the gradient fingerprint of step ``step`` when due."""
        if self.failed or torch.compiler.is_compiling():
            return
        try:
            synced, self._synced = self._synced, []
            # the last backward's own read (a no_grad forward since, e.g. an evaluation, leaves
            # the attribute False); the attribute now when no backward was seen closing
            last = synced[-1] if synced else self._sync_state()
            payload: dict = {"first": step, "last": step, "last_synced": last, "synced": synced or None}
            if self._wants(step, last):
                names, params = self._tensors_of(opt)
                grads = [p.grad for p in params]
                payload["grad"] = self._fp.launch(list(grads))  # read when the row is written
                place = {str(i): [repr(x) for x in g.placements] for i, g in enumerate(grads)
                         if g is not None and hasattr(g, "placements")}
                if place:
                    payload["gplace"] = place  # a DTensor gradient's placements (Partial: not comparable)
                payload["dtypes"] = [str(p.dtype).removeprefix("torch.") for p in params]
                payload["names"] = names
                self._pending = payload
            else:
                self._pending = None
                self._emit(payload)
            self._prev_last = last
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            self._fail(exc)

    def after_step(self, opt, step: int) -> None:
        """The optimizer-step post-hook: the parameter fingerprint of a fingerprinted step."""
        payload, self._pending = self._pending, None
        if payload is None or self.failed or payload["first"] != step or torch.compiler.is_compiling():
            return
        try:
            names, params = self._tensors_of(opt)
            if names == payload["names"]:
                payload["param"] = self._fp.launch(list(params))
            self._emit(payload)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    # ------------------------------------------------------------------ rows
    def _emit(self, payload: dict) -> None:
        """Extend the current row with ``payload``'s step when it is a step like the row's (not
        fingerprinted, same sync state), else start a new row. Rows are written in batches
        (:meth:`_persist`): at once for the first, then every ``PERSIST_EVERY_S``, every
        ``PERSIST_ROWS`` rows, and at flush (close, exit)."""
        row = self._row
        values = "grad" in payload
        if not values and not self._ddps:
            return  # nothing to say between fingerprints without DDP
        if (not values and row is not None and "grad" not in row["payload"]
                and row["payload"]["last"] == payload["first"] - 1
                and row["payload"]["last_synced"] == payload["last_synced"]
                and row["payload"]["synced"] == payload["synced"]):
            row["payload"]["last"] = payload["first"]
            if not row["dirty"]:
                row["dirty"] = True
                self._rows.append(row)
        else:
            payload["groups"] = self.groups
            if self.ignored:
                payload["ddp_ignored"] = sorted(self.ignored)
            payload["cadence"] = list(self.cadence)
            if values:
                if payload["names"] == self._names_written:
                    del payload["names"]
                else:
                    self._names_written = payload["names"]
            self._row = {"id": None, "payload": payload, "dirty": True}
            self._rows.append(self._row)
        if (self._written == 0 or len(self._rows) >= PERSIST_ROWS
                or time.monotonic() - self._last_persist > PERSIST_EVERY_S):
            self._persist()

    def _persist(self) -> None:
        """Write the rows not yet written (one transaction) and the current row's new extent
        (``_rows``: every row with ``dirty`` set, once)."""
        rows, self._rows = self._rows, []
        self._last_persist = time.monotonic()
        if not rows:
            return
        for r in rows:  # the queued fingerprints (NOTE: [Fingerprint cost]) as numbers
            for what in ("grad", "param"):
                if isinstance(r["payload"].get(what), Pending):
                    r["payload"][what] = r["payload"][what].values()
        new = [r for r in rows if r["id"] is None]
        grown = [r for r in rows if r["id"] is not None]
        ids = self.agent.writer.write_records(EVENT, [json.dumps(r["payload"]) for r in new],
                                              updates={r["id"]: json.dumps(r["payload"]) for r in grown})
        for r, rid in zip(new, ids):
            r["id"], r["dirty"] = rid, False
        for r in grown:
            r["dirty"] = False
        self._written += len(new)

    def flush(self) -> None:
        """Persist the rows held in memory (and a fingerprint whose post-hook never came). Never raises."""
        try:
            if self._pending is not None:
                payload, self._pending = self._pending, None
                self._emit(payload)
            self._persist()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            import warnings

            warnings.warn(f"graphdeck: gradient fingerprints stopped: {type(exc).__name__}: {exc}")
