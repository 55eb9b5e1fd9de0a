"""Device ports for the bundled executor (graphdeck.replay.executor): portable stand-ins for
CPU-only kernels a stored graph can hold, used when it is replayed on another device.

Each port takes the op's arguments and returns its outputs (shapes, dtypes as the op's);
:func:`restride_outputs` gives them the recorded strides. ``_DEVICE_PORTS`` maps an op's target
string (``aten.X.overload``, as stored in ``nodes.target``) to its port.
"""

from __future__ import annotations


# NOTE: [Device ports]
# A graph captured on a CPU run can hold CPU-only kernels (``aten._scaled_dot_product_flash_
# attention_for_cpu`` and its backward: what SDPA lowers to on CPU). Replayed on another device,
# such a node runs a portable equivalent with the same inputs and outputs, written with plain
# tensor ops: attention as softmax(q kᵀ · scale + mask) v with its log-sum-exp, and the backward of
# the same (the FlashAttention backward recurrence, Dao et al. 2022, Algorithm 2, without tiling).
# The node's time on that device is then the time of that math, not of a fused kernel.
def sdpa_cpu_port(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Device-portable ``aten._scaled_dot_product_flash_attention_for_cpu``: ``(out [B,H,L,E],
    logsumexp [B,H,L])``; q/k/v ``[B,H,L,E]``; dropout must be 0."""
    scores = _scores(q, k, is_causal, attn_mask, scale)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def sdpa_cpu_backward_port(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                           scale=None):
    """Device-portable ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``."""
    import math

    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    p = (_scores(q, k, is_causal, attn_mask, scale) - lse.unsqueeze(-1)).exp()
    dv = p.transpose(-2, -1) @ grad_out
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    return ds @ k * s, ds.transpose(-2, -1) @ q * s, dv


def _scores(q, k, is_causal, attn_mask, scale):
    import math

    import torch

    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * s
    if is_causal:
        L, S = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores


def restride_outputs(values, strides):
    """``values`` (a tuple of tensors, or one) laid out with the recorded ``strides`` (a list per
    output, or one list): a port's outputs keep the layout later ``view`` nodes were traced with."""
    import torch

    def one(t, stride):
        if (not isinstance(t, torch.Tensor) or not isinstance(stride, list) or len(stride) != t.dim()
                or list(t.stride()) == stride or not all(isinstance(x, int) and x > 0 for x in stride)):
            return t
        out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
        return out.copy_(t)

    if isinstance(values, (tuple, list)):
        return tuple(one(t, st) for t, st in zip(values, strides))
    return one(values, strides)


_DEVICE_PORTS = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": sdpa_cpu_port,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": sdpa_cpu_backward_port,
}
