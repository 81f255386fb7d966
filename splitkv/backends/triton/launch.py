"""Launch glue for the Triton kernels: strides, grids, the interpreter switch. No decisions: the
plan carries the tile (block_m/n, warps, stages as launched), the split rule and whether the merge
is fused (splitkv/plan.py, from heuristics.py)."""

from __future__ import annotations

import os

import torch

from ...constants import LOG2E
from ...variants import PLAIN
from .extend_kernel import extend_kernel
from .fastlaunch import Bound, FastLauncher
from .merge_kernel import merge_kernel
from .schedule_kernel import schedule_kernel
from .split_kernel import split_kernel

_split = FastLauncher(split_kernel)
_merge = FastLauncher(merge_kernel)
_schedule = FastLauncher(schedule_kernel)
_extend = FastLauncher(extend_kernel)
_MODES = {"auto": 0, "forced": 1, "fixed": 2}
V_PAIRS = True  # fp8 V by int16 words (split_kernel V_PAIRS); False: byte by byte, as before
HOIST_ROWS = False  # fp8 contiguous: loop-invariant row offsets (split_kernel HOIST_ROWS); a probe until measured
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read when triton is imported, as Triton does


def _merge_block_s(max_splits: int) -> int:
    return min(16, 1 << max(0, (max_splits - 1).bit_length()))


def schedule(cache_seqlens, sched, rule, bound: Bound | None = None, work=None) -> None:
    """sched [2, >= B] <- (num_splits, chunk_lens) of heuristics.schedule, computed on the device;
    and work [2, items] <- heuristics.work_list of them, where given."""
    B = cache_seqlens.shape[0]
    if B == 0:
        return

    def build():
        block_b = max(16, 1 << (B - 1).bit_length())
        return (_schedule, (B, cache_seqlens.stride(0), sched.stride(0), work.stride(0) if work is not None else 0,
                            work.shape[1] if work is not None else 0, rule.max_splits, rule.splits,
                            rule.chunk_tiles, rule.target, rule.ragged_target, rule.min_tiles, rule.span_cap),
                dict(MODE=_MODES[rule.mode], BLOCK_N=rule.block_n, BLOCK_B=block_b,
                     SHORT_KEYS=rule.short_keys, CAP=rule.cap, BALANCE=rule.balance, HAS_WORK=work is not None,
                     BLOCK_W=max(16, 4096 // block_b)), 4, 1)

    tensors = (cache_seqlens, sched, work if work is not None else sched)
    if bound is None:
        fl, scalars, cx, w, st = build()
        fl((1,), tensors, scalars, cx, w, st)
        return
    bound.launch(("schedule", cache_seqlens.stride(0)), (1,), tensors,  # a Bound is one plan's: one rule
                 (cache_seqlens.data_ptr() & 15) == 0, build)


def _block_d(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()  # Triton tiles are powers of 2: D is padded and masked


def _merge_constexprs(H, T, D, S, skip_single, sinks) -> dict:
    return dict(NUM_HEADS=H, T=T, HEAD_DIM=D, BLOCK_S=_merge_block_s(S), SKIP_SINGLE=skip_single,
                BLOCK_D=_block_d(D), SINKS=sinks)


def merge(o_part, lse_part, num_splits, out, lse, *, skip_single=False, sinks=None):
    """out [B, T, H, D], lse [B, H, T] <- merge of o_part [S, B, H, T, D], lse_part [S, B, H, T]
    (sinks: float32 [H] attention-sink logits joined to each row once, or None)."""
    S, B, H, T, D = o_part.shape
    if B * H * T == 0:
        return
    _merge((B * H * T,), (o_part, lse_part, num_splits, out, lse, sinks if sinks is not None else num_splits),
           (S, *o_part.stride()[:4], *lse_part.stride(), out.stride(0), out.stride(1), out.stride(2), *lse.stride()),
           _merge_constexprs(H, T, D, S, skip_single, sinks is not None), 4 if D >= 128 else 2, 1)


def extend(q, new_k, new_v, o, lse, out, lse_out, scale: float, causal: bool) -> None:
    """out, lse_out <- the state (o, lse) joined by the step's own keys (splitkv.extend)."""
    B, T, H, D = q.shape
    if B * H * T == 0:
        return
    _extend((B * H * T,), (q, new_k, new_v, o, lse, out, lse_out),
            (float(scale), *q.stride()[:3], *new_k.stride()[:3], *new_v.stride()[:3], *o.stride()[:3],
             *lse.stride()[:2], *out.stride()[:3], *lse_out.stride()[:2]),
            dict(NUM_HEADS=H, GROUP=H // new_k.shape[2], T=T, HEAD_DIM=D, BLOCK_T=max(2, 1 << (T - 1).bit_length()),
                 BLOCK_D=_block_d(D), CAUSAL=bool(causal)), 4 if D >= 128 else 2, 1)


def _split_key(q, k_cache, v_cache, block_table, out, scale, causal, variant=PLAIN) -> tuple:
    # the plan fixes everything else (its workspace and tables are 128 / 16-byte aligned); lse is
    # always a contiguous [B, Hq, Sq]
    paged = block_table is not None
    return (q.stride(), k_cache.shape[1], k_cache.stride(), v_cache.stride(), out.stride(),
            block_table.stride(0) if paged else -1, causal, scale, q.dtype, k_cache.dtype, variant.kernel_key())


def _v_pairs(v_cache, variant) -> bool:
    """fp8 V read as int16 words of two columns (split_kernel V_PAIRS): every stride but D's (1) and the data
    pointer even, so no word straddles two rows. Only an aligned call's launch is cached (Bound), and
    16-byte alignment implies an even pointer."""
    return (variant.fp8 is not None and v_cache.shape[-1] % 2 == 0 and all(s % 2 == 0 for s in v_cache.stride()[:-1])
            and v_cache.data_ptr() % 2 == 0)


def _page_aligned(page_size: int, block_n: int, plan) -> bool:
    """PAGE_ALIGNED: the plan allows the aligned page lookup and every key tile starts at a multiple
    of min(page_size, block_n) keys (splits start at multiples of the rule's block_n: its chunk
    lengths are whole tiles)."""
    return (plan.aligned_pages and page_size & (page_size - 1) == 0
            and plan.rule.block_n % min(page_size, block_n) == 0)


def run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
        variant=PLAIN):
    B, Sq, Hq, D = q.shape
    if B == 0:
        return
    paged = block_table is not None
    bt = block_table if paged else cache_seqlens  # any int32 tensor: never read when not paged
    parts = o_part is not None
    op = o_part if parts else out  # never written when no request splits (num_splits == 1)
    lp = lse_part if parts else lse
    counters = plan.counters if plan.fuse else cache_seqlens  # never touched unless fused
    nsplits, chunks = plan.num_splits, plan.chunk_lens
    work = plan.work if plan.work is not None else nsplits  # never read without a work list
    sinks, slopes = variant.sinks, variant.alibi_slopes
    per_head = variant.fp8 == "head"
    tensors = (q, k_cache, v_cache, cache_seqlens, nsplits, chunks, work, bt, op, lp, out, lse, counters,
               *(t if t is not None else cache_seqlens for t in variant.tensors()))  # unused slots: never read
    key = _split_key(q, k_cache, v_cache, block_table, out, scale, causal, variant)
    aligned = ((q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | cache_seqlens.data_ptr() | bt.data_ptr()
                | out.data_ptr() | lse.data_ptr() | tensors[13].data_ptr() | tensors[14].data_ptr()
                | tensors[15].data_ptr() | tensors[16].data_ptr()) & 15) == 0
    groups = plan.num_kv_heads * plan.m_tiles
    # (request, head, m-tile) on x, split on y: CTAs dispatch in x-fastest order, so every working split
    # comes before the empty ones and spreads over the SMs (NOTES #33); gridDim.y stops at 65535
    grid = (groups, plan.work_items) if plan.work is not None else (B * groups, plan.max_splits)

    def build():
        tile = plan.tile
        qs, ks, vs = q.stride(), k_cache.stride(), v_cache.stride()
        p_strides = o_part.stride()[:4] if parts else (0, 0, 0, 0)
        l_strides = lse_part.stride()[:3] if parts else (0, 0, 0)
        cap = variant.softcap
        qk_mul, cap_mul = (scale / cap, cap * LOG2E) if cap > 0 else (scale * LOG2E, 1.0)
        v_mul = 1.0
        if variant.fp8 == "tensor":  # per-tensor fp8 scales: folded here (per-head ones in the kernel)
            qk_mul, v_mul = qk_mul * variant.k_scale, variant.v_scale
        win_left, win_right = variant.window_bounds()
        scalars = (qk_mul, cap_mul, v_mul, win_left, win_right, work.stride(0), qs[0], qs[1], qs[2], ks[0], ks[1], ks[2],
                   vs[0], vs[1], vs[2], bt.stride(0) if paged else 0, *p_strides, *l_strides, out.stride(0), out.stride(1),
                   out.stride(2), lse.stride(0), lse.stride(1))
        cx = dict(NUM_KV_HEADS=plan.num_kv_heads, M_TILES=plan.m_tiles, G=plan.qhead_per_kvhead, SQ=Sq,
                  HEAD_DIM=D, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                  PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
                  PAGE_ALIGNED=paged and _page_aligned(k_cache.shape[1], tile.block_n, plan),
                  CAUSAL=bool(causal and Sq > 1),
                  UPCAST=_INTERPRET, FUSED_MERGE=plan.fuse, BLOCK_D=_block_d(D), SOFTCAP=cap > 0,
                  ALIBI=slopes is not None, WINDOW=variant.windowed, SINKS=sinks is not None,
                  KV_FP8=variant.fp8 is not None, SCALE_PER_HEAD=per_head, HAS_WORK=plan.work is not None,
                  V_PAIRS=V_PAIRS and _v_pairs(v_cache, variant), E5M2=v_cache.dtype == torch.float8_e5m2,
                  HOIST_ROWS=HOIST_ROWS and variant.fp8 is not None and not paged)
        return _split, scalars, cx, tile.num_warps, tile.num_stages

    plan.launches.launch(("split", key), grid, tensors, aligned, build)
    if parts and not plan.fuse:
        S, _, H, T, _ = o_part.shape

        def build_merge():
            return (_merge, (S, *o_part.stride()[:4], *lse_part.stride(), out.stride(0), out.stride(1),
                             out.stride(2), *lse.stride()),
                    _merge_constexprs(H, T, D, S, True, sinks is not None), 4 if D >= 128 else 2, 1)

        plan.launches.launch(("merge", out.stride(), lse.stride(), sinks is not None), (B * H * T,),
                             (o_part, lse_part, nsplits, out, lse, tensors[13]), aligned, build_merge)


def bind(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal, variant=PLAIN):
    """launch(stream, q, k, v, lens, table, out, lse data pointers; table = lens when not paged)
    for calls laid out as this one, which run() has launched (and so compiled) already: the split
    launch, and the merge where the merge is not fused, with every other argument bound. The
    caller checks that the pointers are 16-byte aligned (the kernels were specialised so). None
    where only run() can launch (the interpreter, a layout run() did not cache)."""
    if _INTERPRET or q.shape[0] == 0:
        return None
    split_hit = plan.launches.entries.get(("split", _split_key(q, k_cache, v_cache, block_table, out, scale,
                                                               causal, variant)))
    split = split_hit[2] if split_hit is not None else None  # the plan's Bound made it with the grid run() used
    if split is None:
        return None
    ns, ch = plan.num_splits.data_ptr(), plan.chunk_lens.data_ptr()
    wk = plan.work.data_ptr() if plan.work is not None else ns
    none = (ns, ns, ns, ns)  # the variant tensor slots of a plain call: never read

    def slots(vptrs):  # a variant call's (sinks, alibi, k_scale, v_scale) pointers, 0 = none
        return none if vptrs is None else tuple(p or ns for p in vptrs)

    if plan.o_part is None:
        def launch(stream, qp, kp, vp, lens, bt, o, lse_p, vptrs=None):
            split(stream, qp, kp, vp, lens, ns, ch, wk, bt, o, lse_p, o, lse_p, lens, *slots(vptrs))

        return launch
    op, lp = plan.o_part.data_ptr(), plan.lse_part.data_ptr()
    if plan.fuse:
        cnt = plan.counters.data_ptr()

        def launch(stream, qp, kp, vp, lens, bt, o, lse_p, vptrs=None):
            split(stream, qp, kp, vp, lens, ns, ch, wk, bt, op, lp, o, lse_p, cnt, *slots(vptrs))

        return launch
    comb_hit = plan.launches.entries.get(("merge", out.stride(), lse.stride(), variant.sinks is not None))
    comb = comb_hit[2] if comb_hit is not None else None
    if comb is None:
        return None

    def launch(stream, qp, kp, vp, lens, bt, o, lse_p, vptrs=None):
        vt = slots(vptrs)
        split(stream, qp, kp, vp, lens, ns, ch, wk, bt, op, lp, o, lse_p, lens, *vt)
        comb(stream, op, lp, ns, o, lse_p, vt[0])  # the sinks (ns when none: never read)

    return launch
