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

Split-KV with these: the window is split-aware (the planner and the kernels start request b at its
first visible key, max(0, L_b - Sq - l): a 4K window over a 128K cache reads 4K keys + Sq), and
the sink enters where the splits are merged (once per row), never in a split's partial state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FAR = 1 << 30  # an unbounded window side, as the kernels take it (positions stay far below 2^30)


@dataclass(frozen=True, eq=False)
class Variant:
    """One call's variant options, checked (see the module docstring for the math)."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return (self.window_left < 0 and self.window_right < 0 and self.softcap == 0.0 and self.sinks is None
                and self.alibi_slopes is None)

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def key(self) -> tuple:
        """What a compiled kernel and a plan depend on (the tensors' values are call arguments)."""
        return (self.window_left, self.window_right, self.softcap, self.sinks is not None,
                self.alibi_slopes is not None)

    def window_bounds(self) -> tuple[int, int]:
        """(left, right) keys of reach, an unbounded side as a large number (what kernels take)."""
        return (self.window_left if self.window_left >= 0 else _FAR,
                self.window_right if self.window_right >= 0 else _FAR)


PLAIN = Variant()


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


def make(window_size=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, *, num_q_heads: int,
         device) -> Variant:
    """A checked Variant from decode's keyword arguments; every error names the argument."""
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
    return Variant(int(window_size[0]), int(window_size[1]), float(softcap), sinks, alibi_slopes)
