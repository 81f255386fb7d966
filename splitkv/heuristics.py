"""Every tuning decision of splitkv, as pure functions of (problem, device facts).

No CUDA calls here: the SM count is an argument, so the planner is unit-tested on a CPU with fake
SM counts, and every backend (torch, triton, cutlass) takes its split table from the same rules.

Split rule — FlashInfer-style chunk length, chosen over FA3-style per-batch num_splits because:
  * one chunk length for the whole batch gives each request ceil(L_b / chunk) splits, so long
    requests get more splits than short ones and every block streams at most `chunk` keys: a
    ragged batch is balanced by construction (no block waits on a 128K request's single split);
  * the per-request rule is one integer division, written once (`splits_for_lengths`) and run on
    host ints or on device tensors — the same rule drives eager plans and CUDA-graph plans whose
    lengths change on the GPU between replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Aim for this many resident blocks per SM when splitting. One wave of single blocks leaves no
# block to hide a neighbour's tail or its prologue; two per SM fit (a 64x128 fp32 accumulator plus
# a 3-stage K/V pipeline is ~100 KB of shared memory at D=128), so the target is 2 waves.
# H200 (triton_tune.json, 2026-11-29, eager): B=1 GQA 128K 3.84 TB/s at 2 vs 3.66 at 1 and 3.27 at
# 4; B=16 GQA 128K 4.53 vs 4.21 / 3.69. The num_splits sweep (bench --num-splits sweep) put the
# planner within 0.8% of the best forced count on 6 shapes.
BLOCKS_PER_SM = 2

# The CuTe DSL kernel wants one wave of single blocks instead: its split CTAs keep two 32 KB K/V
# stages in flight each, enough to cover HBM latency alone, and fewer splits mean fewer partials
# for the fused merge and a shorter tail. H200 num_splits sweep (cutlass, graph replay, bf16 D 128,
# 2026-11-29, results/2026-11-29-h200-s3/sweep_*.json): the best count was the one that gives
# ~128 CTAs on every shape swept — B=1 GQA 32/8 128K 16 splits 122.3 us vs the 2-per-SM plan's 33:
# 125.9; B=1 MHA 32K 4 vs 8: 121.3 vs 126.1; B=1 GQA 32K 16 vs 32: 36.3 vs 38.3; B=4 GQA 32K 4 vs 8:
# 121.7 vs 124.1; B=4 GQA 128K 464.2 vs 474.1; B=1 MHA 128K 466.8 vs 475.7; B=1 MHA 4K 21.0 vs 21.8;
# B=4 GQA 4K 21.5 vs 22.2; B=1 GQA 4K: 16 either way (MIN_CHUNK_KEYS). Bench with this rule
# (bench_planner.md, same run as Triton's 2-per-SM plans): B=1 GQA 128K 123.0 vs Triton 127.8 us
# (4.36 TB/s), B=1 MHA 32K 122.4 vs 127.1, B=1 GQA 32K 36.2 vs 39.9. Paged caches keep two per SM:
# their row gather has one more dependent load to hide, and one per SM lost there (page 16, B=1
# GQA 128K 137.7 us vs 130.7 with 33 splits; B=4 GQA 32K 137.1 vs 129.8). Plans are sized for the
# backend and cache layout that will run them (plan.build_plan's `target`, `paged`).
CUTLASS_BLOCKS_PER_SM = 1


def blocks_per_sm(target: str, paged: bool = False) -> int:
    """Resident split blocks per SM the planner aims for, for the backend a plan is made for."""
    return CUTLASS_BLOCKS_PER_SM if target == "cutlass" and not paged else BLOCKS_PER_SM

# A split must stream at least this many keys. Each split pays a fixed cost: the Q tile load,
# the pipeline fill and a partial write + combine read of rows*D*4 bytes. At 256 keys a split
# reads 64 KB of K+V per KV head (D=64, bf16) against <= 16 KB of partials: overhead stays small.
MIN_CHUNK_KEYS = 256

# Upper bound on splits per request: the combine reads num_splits partial rows, and past ~128
# splits (1K keys each at 128K) the combine's reads, not the split kernel, dominate.
MAX_SPLITS = 128

# Query tile rows: tl.dot / mma needs M >= 16; past 64 rows (e.g. GQA 16 x Sq 16 = 256) the fp32
# accumulator (64 x D) is what fits in registers at D=256, so larger groups use several m-tiles.
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64

# Merge partials inside the split kernel (the last split block of a group to finish merges it, via
# an atomic counter) instead of a second combine launch — only up to this many splits. Measured on
# the H200 (graph replay, bf16 D=128, 2026-11-29): with 8 splits fused wins (B=4 GQA 4K 26.5 us vs
# 28.3; B=1 MHA 4K 25.5 vs 28.0; B=1 MHA 32K 128.9 vs 131.9); with 16-33 splits the merging block's
# serial walk over the splits costs more than the launch it saves (B=1 GQA 4K 17.0 vs 14.3 us;
# 32K 52.2 vs 44.5), so the separate, row-parallel combine kernel runs instead.
FUSED_COMBINE_MAX_SPLITS = 8

# Notional SM count when planning for a CPU tensor (torch backend): it runs all splits as one
# vectorised batch, so splitting buys no parallelism; 16 keeps the padded work small while still
# exercising the split/combine path that the GPU uses.
CPU_NUM_SMS = 16


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the split kernel."""

    block_m: int  # packed query rows (qhead_per_kvhead x Sq) per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def cdiv(a, b):
    return -(-a // b)


def tile_config(head_dim: int, rows: int, splitting: bool = True) -> TileConfig:
    """Tile shape for `rows` packed query rows (qhead_per_kvhead * q_len) at `head_dim`.

    Measured on the H200 (benchmarks/triton_tune.py, bf16, D=128, 2026-11-29):
      * split plans (chunks of 256-8K keys): block_n 64, 4 warps, 3 stages was best or within 2%
        (B=1 GQA 32/8 4K graph replay: 14.6 us vs 16.3 for block_n 128; 32K: 44.5 vs 50.1);
      * unsplit plans (a whole long sequence per block): block_n 128, 4 warps, 3 stages streams
        better (B=16 MHA 32K: 4.61 TB/s vs 3.97; B=64 GQA 32K: 4.62 vs 3.90; B=16 MHA 4K graph:
        247 us vs 291), matching cuDNN.
    At D=256 the key tile halves and warps double so the fp32 accumulator (block_m x 256) and the
    K/V stages fit (not yet tuned on the GPU).
    """
    block_m = min(max(_next_pow2(rows), MIN_BLOCK_M), MAX_BLOCK_M)
    if head_dim >= 256:
        return TileConfig(block_m, 32, 8, 2)
    if splitting:
        return TileConfig(block_m, 64, 4, 3)
    return TileConfig(block_m, 128, 4, 3)


# Extra software-pipeline stages for a paged cache. Triton's pipeliner schedules the block-table
# load two stages ahead of the K/V loads it feeds, so at the same num_stages a paged kernel keeps
# fewer K/V tiles in flight: the sm_90 PTX of block_n 64 at 3 stages holds 2 tiles (32 cp.async,
# 39 KB smem) vs 3 contiguous (48, 71 KB); at 5 stages the paged kernel is back to 3 (48, 72 KB).
# H200 bench before this rule (2026-11-29, graph): paged(16) was 3-23% slower than contiguous.
PAGED_EXTRA_STAGES = 2


def launch_stages(tile: TileConfig, paged: bool) -> int:
    return tile.num_stages + (PAGED_EXTRA_STAGES if paged else 0)


def query_tiles(rows: int, block_m: int) -> int:
    return cdiv(rows, block_m)


def _blocks(tiles: list[int], chunk_tiles: int, per_split: int) -> int:
    return sum(max(1, cdiv(t, chunk_tiles)) for t in tiles) * per_split


def choose_chunk_len(seqlens: list[int], *, num_kv_heads: int, m_tiles: int, block_n: int,
                     num_sms: int, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Keys per split (a multiple of block_n) for the whole batch; >= max(seqlens) means no split.

    * No split when batch x KV heads x query tiles already fills the GPU (>= num_sms blocks):
      splitting then only adds partial traffic and a combine launch.
    * No split when the longest request has fewer than 2 x MIN_CHUNK_KEYS keys.
    * Otherwise the smallest chunk (>= MIN_CHUNK_KEYS, <= MAX_SPLITS splits per request) whose
      total block count stays within blocks_per_sm waves (BLOCKS_PER_SM, or the cutlass target).
    """
    tiles = [cdiv(max(L, 0), block_n) for L in seqlens] or [0]
    longest = max(tiles)
    no_split = max(longest, 1) * block_n
    per_split = num_kv_heads * m_tiles
    if len(seqlens) * per_split >= num_sms or longest * block_n < 2 * MIN_CHUNK_KEYS:
        return no_split
    lo = max(cdiv(MIN_CHUNK_KEYS, block_n), cdiv(longest, MAX_SPLITS))
    hi = longest
    target = num_sms * blocks_per_sm
    while lo < hi:  # smallest chunk whose block count fits the target (count is monotone in chunk)
        mid = (lo + hi) // 2
        if _blocks(tiles, mid, per_split) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo * block_n


def splits_for_lengths(seqlens, chunk_len: int, max_splits: int | None = None):
    """num_splits per request = ceil(L / chunk_len), at least 1 (an empty request has one empty
    split, which writes o = 0, lse = -inf). Works on a list of ints or an int tensor."""
    if isinstance(seqlens, torch.Tensor):
        n = torch.div(seqlens + (chunk_len - 1), chunk_len, rounding_mode="floor").clamp_(min=1)
        return n.clamp_(max=max_splits) if max_splits is not None else n
    n = [max(1, cdiv(int(L), chunk_len)) for L in seqlens]
    return [min(x, max_splits) for x in n] if max_splits is not None else n


def forced_chunk_lens(seqlens: list[int], num_splits: int, block_n: int) -> list[int]:
    """Chunk length per request when the caller forces num_splits: the request's keys cut into
    num_splits equal, block_n-aligned chunks (trailing chunks may be empty: lse = -inf)."""
    return [max(1, cdiv(cdiv(max(L, 0), num_splits), block_n)) * block_n for L in seqlens]


# Append kernel tile: a program holds BLOCK_H x BLOCK_D fp32 values of K (plus the RoPE partner):
# 4096 elements is 32 registers per thread for each at 4 warps — all heads of a GQA cache
# (8 x 128) in one program, while MHA caches (32-64 heads x 128) split over a few programs
# instead of spilling.
APPEND_TILE_ELEMS = 4096


def append_tile(num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(block_h, block_d, num_warps) of the PagedKVCache append kernel."""
    block_d = _next_pow2(head_dim)
    block_h = min(_next_pow2(num_kv_heads), max(1, APPEND_TILE_ELEMS // block_d))
    return block_h, block_d, 4 if block_h * block_d >= 2048 else 2


# CuTe DSL kernels launch with programmatic dependent launch (sm_90 PDL): each kernel waits
# (griddepcontrol.wait) for its predecessor's memory at its first instruction and lets its successor
# launch at once (griddepcontrol.launch_dependents), so the combine's CTAs, and the next call's split
# CTAs, are resident before the previous grid drains: the launch gap between the two kernels of a
# decode, and between decodes under a CUDA graph, overlaps the previous kernel's tail.
# Prediction before the H200 run: -1..2 us per decode on small shapes (B=1 GQA 4K graph: 11.0 us).
CUTLASS_PDL = True

# The CuTe DSL split kernel merges the partials itself (the last split CTA of each tile, all its
# threads in parallel: backends/cutlass/fused_merge.py) up to this many splits, instead of a combine
# launch. Prediction before the H200 run: the combine costs ~3 us of B=1 GQA 4K's 10.6 us (graph,
# split kernel alone 7.4 us); a parallel merge of 16 splits' partials from L2 should take ~1 us.
CUTLASS_FUSED_COMBINE_MAX_SPLITS = MAX_SPLITS


def cutlass_tile(head_dim: int, splitting: bool = True, paged: bool = False) -> tuple[int, int]:
    """(block_n, num_stages) of the CuTe DSL split kernel at `head_dim`.

    Split plans: every stage holds K and V tiles of block_n x D (2 B each); the rule keeps a stage
    at 32 KB for D <= 128 and 3 stages = 96 KB, so two blocks fit per SM (2 x ~100 KB of 228 KB)
    and each keeps two stages (64 KB) in flight while it computes on the third: ~130 KB in flight
    per SM, far more than the ~30 KB that covers HBM latency at 4.8 TB/s over 132 SMs. D = 256
    needs block_n >= 64 (16 keys per warp for the 4 key-split warps), so 64 KB stages, 2 of them.

    Unsplit plans at D = 128 (one CTA streams a whole sequence; B >= 16 grids of 256-512 CTAs):
    block_n 128, 2 stages (128 KB, one CTA per SM). H200 sweep (2026-11-29, graph replay, bf16,
    benchmarks/gpu_cutlass.py --phases sweep, results/2026-11-29-h200-s3/gpu_cutlass_sweep.json):
    B=16 MHA 32K n64 s3 1937 us, n128 s3 1916, n128 s2 1907; B=64 GQA 32/8 32K 1914 / 1904 / 1890
    (Triton's n128 tile: 1901 / 1887 in the bench). Split plans keep n64 s3: B=1 GQA 32K 38.2 us
    vs 41.6 (n128 s3) and 42.3 (n128 s2). Paged unsplit plans keep n64 s3: with n128 s2, page 16,
    B=16 MHA 32K took 1992 us vs Triton's 1886 in the same run (n64 s3: 1926 vs 1918 earlier).
    """
    if head_dim == 64:
        return 128, 3
    if head_dim == 128:
        return (64, 3) if splitting or paged else (128, 2)
    return 64, 2


# backend="auto" on sm90 with the CuTe DSL installed: cutlass for plans that split, Triton for plans
# that do not. Measured on the H200 (2026-11-29, bf16 D=128, CUDA-graph replay; benchmarks/results/
# 2026-11-29-h200/bench_peers.md, bench_paged_pdl.md, gpu_cutlass_pdl.json). Split plans, where the
# cutlass kernel merges the splits itself and launches with PDL: B=1 GQA 32/8 4K 10.1 us vs Triton
# 11.4, B=1 MHA 4K 21.7 vs 25.7, B=4 GQA 4K 22.3 vs 26.1, paged16 B=1 GQA 4K 10.4 vs 13.5, B=1 GQA
# 128K 128.0 vs 129.8, B=4 GQA 32K 123.9 vs 128.2; B=1 GQA 32K is a toss-up (42.2 vs 40.4 in the bench
# run, 38.0 / 38.4 vs 39.3 / 39.9 in two A/B runs). Unsplit plans (one CTA per sequence): Triton is
# still 0.3-1.0% faster after cutlass took block_n 128 x 2 stages there (cutlass_tile; results/
# 2026-11-29-h200-s3/bench_unsplit.md: B=64 GQA 32K 1881.5 vs 1887.2 us, B=16 MHA 32K 1888.6 vs
# 1907.9), so the rule below keeps Triton there.
# The demo's 1/32 greedy-token match with auto -> cutlass (2026-11-29, session 2) is a bf16 near-tie,
# not an attention error (benchmarks/hf_backend_check.py, results/2026-11-29-h200-s3/): on that
# model's own inputs, every layer and step, cutlass (fused, unfused, 1 split, dense) and Triton have
# the same max error vs the fp64 reference (0.06-0.12 on |o| <= 57, bf16 rounding); the first
# differing token is one where transformers' own top-2 logits are 0.25 apart (one bf16 step there)
# while both backends' logits differ from transformers' by 0.78 (Triton) / 0.81 (cutlass). Teacher-
# forced, 8 layers, 32K: max logit diff vs transformers 0.136 / 0.160 (B=1 / 4) vs Triton's 0.148 / 0.164.
AUTO_CUTLASS = True
AUTO_CUTLASS_MIN_SPLITS = 2


def auto_prefers_cutlass(max_splits: int) -> bool:
    return AUTO_CUTLASS and max_splits >= AUTO_CUTLASS_MIN_SPLITS
