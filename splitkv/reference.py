"""The truth: decode attention in plain PyTorch, fp64 (or fp32), one request at a time.

Used by tests and benchmarks to check every backend; never used by a backend. It is written for
clarity, not speed: it gathers each request's keys (dense or through the block table), builds the
bottom-right causal mask explicitly and runs a softmax in high precision.

Semantics (the contract every backend matches):
  * request b has cache_seqlens[b] valid keys at positions 0 .. L_b-1;
  * query i of Sq sits at absolute position L_b - Sq + i; with causal=True it sees keys at
    positions <= its own, otherwise every valid key;
  * query head h reads KV head h // (Hq // Hkv);
  * a query that sees no key gets o = 0 and lse = -inf (lse = its sink with sinks);
  * variants (splitkv.variants has the exact math, FlashAttention's conventions): sliding
    window_size=(left, right), logit softcap, ALiBi slopes, attention sinks;
  * NaN in q or in a key / value the query uses propagates to its o and lse (as in SDPA).
"""

from __future__ import annotations

import math

import torch


def gather_keys(cache: torch.Tensor, b: int, length: int, block_table: torch.Tensor | None) -> torch.Tensor:
    """Return [length, Hkv, D] keys (or values) of request b, dense or paged."""
    if block_table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    pages = block_table[b, pos // page_size].long()
    return cache[pages, pos % page_size]


def _future(L: int, Sq: int, device) -> torch.Tensor:
    """[1, Sq, L] True where key position > query position (query i sits at L - Sq + i)."""
    qpos = torch.arange(Sq, device=device) + (L - Sq)
    return torch.arange(L, device=device)[None, None, :] > qpos[None, :, None]


def _dequant(x: torch.Tensor, scale, dtype) -> torch.Tensor:
    """x [L, Hkv, D] in `dtype`, times its scale (a float, or one per KV head) when given."""
    x = x.to(dtype)
    if scale is None:
        return x
    if isinstance(scale, torch.Tensor):
        return x * scale.to(device=x.device, dtype=dtype)[None, :, None]
    return x * scale


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode attention. Returns (o [B, Sq, Hq, D] in `dtype`, lse [B, Hq, Sq] in `dtype`).
    k_scale / v_scale (float, or [Hkv]): the cache holds K / k_scale and V / v_scale (an fp8
    cache); they are dequantised exactly (in `dtype`) before anything else."""
    B, Sq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    o = torch.zeros(B, Sq, Hq, D, dtype=dtype, device=q.device)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=dtype, device=q.device)
    lengths = [int(x) for x in cache_seqlens.tolist()]
    for b, L in enumerate(lengths):
        if L == 0:
            continue
        # keys before a left window's reach are seen by no query: never gathered (NaN there stays out)
        lo = max(0, L - Sq - window_size[0]) if window_size[0] >= 0 else 0
        k = _dequant(gather_keys(k_cache, b, L, block_table)[lo:], k_scale, dtype).repeat_interleave(group, dim=1)
        v = _dequant(gather_keys(v_cache, b, L, block_table)[lo:], v_scale, dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b].to(dtype), k) * scale  # [Hq, Sq, L - lo]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(Sq, device=q.device)[:, None] + (L - Sq)  # [Sq, 1]
        dist = torch.arange(lo, L, device=q.device)[None, :] - qpos  # [Sq, L - lo]: key - query position
        if alibi_slopes is not None:
            s = s - alibi_slopes.to(dtype)[:, None, None] * dist.abs().to(dtype)
        hidden = torch.zeros_like(dist, dtype=torch.bool)
        if causal:
            hidden |= dist > 0
        if window_size[0] >= 0:
            hidden |= dist < -window_size[0]
        if window_size[1] >= 0:
            hidden |= dist > window_size[1]
        s = s.masked_fill(hidden, -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # [Hq, Sq]
        # rows with no key: exp(-inf + inf) = NaN -> 0; NaN scores (NaN in q / k) stay NaN
        p = torch.exp(s - row_lse[..., None]).masked_fill((row_lse == -math.inf)[..., None], 0.0)
        if bool(hidden.any()):  # per query over its visible keys only: 0 x NaN of a hidden value is NaN
            for t in range(Sq):
                seen = ~hidden[t]
                o[b, t] = torch.einsum("hk,khd->hd", p[:, t, seen], v[seen])
        else:
            o[b] = torch.einsum("hqk,khd->qhd", p, v)
        lse[b] = row_lse
    if sinks is not None:  # one more softmax term per row, with no value: o shrinks, lse grows
        sink = sinks.to(dtype)[None, :, None].expand_as(lse)
        full = torch.logaddexp(lse, sink)
        w = torch.where(full == -math.inf, 1.0, torch.exp(lse - full))  # NaN stays NaN
        o = o * w.permute(0, 2, 1)[..., None]
        lse = full
    return o, lse


def decode_lowp(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    """The same math done by PyTorch in q's low dtype (scores, softmax and P@V all in fp16/bf16).

    Tests use its error against decode_reference as the yardstick for ours ("our error <= 2x
    PyTorch's own low-precision error"). Contiguous caches only.
    """
    B, Sq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    o = torch.zeros_like(q)
    for b, L in enumerate(int(x) for x in cache_seqlens.tolist()):
        if L == 0:
            continue
        k = k_cache[b, :L].repeat_interleave(group, dim=1)
        v = v_cache[b, :L].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b], k) * scale
        if causal:
            s = s.masked_fill(_future(L, Sq, q.device), -math.inf)
        p = torch.softmax(s.float(), dim=-1).to(q.dtype).nan_to_num(0.0)
        o[b] = torch.einsum("hqk,khd->qhd", p, v)
    return o
