"""merge_states: exact merge of attention states computed over disjoint key sets.

An attention state over keys K is (o, lse): o the softmax-weighted mean of K's values, lse the
natural-log sum of exp(scores). Two states over disjoint key sets merge exactly into the state
over their union:

    m = max(lse_a, lse_b);  w_x = exp(lse_x - m);  o = (w_a o_a + w_b o_b) / (w_a + w_b);
    lse = m + log(w_a + w_b)

An empty state (no key seen) weighs exactly 0 and its o is never read (it may hold NaN). Empty
is lse = -inf, and also lse = +inf: the value FlashAttention kernels return for a row with no
keys (vLLM's merge_attn_states reads it the same way), so their states merge as they are; +inf
never yields NaN. Merging only empty states gives o = 0, lse = -inf. A NaN lse is not empty: it
propagates, the merged o and lse of that row are NaN (as SDPA propagates a NaN input).

This is the split-KV merge with partials from anywhere: cascade attention (a shared prefix
attended once + per-request suffixes) and multi-GPU decode (each rank attends its shard of the
keys) are built from it.

Layouts follow decode: o [B, Sq, Hq, D], lse [B, Hq, Sq] fp32. The N-way form takes a stacked
leading axis, o [N, B, Sq, Hq, D], lse [N, B, Hq, Sq], and hands the merge a permuted view
(o_part [N, B, Hq, Sq, D]), so it copies nothing. On CUDA the Triton merge kernel runs it; on
the CPU the torch merge. Both go through the splitkv::merge custom op (torch.compile safe).
"""

from __future__ import annotations

import torch

from . import ops


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")


def _check_lse(name: str, lse: torch.Tensor, want: tuple, device) -> None:
    if tuple(lse.shape) != want:
        raise ValueError(f"{name}: expected shape {want} ([..., B, Hq, Sq], decode's lse layout), "
                         f"got {tuple(lse.shape)}")
    if lse.device != device:
        raise ValueError(f"{name}: on {lse.device} but the o states are on {device}")


def merge_states_n(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N states stacked on a leading axis: o [N, B, Sq, Hq, D], lse [N, B, Hq, Sq] ->
    (o [B, Sq, Hq, D] in o's dtype, lse [B, Hq, Sq] fp32).

    lse = -inf or +inf marks an empty state (weight 0, o never read); all empty -> o = 0,
    lse = -inf; a NaN lse makes that row's o and lse NaN."""
    _check_tensor("o", o)
    _check_tensor("lse", lse)
    if o.dim() != 5:
        raise ValueError(f"o: expected rank 5 [N, B, Sq, Hq, D], got shape {tuple(o.shape)}")
    N, B, Sq, Hq, D = o.shape
    if N < 1:
        raise ValueError("o: expected at least one state on the leading axis (N >= 1), got N = 0")
    _check_lse("lse", lse, (N, B, Hq, Sq), o.device)
    if o.stride(-1) != 1:
        o = o.contiguous()  # the kernels read D with unit stride
    if lse.dtype != torch.float32:
        lse = lse.float()
    num_splits = torch.full((B,), N, dtype=torch.int32, device=o.device)
    return ops.merge_op(o.permute(0, 1, 3, 2, 4), lse, num_splits)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """State over keys A ∪ B from the states over disjoint A and B.

    o_a, o_b [B, Sq, Hq, D] (same dtype); lse_a, lse_b [B, Hq, Sq] (fp32, natural log).
    Returns (o [B, Sq, Hq, D] in o_a's dtype, lse [B, Hq, Sq] fp32).

    A state with lse = -inf or lse = +inf (FlashAttention's value for a row with no keys) is
    empty: it weighs 0 and its o is never read, so o_b passes through unchanged (and vice versa);
    both empty -> o = 0, lse = -inf. A NaN lse propagates: that row's o and lse are NaN.
    """
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        _check_tensor(name, t)
    if o_a.dim() != 4:
        raise ValueError(f"o_a: expected rank 4 [B, Sq, Hq, D], got shape {tuple(o_a.shape)}")
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b: shape {tuple(o_b.shape)} does not match o_a's {tuple(o_a.shape)}")
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"o_b: dtype {o_b.dtype} does not match o_a's {o_a.dtype}")
    if o_b.device != o_a.device:
        raise ValueError(f"o_b: on {o_b.device} but o_a is on {o_a.device}")
    B, Sq, Hq, _ = o_a.shape
    _check_lse("lse_a", lse_a, (B, Hq, Sq), o_a.device)
    _check_lse("lse_b", lse_b, (B, Hq, Sq), o_a.device)
    # one small copy of two decode-sized outputs buys a single merge launch
    o = torch.stack((o_a, o_b))
    lse = torch.stack((lse_a.float(), lse_b.float()))
    return merge_states_n(o, lse)
