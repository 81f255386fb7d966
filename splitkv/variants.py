"""Attention variants: sliding window, logit softcap, attention sinks, ALiBi.

The conventions are FlashAttention's (`flash_attn_with_kvcache`), with the query at absolute
position p (query i of Sq sits at p = L - Sq + i, bottom-right aligned) and key j in 0 .. L-1:

    s_j = scale * q . k_j
    softcap > 0:     s_j = softcap * tanh(s_j / softcap)
    alibi_slopes:    s_j = s_j - slope[h] * |j - p|            (slopes float32 [Hq])
    window (l, r):   key j is visible iff p - l <= j <= p + r   (-1: unbounded on that side;
                     causal=True bounds the right side at p whatever r is)
    sinks:           o = sum_j exp(s_j) v_j / (exp(sink[h]) + sum_j exp(s_j))   (float32 [Hq])

A sink is a per-head logit that joins the softmax denominator and has no value (gpt-oss,
StreamingLLM). The returned lse includes it: lse = log(exp(sink) + sum_j exp(s_j)), so a row that
sees no key gets o = 0 and lse = sink (-inf without sinks). To merge states yourself
(merge_states, cascades), give the sinks to one of the merged calls only: a sink enters each
softmax row once.

FP8 KV caches ride along (they are call options beyond plain decode too): k_cache / v_cache in
float8_e4m3fn or float8_e5m2 hold K / k_scale and V / v_scale, with k_scale, v_scale either one
float (per tensor) or float32 [Hkv] (per KV head). Decode reads fp8, converts in registers, folds
k_scale into the softmax scale and v_scale into the output: o = softmax(q . (k_scale k)) (v_scale v).

Split-KV with these: the window is split-aware (the planner and the kernels start request b at its
first visible key, max(0, L_b - Sq - l): a 4K window over a 128K cache reads 4K keys + Sq), and
the sink enters where the splits are merged (once per row), never in a split's partial state.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .constants import UNBOUNDED


@dataclass(frozen=True, eq=False)
class Variant:
    """One call's variant options, checked (see the module docstring for the math)."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    k_scale: float | torch.Tensor | None = None  # fp8 caches only: a float, or float32 [Hkv]
    v_scale: float | torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return (self.window_left < 0 and self.window_right < 0 and self.softcap == 0.0 and self.sinks is None
                and self.alibi_slopes is None and self.k_scale is None)

    @property
    def fp8(self) -> str | None:
        """None (not an fp8 cache), "tensor" (float scales) or "head" (float32 [Hkv] scales)."""
        if self.k_scale is None:
            return None
        return "head" if isinstance(self.k_scale, torch.Tensor) else "tensor"

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def key(self) -> tuple:
        """What a plan depends on (tensor values and per-tensor fp8 scales are call arguments)."""
        return (self.window_left, self.window_right, self.softcap, self.sinks is not None,
                self.alibi_slopes is not None, self.fp8)

    def kernel_key(self) -> tuple:
        """What a bound kernel launch depends on: key() and the per-tensor fp8 scales it folds in."""
        return self._kernel_key

    @functools.cached_property
    def _kernel_key(self) -> tuple:  # the fields never change: made once per Variant (a lean call reads it)
        if self.fp8 == "tensor":
            return (*self.key(), self.k_scale, self.v_scale)
        return self.key()

    @functools.cached_property
    def _no_tensors(self) -> bool:
        return self.sinks is None and self.alibi_slopes is None and self.fp8 != "head"

    def tensors(self) -> tuple:
        """(sinks, alibi_slopes, k_scale, v_scale) as kernels take them: a tensor or None (per-tensor
        scales are folded into the launch's scalars)."""
        per_head = self.fp8 == "head"
        return (self.sinks, self.alibi_slopes, self.k_scale if per_head else None, self.v_scale if per_head else None)

    def pointers(self) -> tuple | None:
        """tensors() as data pointers (0 for None), what a bound launch takes per call; None when one
        is not 16-byte aligned (the kernels are specialised for aligned pointers)."""
        if self._no_tensors:
            return _NO_POINTERS
        ptrs = tuple(t.data_ptr() if t is not None else 0 for t in self.tensors())
        return None if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15 else ptrs

    def window_bounds(self) -> tuple[int, int]:
        """(left, right) keys of reach, an unbounded side as a large number (what kernels take)."""
        return (self.window_left if self.window_left >= 0 else UNBOUNDED,
                self.window_right if self.window_right >= 0 else UNBOUNDED)

    def span_cap(self, q_len: int) -> int:
        """Keys the queries of a request can see at most: Sq + left with a left window (the
        planner splits only these; first_key is where they start), UNBOUNDED without one."""
        return q_len + self.window_left if self.window_left >= 0 else UNBOUNDED


PLAIN = Variant()
PLAIN_KEY = PLAIN.key()
_NO_POINTERS = (0, 0, 0, 0)
# checked Variants of calls whose options are all Python scalars (window, softcap, per-tensor fp8
# scales): such a Variant depends on those values and the cache dtype only, so a
# repeated call (every layer of every step) skips make()'s checks (~10-18 us of host on the CPU)
_SCALAR_VARIANTS: dict = {}
_SCALAR_VARIANTS_MAX = 256


def first_key(seqlens: torch.Tensor, q_len: int, window_left: int) -> torch.Tensor:
    """The first key any query of a request can see: max(0, L - Sq - left) (0 without a left
    bound). The planner counts keys from here and the kernels start here (the same formula)."""
    if window_left < 0:
        return torch.zeros_like(seqlens)
    return (seqlens - q_len - window_left).clamp(min=0)


def _tensor_arg(name: str, t, num_q_heads: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a float32 tensor [Hq] or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype float32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != num_q_heads:
        raise ValueError(f"{name}: expected shape [{num_q_heads}] (one per query head), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device} but q is on {device}")
    if t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride(0)}")


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _scale_arg(name: str, s, num_kv_heads: int, device):
    if isinstance(s, torch.Tensor):
        if s.dtype != torch.float32 or s.dim() != 1 or s.shape[0] != num_kv_heads or s.stride(0) != 1:
            raise ValueError(f"{name}: expected a float or a contiguous float32 tensor [{num_kv_heads}] (one per "
                             f"KV head), got {s.dtype} {tuple(s.shape)}")
        if s.device != device:
            raise ValueError(f"{name}: on {s.device} but q is on {device}")
        return s
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"{name}: expected a finite float > 0 or a float32 tensor [{num_kv_heads}], got {s!r}")
    return float(s)


def make(window_size=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, *, num_q_heads: int,
         device, k_scale=None, v_scale=None, kv_dtype=None, num_kv_heads: int = 1) -> Variant:
    """A checked Variant from decode's keyword arguments; every error names the argument.
    kv_dtype: the cache's dtype (fp8 caches need k_scale and v_scale; others take none)."""
    if window_size is None:
        window_size = (-1, -1)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size: expected (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}")
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap)
            or softcap < 0):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap!r}")
    if sinks is not None:
        _tensor_arg("sinks", sinks, num_q_heads, device)
    if alibi_slopes is not None:
        _tensor_arg("alibi_slopes", alibi_slopes, num_q_heads, device)
    if kv_dtype in FP8_DTYPES:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                raise ValueError(f"{name}: required with a {kv_dtype} cache (the cache holds K / k_scale and "
                                 f"V / v_scale; pass 1.0 for unscaled values)")
        k_scale = _scale_arg("k_scale", k_scale, num_kv_heads, device)
        v_scale = _scale_arg("v_scale", v_scale, num_kv_heads, device)
        if isinstance(k_scale, torch.Tensor) != isinstance(v_scale, torch.Tensor):
            raise ValueError("v_scale: give k_scale and v_scale at the same granularity (both floats or both "
                             "float32 [Hkv] tensors)")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{'k_scale' if k_scale is not None else 'v_scale'}: only for float8 caches "
                         f"({FP8_DTYPES}), the cache is {kv_dtype}")
    return Variant(int(window_size[0]), int(window_size[1]), float(softcap), sinks, alibi_slopes, k_scale, v_scale)


def scalar_key(window_size, softcap, k_scale, v_scale, kv_dtype) -> tuple | None:
    """The _SCALAR_VARIANTS key of a call without tensor options, or None (not cacheable: a tensor
    option, a list window, a bool where a number goes — True == 1 — : make() checks those every call)."""
    if window_size is not None and (type(window_size) is not tuple or len(window_size) != 2
                                    or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    ts, tk, tv = type(softcap), type(k_scale), type(v_scale)
    if ts not in (float, int) or tk not in (float, int, type(None)) or tv not in (float, int, type(None)):
        return None
    return window_size, softcap, k_scale, v_scale, kv_dtype


def cached_scalar(key: tuple | None, build) -> Variant:
    """The Variant remembered under key, else build() (which checks, and raises on bad values:
    nothing is remembered then), remembered when key is not None."""
    hit = _SCALAR_VARIANTS.get(key) if key is not None else None
    if hit is not None:
        return hit
    variant = build()
    if key is not None:
        if len(_SCALAR_VARIANTS) >= _SCALAR_VARIANTS_MAX:
            _SCALAR_VARIANTS.clear()
        _SCALAR_VARIANTS[key] = variant
    return variant
