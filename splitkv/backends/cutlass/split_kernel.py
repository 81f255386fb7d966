"""CuTe DSL split kernel (sm80+ instructions, built for sm_90a): one CTA = (split s, request b,
KV head, query tile), exactly the Triton split kernel's work unit and semantics.

Algorithm: online softmax (base 2) over keys [s * chunk_lens[b], min((s+1) * chunk_lens[b], L_b))
of request b (the last split, s = num_splits[b] - 1, runs on to L_b), with the qhead_per_kvhead
query heads x Sq tokens of the KV head packed as the rows of the query tile (packed row p ->
token p // G, head kvh * G + p % G), so each K/V byte is read once per KV head. Bottom-right
causal: token i sits at position L_b - Sq + i and sees keys <= it.

Layouts: q [B, Sq, Hq, D]; K/V contiguous [B, Lmax, Hkv, D] or paged [P, page_size, Hkv, D] +
block_table [B, max_pages]; any strides with unit stride on D and 16-byte aligned rows.
Outputs: num_splits[b] == 1 -> o [B, Sq, Hq, D] (q dtype) and lse [B, Hq, Sq] directly;
otherwise o_part [S, B, Hq, Sq, D] fp32 (normalised), lse_part [S, B, Hq, Sq] fp32 natural log,
-inf (and o_part 0) for a split that saw no key; with `fuse` the last split CTA of the tile then
merges them into o / lse (fused_merge.py). Deterministic: fixed order everywhere; the one atomic
(the fused merge's arrival counter) picks which CTA merges, never the arithmetic.

Design (4 warps, see config.SplitConfig):
  * memory pipeline: a ring of num_stages K+V tiles filled by 16-byte cp.async.cg, one commit
    group per tile, num_stages - 1 tiles in flight while the CTA computes on the oldest; each
    thread computes its rows' gmem addresses (so paged caches of any page size gather in place);
  * MMA: mma.sync m16n8k16 (fp32 accumulate), operands by ldmatrix from swizzled smem. Each warp
    owns 16 query rows and a slice of every tile's keys, with its own softmax state, merged once
    in the epilogue — a 16-row query tile (GQA 4..16, Sq = 1) keeps all 4 warps busy;
  * why mma.sync, not wgmma: decode is bound by HBM bytes, not by MMA issue (a 16-row tile does
    2 x 16 x D flops per K/V element pair read); wgmma's M = 64 per warpgroup would pad a
    16-row tile 4x and wants TMA + mbarriers, which a per-row paged gather cannot use unless
    page_size >= block_n (TMA per page is the next variant to try for page_size >= 64);
  * paged rows: a thread reads the block-table entries of all its rows of a tile (FastDivmod by
    page_size, one load each) together, one tile ahead of issuing their copies, so the table
    loads overlap each other and the MMA of the tile in between.
Measured alternatives (H200, bf16 D 128, CUDA-graph replay, 2026-11-29; benchmarks/NOTES.md #9-#11):
  * merge: fused here (fused_merge.py) vs a merge launch: B=1 GQA 4K 9.7 vs 10.6 us, B=1 MHA 4K
    20.9 vs 21.8, B=1 GQA 128K 125.1 vs 127.9, B=4 GQA 32K 123.9 vs 126.9; B=1 64/8 4K 11.5 vs
    11.3 and B=1 GQA 32K 38.0 vs 37.8 (noise level) -> fused for every split count;
  * programmatic dependent launch (griddepcontrol.wait / launch_dependents at the first
    instruction) vs plain launches, both with the merge kernel: -0.3..-2.1 us per decode over two
    runs (B=1 GQA 4K 10.6 vs 11.3, B=1 MHA 4K 21.8 vs 23.2, B=1 GQA 128K 127.9 vs 130.0);
    unsplit B=64 / B=16 shapes: within 1% (B=64 GQA 32K 1904 vs 1920);
  * the split kernel alone costs 7.3 us at B=1 GQA 4K (floor 3.6 us at 4.6 TB/s): the rest of the
    gap to the floor is in this kernel's ramp (Q + three scalars + first K/V tiles in series);
  * tiles: heuristics.cutlass_tile (the 2026-12-02 tile sweep, results/2026-12-02-h200-tune/tiles.md);
  * vs Triton on the same run: faster on split plans (B=1 GQA 4K 10.1 vs 11.4), 0.3-1.0% slower on
    unsplit plans even with the n128 tile (B=16 MHA 32K 1907.9 vs 1888.6).
`python -m splitkv bench --sweep-tiles --providers splitkv-cutlass` times (block_n, stages) alternatives.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from splitkv.backends.cutlass import fp8, layouts, score_mod
from splitkv.backends.cutlass.config import MMA_M, NUM_THREADS, SplitConfig
from splitkv.backends.cutlass.epilogue import Outputs, merge_and_store, scratch_layouts, stash_warp_state
from splitkv.backends.cutlass.fused_merge import is_last_arrival, merge_partials
from splitkv.backends.cutlass.mainloop import WarpAttention
from splitkv.backends.cutlass.paging import KVRows, gmem_vec, load_kv_tile, load_q_tile, lookup_pages
from splitkv.backends.cutlass.score_mod import RowBounds
from splitkv.backends.cutlass.softmax import OnlineSoftmax

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


class SplitKernel:
    def __init__(self, cfg: SplitConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]  # q and the output
        self.mma = DTYPES[cfg.mma_dtype]  # the MMAs' operands: fp16 for fp8 caches (fp8.py)
        # a K/V stage as copied: fp8 rows move as 16-bit pairs (fp8.py), D / 2 of them
        fp8 = bool(cfg.kv_fp8)
        self.kv_dtype = cutlass.Float16 if fp8 else self.dtype
        self.kv_cols = cfg.padded_dim // 2 if fp8 else cfg.padded_dim  # stage width, copy elements
        self.kv_real = cfg.head_dim // 2 if fp8 else cfg.head_dim  # ... of which real
        self.kv_bytes = 1 if fp8 else 2  # a cache element

    def __repr__(self):  # the DSL mangles the repr into the kernel's symbol: keep it stable
        return self.cfg.name

    @cute.jit
    def __call__(self, q: Int64, k: Int64, v: Int64, seqlens: Int64, nsplits: Int64, chunks: Int64,
                 block_table: Int64, o_part: Int64, lse_part: Int64, out: Int64, lse: Int64, counters: Int64,
                 sinks: Int64, alibi: Int64, k_scales: Int64, v_scales: Int64,
                 max_splits: Int32, batch: Int32, num_kv_heads: Int32, m_tiles: Int32, group: Int32,
                 q_len: Int32, page_size: Int32, causal: Int32, fuse: Int32, win_left: Int32, win_right: Int32,
                 s_qb: Int64, s_qt: Int64, s_qh: Int64, s_kb: Int64, s_kn: Int64, s_kh: Int64,
                 s_vb: Int64, s_vn: Int64, s_vh: Int64, s_btb: Int64,
                 s_ps: Int64, s_pb: Int64, s_ph: Int64, s_pt: Int64, s_ls: Int64, s_lb: Int64, s_lh: Int64,
                 s_ob: Int64, s_ot: Int64, s_oh: Int64, s_lob: Int64, s_loh: Int64, work: Int64, s_work: Int64,
                 scale_log2: Float32, pre_mul: Float32, v_mul: Float32, stream: cuda.CUstream):
        """Host side: launch grid (B * Hkv * m_tiles, max_splits), or with a work list (work != 0:
        int32 [2, s_work] of (request, split) items, heuristics.work_items) (Hkv * m_tiles, items),
        which the caller passes as batch = 1, max_splits = items. Addresses are raw device
        pointers (ints; sinks / alibi / per-KV-head fp8 scales 0 when the call has none), strides in
        elements. fp8: scale_log2 holds a per-tensor k_scale, v_mul the per-tensor v_scale."""
        self.kernel(q, k, v, seqlens, nsplits, chunks, block_table, o_part, lse_part, out, lse, counters,
                    sinks, alibi, k_scales, v_scales, num_kv_heads, m_tiles, group, q_len, page_size, causal, fuse,
                    win_left, win_right,
                    (s_qb, s_qt, s_qh), (s_kb, s_kn, s_kh), (s_vb, s_vn, s_vh), s_btb,
                    (s_ps, s_pb, s_ph, s_pt), (s_ls, s_lb, s_lh, Int64(1)), (s_ob, s_ot, s_oh),
                    (s_lob, s_loh), work, s_work, scale_log2, pre_mul, v_mul,
                    ).launch(grid=[batch * num_kv_heads * m_tiles, max_splits, 1],
                             block=[NUM_THREADS, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, q: Int64, k: Int64, v: Int64, seqlens: Int64, nsplits: Int64, chunks: Int64,
               block_table: Int64, o_part: Int64, lse_part: Int64, out: Int64, lse: Int64, counters: Int64,
               sinks: Int64, alibi: Int64, k_scales: Int64, v_scales: Int64, num_kv_heads: Int32, m_tiles: Int32,
               group: Int32, q_len: Int32, page_size: Int32, causal: Int32, fuse: Int32, win_left: Int32,
               win_right: Int32, q_strides, k_strides, v_strides, s_btb: Int64, part_strides, lpart_strides,
               out_strides, lse_strides, work: Int64, s_work: Int64, scale_log2: Float32, pre_mul: Float32,
               v_mul: Float32):
        cfg = self.cfg
        BM, BN, ST = cfg.block_m, cfg.block_n, cfg.num_stages
        D, DP = cfg.head_dim, cfg.padded_dim  # the model's head dim; the smem / MMA width (80, 96 -> 128)
        F8 = cfg.kv_fp8  # "" or the cache's fp8 format: stages of 16-bit pairs, DP / 2 wide (fp8.py)
        KW = self.kv_cols
        KPW, WN = cfg.keys_per_warp, cfg.warps_n
        tidx, _, _ = cute.arch.thread_idx()
        pid, split, _ = cute.arch.block_idx()  # (request, head, tile) on x: gridDim.y stops at 65535
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        wm = warp // WN
        wn = warp - wm * WN
        mt = pid % m_tiles
        kvh = (pid // m_tiles) % num_kv_heads
        b = pid // (m_tiles * num_kv_heads)

        if cutlass.const_expr(cfg.pdl):
            # PDL: the previous grid's writes (q, the cache, the plan) are visible after the wait;
            # the merge may launch now (it waits for this grid the same way)
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if work != 0:  # grid column `split` is item i of the work list: (request, split), -1 past the last
            wb = gmem_vec(Int32, work + Int64(split) * 4, 1, 4)[0]
            ws = gmem_vec(Int32, work + (s_work + Int64(split)) * 4, 1, 4)[0]
            b = cutlass.max(wb, 0)
            split = cutlass.max(ws, 0) + cutlass.max(-wb, 0) * (1 << 30)  # no item: past any split count
            pid = b * (m_tiles * num_kv_heads) + pid  # the fused merge's counter of (request, head, tile)
        # the three per-request scalars in one round trip (every b < batch is in bounds)
        n_splits = gmem_vec(Int32, nsplits + Int64(b) * 4, 1, 4)[0]
        seqlen = gmem_vec(Int32, seqlens + Int64(b) * 4, 1, 4)[0]
        chunk = gmem_vec(Int32, chunks + Int64(b) * 4, 1, 4)[0]
        if split < n_splits:
            first = 0  # the request's first visible key (variants.first_key): the planner split from here
            if cutlass.const_expr(cfg.window):
                first = cutlass.max(seqlen - q_len - win_left, 0)
            start = first + split * chunk
            end = cutlass.min(start + chunk, seqlen)
            if split == n_splits - 1:
                end = seqlen
            n_tiles = (cutlass.max(end - start, 0) + BN - 1) // BN
            num_rows = q_len * group
            row0 = mt * BM

            smem = cutlass.utils.SmemAllocator()
            sQ = smem.allocate_tensor(self.mma, layouts.smem_tile(BM, DP), 1024)
            # one region: the K and V rings, later overlaid by the epilogue's fp32 scratch
            ring = smem.allocate(cfg.smem_bytes - BM * DP * cfg.elem_bytes - 1024, 1024)
            sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)  # fused merge: "this CTA is last"
            kv_dtype = self.kv_dtype
            kv_layout = layouts.smem_tile(BN, KW, ST)
            sK = cute.make_tensor(cute.recast_ptr(ring, dtype=kv_dtype), kv_layout)
            sV = cute.make_tensor(cute.recast_ptr(ring, dtype=kv_dtype) + cute.cosize(kv_layout), kv_layout)

            qcopy = layouts.g2s_copy(self.mma)
            gcopy = layouts.g2s_copy(kv_dtype)
            thr_copy = gcopy.get_slice(tidx)
            q_copy = qcopy.get_slice(tidx)
            tQsQ = q_copy.partition_D(sQ)
            tQcQ = q_copy.partition_S(cute.make_identity_tensor((BM, DP)))
            tKsK = thr_copy.partition_D(sK)
            tVsV = thr_copy.partition_D(sV)
            tKcK = thr_copy.partition_S(cute.make_identity_tensor((BN, KW)))
            kv = KVRows.create(cfg.paged, kv_dtype, self.kv_real, k, v, k_strides, v_strides, kvh, b,
                               block_table, s_btb, page_size, self.kv_bytes)

            # paged: the table entries of the next tile to copy, read one tile ahead (lookup_pages)
            pages = None
            if cutlass.const_expr(cfg.paged):
                pages = cute.make_rmem_tensor(cute.make_layout(cute.size(tKcK, mode=[1])), Int32)
            # prologue: Q and the first num_stages - 1 tiles, one commit group per tile (fp8: Q is
            # converted to fp16 and stored in K's pair order after the tiles are in flight)
            if cutlass.const_expr(not F8):
                load_q_tile(qcopy, self.dtype, D, q, q_strides, tQsQ, tQcQ, row0, num_rows, group, b, kvh)
            for t in cutlass.range_constexpr(ST - 1):
                if t < n_tiles:
                    if cutlass.const_expr(cfg.paged):
                        lookup_pages(kv, tKcK, start + t * BN, end, pages)
                    load_kv_tile(gcopy, kv, tKsK[None, None, None, t], tVsV[None, None, None, t], tKcK,
                                 start + t * BN, end, pages)
                cute.arch.cp_async_commit_group()
            if cutlass.const_expr(cfg.paged):
                if ST - 1 < n_tiles:
                    lookup_pages(kv, tKcK, start + (ST - 1) * BN, end, pages)
            if cutlass.const_expr(F8):  # Q; per-KV-head fp8 scales (per-tensor ones came folded in)
                fp8.load_q_tile_f16(self.dtype, q, q_strides, sQ, tQcQ, row0, num_rows, group, b, kvh)
                if k_scales != 0:
                    scale_log2 = scale_log2 * gmem_vec(Float32, k_scales + Int64(kvh) * 4, 1, 4)[0]
                if v_scales != 0:
                    v_mul = gmem_vec(Float32, v_scales + Int64(kvh) * 4, 1, 4)[0]

            sQ_w = cute.local_tile(sQ, (MMA_M, DP), (wm, 0))
            wa = WarpAttention.create(self.mma, DP, KPW, lane, sQ_w)
            n_rows = cute.size(wa.s_coords, mode=[0])
            sm = OnlineSoftmax.create(n_rows, scale_log2)
            # key bounds of each of this thread's accumulator rows (score_mod.RowBounds): the split's
            # end, causal / window limits; tiles in [mask_below, mask_from - BN] need no mask
            rows = RowBounds.create(n_rows, cfg.window, cfg.alibi)
            for r in cutlass.range_constexpr(n_rows):
                rows.fill(r, row0 + wm * MMA_M + wa.s_coords[r, 0][0], group, kvh, seqlen, q_len, end, causal,
                          win_left, win_right, alibi, scale_log2)
            mask_from = end
            if causal != 0:
                mask_from = cutlass.min(end, seqlen - q_len + 1)
            mask_below = start  # window: keys below it are outside some row's window
            if cutlass.const_expr(cfg.window):
                mask_from = cutlass.min(mask_from, seqlen - q_len + win_right + 1)
                mask_below = seqlen - 1 - win_left

            for t in cutlass.range(n_tiles, unroll=1):
                # tile t has landed for every thread, and every warp is done with tile t - 1,
                # whose stage the next load overwrites
                cute.arch.cp_async_wait_group(ST - 2)
                cute.arch.barrier()
                nxt = t + ST - 1
                if nxt < n_tiles:
                    ns = nxt % ST
                    load_kv_tile(gcopy, kv, tKsK[None, None, None, ns], tVsV[None, None, None, ns], tKcK,
                                 start + nxt * BN, end, pages)
                    if cutlass.const_expr(cfg.paged):
                        if nxt + 1 < n_tiles:  # the next tile's table entries, in flight under this MMA
                            lookup_pages(kv, tKcK, start + (nxt + 1) * BN, end, pages)
                cute.arch.cp_async_commit_group()
                stage = t % ST
                n0 = start + t * BN
                sK_w = cute.local_tile(sK[None, None, stage], (KPW, KW), (wn, 0))  # fp8: [keys, D / 2] pairs
                sV_w = cute.local_tile(sV[None, None, stage], (KPW, KW), (wn, 0))
                if cutlass.const_expr(F8):
                    acc_s = fp8.scores(wa, sK_w, F8)
                else:
                    acc_s = wa.scores(sK_w)
                if cutlass.const_expr(cfg.softcap or cfg.alibi):
                    score_mod.apply(acc_s, wa.s_coords, n0 + wn * KPW, rows, cfg.softcap, pre_mul)
                if cutlass.const_expr(cfg.window):
                    if n0 + BN > mask_from or n0 < mask_below:
                        score_mod.mask(acc_s, wa.s_coords, n0 + wn * KPW, rows)
                elif n0 + BN > mask_from:
                    score_mod.mask(acc_s, wa.s_coords, n0 + wn * KPW, rows)
                sm.update(acc_s, wa.acc_o)
                if cutlass.const_expr(F8):
                    fp8.accumulate(wa, acc_s, sV_w, F8)
                else:
                    wa.accumulate(acc_s, sV_w)

            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # the K/V ring is free: the epilogue scratch overlays it
            if cutlass.const_expr(F8):  # v_scale: once, on the unnormalised output (it commutes with the rest)
                wa.acc_o.store(wa.acc_o.load() * v_mul)
            sm.finalize()
            red_layout, stats_layout = scratch_layouts(BM, DP, WN)
            scratch = cute.recast_ptr(ring, dtype=Float32)
            sRed = cute.make_tensor(scratch, red_layout)
            sMax = cute.make_tensor(scratch + cute.cosize(red_layout), stats_layout)
            sSum = cute.make_tensor(scratch + cute.cosize(red_layout) + cute.cosize(stats_layout), stats_layout)
            sRed_w = cute.local_tile(sRed[None, None, wn], (MMA_M, DP), (wm, 0))
            if cutlass.const_expr(F8):  # the accumulator's columns in the order V's pairs gave them
                sRed_w = cute.composition(sRed_w, fp8.out_columns(DP))
            stash_warp_state(wa, sm, sRed_w, sMax, sSum, wn, wm * MMA_M, lane)
            cute.arch.barrier()
            outs = Outputs(self.dtype, n_splits == 1, b, kvh, split, group, out, out_strides, lse,
                           lse_strides, o_part, part_strides, lse_part, lpart_strides, sinks)
            merge_and_store(sRed, sMax, sSum, outs, tidx, row0, num_rows, BM, D, WN)
            if n_splits > 1:
                if fuse != 0:  # the launch chose the fused merge (heuristics.CUTLASS_FUSED_MERGE_MAX_SPLITS)
                    if is_last_arrival(counters + Int64(pid) * 4, n_splits, sFlag, tidx):
                        final = Outputs(self.dtype, True, b, kvh, split, group, out, out_strides, lse,
                                        lse_strides, o_part, part_strides, lse_part, lpart_strides, sinks)
                        merge_partials(final, n_splits, tidx, row0, num_rows, BM, D)
