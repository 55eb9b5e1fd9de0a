"""Gradient fingerprints in one process (NOTE: [Gradient fingerprints]): the job computes the same
bits with them on, the records hold what the optimizer consumed, and the replica check's rules
on stored records (real SQLite, written by the capture's writer)."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from graphdeck.capture import Agent
from graphdeck.capture.grad_prints import parse_cadence
from graphdeck.capture.writer import StoreWriter
from graphdeck.cli import main as cli


def _train(agent: Agent | None, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    if agent is not None:
        agent.watch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if agent is not None:
        agent.close()
    return [p.detach().clone() for p in model.parameters()]


def test_fingerprints_change_nothing_and_record_each_step(tmp_path):
    plain = _train(None)
    store = tmp_path / "p.db"
    captured = _train(Agent(store=store, run="fp", grad_prints="all"))
    assert all(torch.equal(a, b) for a, b in zip(plain, captured)), "the capture changed the job's bits"
    import sqlite3

    recs = [json.loads(p) for (p,) in sqlite3.connect(store).execute(
        "SELECT payload FROM compile_events WHERE name = 'graphdeck_grad_prints' ORDER BY id")]
    assert [r["first"] for r in recs] == [0, 1, 2] and recs[0]["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    last = recs[-1]["param"]
    want = [[p.norm().item(), sum(float(x) * (1 + (j % 251) / 251) for j, x in enumerate(p.reshape(-1)))]
            for p in captured]
    for (n, w), (n2, w2) in zip(last, want):
        assert abs(n - n2) <= 1e-6 * max(1, n2) and abs(w - w2) <= 1e-4 * max(1, abs(w2))
    assert all(r["last_synced"] is None and "groups" in r for r in recs)  # no DDP: no sync state


def test_cadence_spec():
    assert parse_cadence(None) == parse_cadence("") == (5, 100)
    assert parse_cadence("all") == (0, 1) and parse_cadence("off") is None and parse_cadence("3,10") == (3, 10)


def _two_ranks(store, run: str, grads: dict[int, list], params: dict[int, list], **extra) -> None:
    names = ["w", "skip"]
    for rank in (0, 1):
        w = StoreWriter(store, run, rank, 2)
        w.write_params([{"fqn": n, "kind": "parameter", "storage_key": n, "shape": [4], "dtype": "float32",
                         "numel": 4, "size_bytes": 16, "requires_grad": True} for n in names])
        w.write_compile_events([{"name": "graphdeck_watch", "payload": json.dumps({"complete": True, "ddp": True})}])
        w.write_grad_step(step_first=0, step_last=1, n_backward=2, step_source="optimizer", closed=True,
                          state={"trainable": 2, "none": [], "zero": [], "multi": {}, "frozen": [], "unobserved": []})
        for step in (0, 1):
            p = {"first": step, "last": step, "last_synced": True, "synced": [True], "dtypes": ["float32"] * 2,
                 "grad": grads[rank][step], "param": params[rank][step], "groups": [[0, 1]], **extra}
            if step == 0:
                p["names"] = names
            w.write_records("graphdeck_grad_prints", [json.dumps(p)])


def _check(store, run):
    res = CliRunner().invoke(cli, ["check-grads", str(store), "--run", run, "--format", "json"])
    return res.exit_code, json.loads(res.output)


def test_replica_rules_on_stored_records(tmp_path):
    store = tmp_path / "r.db"
    same = [[[1.0, 2.0], [3.0, 1.0]]] * 2
    # within float32's tolerance (a reduction order that differs): agree
    near = [[[1.0 + 1e-7, 2.0], [3.0, 1.0]]] * 2
    _two_ranks(store, "near", {0: same, 1: near}, {0: same, 1: same})
    rc, rep = _check(store, "near")
    assert rc == 0 and not [f for f in rep["findings"] if f["kind"] == "REPLICA_DIVERGENCE"], rep["findings"]
    # a parameter DDP was told to ignore is not reduced: its difference is not a divergence
    other = [[[1.0, 2.0], [4.0, 1.0]]] * 2
    _two_ranks(store, "ignored", {0: same, 1: other}, {0: same, 1: other}, ddp_ignored=["skip"])
    assert _check(store, "ignored")[0] == 0
    # every backward reduced, gradients still differ from step 1: changed after the reduction
    late = [same[0], [[1.5, 2.0], [3.0, 1.0]]]
    _two_ranks(store, "late", {0: same, 1: late}, {0: same, 1: same})
    rc, rep = _check(store, "late")
    f = [f for f in rep["findings"] if f["kind"] == "REPLICA_DIVERGENCE"]
    assert rc == 1 and len(f) == 1 and f[0]["params"] == ["w"], rep["findings"]
    assert "from step 1 (they agreed at step 0)" in f[0]["message"] and "after DDP's reduction" in f[0]["message"]
    # gradients agree, parameters differ: the replicas were apart
    _two_ranks(store, "apart", {0: same, 1: same}, {0: same, 1: late})
    rc, rep = _check(store, "apart")
    f = [f for f in rep["findings"] if f["kind"] == "REPLICA_DIVERGENCE"]
    assert rc == 1 and "gradients agree but their parameters differ" in f[0]["message"], f


def _reference_wsum(t: torch.Tensor) -> float:
    """``sum_j t_j * w_j``, ``w_j = 1 + (j mod 251) / 251`` in the tensor's dtype, in float64."""
    flat = t.reshape(-1)
    w = (1 + (torch.arange(flat.numel()) % 251).float() / 251).to(t.dtype).double()
    return float(flat.double() @ w)


def _aten_calls(fn) -> int:
    """Operators that compute (launch a kernel on a GPU) while ``fn`` runs; views are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not func.is_view
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_batched_fingerprints_match_the_definition_in_a_few_launches(monkeypatch):
    """NOTE: [Batched fingerprints on accelerators]: the batched path (used on GPUs, forced here
    on CPU) gives the definition's value for every size class (under a period, not a multiple of
    it, over the per-tensor chunk, over the batch's share, non-contiguous, bf16) and over several
    staging buffers; its op count does not grow with the number of tensors (the H100's +75% on a
    fingerprinted GPT-2 step was launches: a few hundred per step), where the per-tensor path's does."""
    import graphdeck.capture.grad_prints as gp

    torch.manual_seed(0)
    ts = [torch.randn(s) for s in [(3,), (251,), (252,), (1000, 7), (1 << 21,), (7, 5)]]
    ts += [torch.randn(40, 30).t(), torch.randn(5000).to(torch.bfloat16), torch.randn(5 << 20)]
    for batched in (False, True):
        got = gp.Fingerprinter(batched=batched)(list(ts))
        for t, (norm, wsum) in zip(ts, got):
            ref = _reference_wsum(t)
            tol = (2e-2 if t.dtype == torch.bfloat16 and not batched else 1e-5) * max(1.0, t.float().abs().sum().item())
            assert abs(wsum - ref) <= tol, (batched, t.shape, t.dtype, wsum, ref)
            assert abs(norm - t.double().norm().item()) <= 1e-3 * norm  # float32 accumulation (torch._foreach_norm)
    monkeypatch.setattr(gp, "_BATCH_ELEMS", 4096)  # several staging buffers, one tensor alone in one
    small = [torch.randn(n) for n in (700, 900, 1000, 251, 1)]
    for t, (_, wsum) in zip(small, gp.Fingerprinter(batched=True)(list(small))):
        assert abs(wsum - _reference_wsum(t)) <= 1e-4 * max(1.0, t.abs().sum().item())
    monkeypatch.undo()

    t = torch.randn(1000)  # what the norm cannot see, the weighted sum does
    base = gp.Fingerprinter(batched=True)([t])[0][1]
    assert gp.Fingerprinter(batched=True)([-t])[0][1] == -base
    assert abs(gp.Fingerprinter(batched=True)([t.flip(0)])[0][1] - base) > 1e-3

    def calls(batched: bool, n: int) -> int:
        fp = gp.Fingerprinter(batched=batched)
        many = [torch.randn(64, 32) for _ in range(n)]
        fp(list(many))  # the layout is built once per set of sizes
        return _aten_calls(lambda: fp(list(many)))

    assert calls(True, 120) <= calls(True, 10) + 2, (calls(True, 10), calls(True, 120))
    assert calls(False, 120) > 5 * calls(False, 10)
