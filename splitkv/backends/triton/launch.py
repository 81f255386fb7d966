"""Launch glue for the Triton kernels: strides, grids, the interpreter switch. No decisions:
tile sizes come from plan.tile (heuristics.py), split tables from the plan."""

from __future__ import annotations

import os

from ... import heuristics as H
from .combine_kernel import combine_kernel
from .fastlaunch import FastLauncher
from .split_kernel import LOG2E, split_kernel

_split = FastLauncher(split_kernel)
_combine = FastLauncher(combine_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _combine_block_s(max_splits: int) -> int:
    return min(16, 1 << max(0, (max_splits - 1).bit_length()))


def combine(o_part, lse_part, num_splits, out, lse, *, skip_single=False):
    """out [B, T, H, D], lse [B, H, T] <- merge of o_part [S, B, H, T, D], lse_part [S, B, H, T]."""
    S, B, H, T, D = o_part.shape
    if B * H * T == 0:
        return
    _combine((B * H * T,), (o_part, lse_part, num_splits, out, lse),
             (S, *o_part.stride()[:4], *lse_part.stride(), out.stride(0), out.stride(1), out.stride(2),
              *lse.stride()),
             dict(NUM_HEADS=H, T=T, HEAD_DIM=D, BLOCK_S=_combine_block_s(S), SKIP_SINGLE=skip_single),
             4 if D >= 128 else 2, 1)


def run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal):
    B, Sq, Hq, D = q.shape
    tile = plan.tile
    if B == 0:
        return
    paged = block_table is not None
    bt = block_table if paged else cache_seqlens  # any int32 tensor: never read when not paged
    parts = o_part is not None
    op = o_part if parts else out  # never written when no request splits (num_splits == 1)
    lp = lse_part if parts else lse
    p_strides = o_part.stride()[:4] if parts else (0, 0, 0, 0)
    l_strides = lse_part.stride()[:3] if parts else (0, 0, 0)
    grid = (plan.max_splits, B * plan.num_kv_heads * plan.m_tiles)
    fused = parts and plan.max_splits <= H.FUSED_COMBINE_MAX_SPLITS and plan.counters is not None
    counters = plan.counters if fused else plan.num_splits  # never touched unless fused
    qs, ks, vs = q.stride(), k_cache.stride(), v_cache.stride()
    _split(grid, (q, k_cache, v_cache, cache_seqlens, plan.num_splits, plan.chunk_lens, bt, op, lp, out, lse,
                  counters),
           (scale * LOG2E, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            bt.stride(0) if paged else 0, *p_strides, *l_strides, out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1)),
           dict(NUM_KV_HEADS=plan.num_kv_heads, M_TILES=plan.m_tiles, G=plan.qhead_per_kvhead, SQ=Sq,
                HEAD_DIM=D, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged, CAUSAL=bool(causal and Sq > 1),
                UPCAST=_interpreting(), FUSED_COMBINE=fused),
           tile.num_warps, H.launch_stages(tile, paged))
    if parts and not fused:
        combine(o_part, lse_part, plan.num_splits, out, lse, skip_single=True)

