"""attend_new_keys: fold a decode step's own keys into the attention state over the cache.

A decode step's queries see the cached keys (all earlier) plus the step's own Sq keys, causally.
When those keys are not in the cache being decoded (context-parallel decode: the step's keys are
replicated on every rank and appended only afterwards, to the rank that owns them), their part of
the attention is an Sq x Sq block: this computes it and merges it with the cache's state (o, lse)
exactly, in one launch on CUDA (Triton) — not a second decode plus a merge (four more launches).

The result equals `splitkv.decode` over the cache with the new keys appended, up to rounding.
"""

from __future__ import annotations

import math

import torch

from . import backends, validate


def _new_state_torch(q, new_k, new_v, scale: float, causal: bool):
    """(o_n [B, T, H, D] fp32, lse_n [B, H, T]) of the queries over the step's own keys."""
    B, T, H, D = q.shape
    group = H // new_k.shape[2]
    k = new_k.float().repeat_interleave(group, dim=2)
    v = new_v.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,bjhd->bhtj", q.float(), k) * scale
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse_n = torch.logsumexp(s, dim=-1)
    o_n = torch.einsum("bhtj,bjhd->bthd", torch.softmax(s, dim=-1), v)
    return o_n, lse_n


def attend_new_keys(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, new_k: torch.Tensor,
                    new_v: torch.Tensor, *, causal: bool = True,
                    softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state over the cache joined by the step's own keys.

    o [B, Sq, Hq, D], lse [B, Hq, Sq] fp32: `decode(..., return_lse=True)` over keys that all
    precede the step's tokens (lse = -inf or +inf: no key, as merge_states reads it). q [B, Sq, Hq, D]:
    the step's queries; new_k / new_v [B, Sq, Hkv, D]: its keys and values, at the last Sq
    positions; with causal (bottom-right) query t sees new keys 0..t, else all Sq.
    Returns (o [B, Sq, Hq, D] in o's dtype, lse [B, Hq, Sq] fp32): the state over both key sets.
    NaN in any input propagates to the rows it reaches."""
    for name, t in (("o", o), ("lse", lse), ("q", q), ("new_k", new_k), ("new_v", new_v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q: expected rank 4 [B, Sq, Hq, D], got shape {tuple(q.shape)}")
    for name, t in (("new_k", new_k), ("new_v", new_v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} does not match q's dtype {q.dtype}")
    validate.check_causal(causal)
    validate.check_softmax_scale(softmax_scale)
    B, T, H, D = q.shape
    if new_k.dim() != 4 or new_k.shape[:2] != q.shape[:2] or new_k.shape[3] != D or new_k.shape != new_v.shape:
        raise ValueError(f"new_k/new_v: expected [B, Sq, Hkv, D] with B, Sq, D = {(B, T, D)}, got "
                         f"{tuple(new_k.shape)} / {tuple(new_v.shape)}")
    if new_k.shape[2] < 1 or H % new_k.shape[2]:
        raise ValueError(f"new_k: its {new_k.shape[2]} KV heads must divide q's {H} heads")
    if o.shape != q.shape:
        raise ValueError(f"o: expected shape {tuple(q.shape)}, got {tuple(o.shape)}")
    if tuple(lse.shape) != (B, H, T):
        raise ValueError(f"lse: expected shape {(B, H, T)} ([B, Hq, Sq]), got {tuple(lse.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if q.is_cuda and backends.triton_available():
        from .backends.triton import extend

        if lse.dtype != torch.float32 or lse.stride(-1) != 1:
            lse = lse.float().contiguous()
        out = torch.empty_like(o, memory_format=torch.contiguous_format)
        lse_out = torch.empty((B, H, T), dtype=torch.float32, device=o.device)
        extend(*(t if t.stride(-1) == 1 else t.contiguous() for t in (q, new_k, new_v, o)), lse, out, lse_out,
               scale, causal)
        return out, lse_out
    o_n, lse_n = _new_state_torch(q, new_k, new_v, scale, causal)
    out = torch.empty_like(o, memory_format=torch.contiguous_format)
    lse_out = torch.empty((B, H, T), dtype=torch.float32, device=o.device)
    # the torch backend's split merge over the two states (fp32 partials [2, B, Hq, Sq, D])
    backends.get("torch").merge(torch.stack((o.float(), o_n)).transpose(2, 3), torch.stack((lse.float(), lse_n)),
                                torch.full((B,), 2, dtype=torch.int32, device=o.device), out, lse_out)
    return out, lse_out


__all__ = ["attend_new_keys"]
