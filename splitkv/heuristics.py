"""Every tuning decision of splitkv, as pure functions of (problem, device facts).

No CUDA calls here: the SM count is an argument, so the planner is unit-tested on a CPU with fake
SM counts, and every backend (torch, triton, cutlass) takes its split table from the same rules.

Split rule — FlashInfer-style chunk length, chosen over FA3-style per-batch num_splits because:
  * one chunk length for the whole batch gives each request ceil(L_b / chunk) splits, so long
    requests get more splits than short ones and every block streams at most `chunk` keys: a
    ragged batch is balanced by construction (no block waits on a 128K request's single split);
  * the per-request rule is a handful of integer operations over the lengths, cheap enough to run
    on the GPU in one tiny kernel before the split kernel. So the host decides only what shapes
    decide (`split_rule`: grid bound, targets) and the lengths never travel to the host: no sync,
    and a plain decode call can be captured in a CUDA graph. `schedule` is the rule in PyTorch
    (the CPU path and the specification the GPU kernel is tested against).
Why not stream-K (equal key tiles per CTA across requests, a CTA spanning two requests): it needs
a CTA to write partials for two requests and a merge that knows the split map; the chunk rule
with a ragged re-plan (BALANCE) keeps every CTA inside one request with max/mean work <= 1.25.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, replace

import torch

from .constants import UNBOUNDED, padded_head_dim

# Aim for this many resident blocks per SM when splitting. One wave of single blocks leaves no
# block to hide a neighbour's tail or its prologue; two per SM fit (a 64x128 fp32 accumulator plus
# a 3-stage K/V pipeline is ~100 KB of shared memory at D=128), so the target is 2 waves.
# H200 num_splits sweep (Triton, graph replay, bf16 D 128, 2026-12-02,
# results/2026-12-02-h200-tune/sweep_triton.md): B=1 GQA 32/8 128K, the planner's 33 splits (two per
# SM) 129.4 us vs 136.9 at 16 (one per SM) and 155.2 at 64 (past one wave of two).
BLOCKS_PER_SM = 2

# The CuTe DSL kernel wants one wave of single blocks instead: its split CTAs keep two 32 KB K/V
# stages in flight each, enough to cover HBM latency alone, and fewer splits mean fewer partials
# for the fused merge and a shorter tail. H200 num_splits sweep (cutlass, graph replay, bf16 D 128,
# 2026-12-02, results/2026-12-02-h200-tune/sweep_cutlass.md): the best count is the one that gives
# ~128 CTAs, which the planner picks — B=1 GQA 32/8 128K 16 splits 124.6 us (planner 124.4) vs
# 128.5 at 32 and 129.1 at 33; B=1 MHA 32K 4 vs 8: 123.2 vs 128.3; B=1 GQA 32K 16 vs 32: 36.8 vs
# 38.7. Paged caches keep two per SM: their row gather has one more dependent load to hide, and
# one per SM lost there (2026-11-29, page 16: B=1 GQA 128K 137.7 us vs 130.7 with 33 splits; B=4
# GQA 32K 137.1 vs 129.8; benchmarks/NOTES.md #16-17). Plans are sized for the backend and cache
# layout that will run them (plan.build: the backend, `paged`).
CUTLASS_BLOCKS_PER_SM = 1


# Shared memory of one sm_90 SM: 228 KB, of which 1 KB is reserved per resident block.
SM90_SMEM_PER_SM = 228 * 1024


def cutlass_split_smem(head_dim: int, block_m: int, paged: bool, kv_fp8: bool = False) -> int:
    """Shared memory of the CuTe split kernel's split tile at `head_dim` (the query tile, the K/V
    ring of cutlass_tile(splitting=True), fp8 stages at 1 byte a value, and 1 KB of alignment
    slack): SplitConfig.smem_bytes, which a test holds this to."""
    block_n, stages = cutlass_tile(head_dim, splitting=True, paged=paged, kv_fp8=kv_fp8)
    padded = padded_head_dim(head_dim)
    ring = stages * 2 * block_n * padded * (1 if kv_fp8 else 2)
    return block_m * padded * 2 + ring + 1024


# Triton, fp8 caches: plans aim at two CTAs per SM like every Triton plan. The byte-by-byte V read's
# tile took 168 registers at GQA group 4 (three fit), and plans whose requests got few splits aimed
# at three there (B=16 GQA 32/8 32K e4m3: 423.8 -> 298.5 us, results/2026-12-03-h200-fp8-triton/).
# The tile that reads V by int16 words (split_kernel V_PAIRS) is faster at two per SM wherever it
# was measured (H200, graph replay, results/2026-12-04-h200-fp8v/): B=16 GQA 32/8 32K 248.0 us at
# two (2 splits) vs 254.1 with its registers capped at 168 for three (3 splits); B=16 GQA 64/8 32K,
# whose tile takes 168 registers on its own, 2 splits 242.6 vs 3 splits 254.5 (paged 16: 263.2 vs
# 296.4). So the rule and its register model (heuristics.triton_fp8_fit) went.

# Paged Triton tiles find a key row's page from its position. Where every tile starts at a multiple
# of min(page_size, block_n) keys (split starts are whole rule tiles; not with a sliding window) the
# kernel takes a tile's page ids from its index and a row's place in its page from the tile's constant
# row index, which the compiler hoists out of the key loop (split_kernel PAGE_ALIGNED; plan.build
# decides it). sm_90 SASS per key tile (Triton 3.6, D 128, paged 16, CPU compile): fp8 MHA 1382 ->
# 1125 instructions (contiguous 1083), bf16 split tile 691 -> 485 (387) with 168 -> 124 registers.
# H200, graph replay, paged 16 (results/2026-12-03-h200-paged-lookup/): e4m3 B=1 MHA 32K 106.3 ->
# 92.0 us (contiguous 86.2), bf16 Triton B=16 GQA 32K 526.8 -> 494.3.


def blocks_per_sm(target: str, paged: bool = False, head_dim: int = 128, block_m: int = 16,
                  kv_fp8: bool = False) -> int:
    """Resident split blocks per SM the planner aims for, for the backend a plan is made for: no
    more than fit in shared memory. A paged D 256 cutlass tile (137 KB) fits once per SM: sized for
    two, its plan ran a second wave (H200, 2026-12-03, B=1 GQA 32/8 32K paged 16: 78.8 us vs 68.8
    contiguous; results/2026-12-03-h200-paged/). Triton fp8: two (the note above)."""
    if target != "cutlass":
        return BLOCKS_PER_SM
    want = BLOCKS_PER_SM if paged or kv_fp8 else CUTLASS_BLOCKS_PER_SM  # fp8: two where they fit
    # (D 256's 64 x 3 tile); D 128's FP8_TILE fits once (cutlass_tile's sweep)
    fit = SM90_SMEM_PER_SM // (cutlass_split_smem(head_dim, block_m, paged, kv_fp8) + 1024)
    return max(1, min(want, fit))

# A split must stream at least this many keys. Each split pays a fixed cost: the Q tile load,
# the pipeline fill and a partial write + merge read of rows*D*4 bytes. At 256 keys a split
# reads 64 KB of K+V per KV head (D=64, bf16) against <= 16 KB of partials: overhead stays small.
MIN_CHUNK_KEYS = 256

# Upper bound on splits per request: the merge reads num_splits partial rows, and past ~128
# splits (1K keys each at 128K) the merge's reads, not the split kernel, dominate.
MAX_SPLITS = 128
# A forced num_splits is cut to what a row can use (one key tile per split) and to this: a
# graph-safe plan's bound (max_seqlen 10**9, say) must not size a workspace of 10**7 partial rows.
MAX_FORCED_SPLITS = 1024

# Query tile rows: tl.dot / mma needs M >= 16; past 64 rows (e.g. GQA 16 x Sq 16 = 256) the fp32
# accumulator (64 x D) is what fits in registers at D=256, so larger groups use several m-tiles.
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64

# Merge partials inside the split kernel (the last split block of a group to finish merges it, via
# an atomic counter) instead of a second merge launch — only up to this many splits. Measured on
# the H200 (graph replay, bf16 D=128, 2026-11-29): with 8 splits fused wins (B=4 GQA 4K 26.5 us vs
# 28.3; B=1 MHA 4K 25.5 vs 28.0; B=1 MHA 32K 128.9 vs 131.9); with 16-33 splits the merging block's
# serial walk over the splits costs more than the launch it saves (B=1 GQA 4K 17.0 vs 14.3 us;
# 32K 52.2 vs 44.5), so the separate, row-parallel merge kernel runs instead. 2026-12-02 (graph,
# results/2026-12-02-h200-tune/fuse_graph.md; the fused merge then read 4 splits per loop trip, which
# did not help and was dropped): 16-33 splits still lose (B=1 GQA 4K 15.2 vs 11.6 us, 32K 46.8 vs
# 40.1, 128K 134.6 vs 127.8), and at 8 splits the merge kernel led (B=1 MHA 4K 22.7 vs 24.2; eager
# 32.0 vs 32.2): the 8 stays on the 2026-11-29 evidence until a same-run A/B at B=4 GQA 4K says more.
# Eager calls too (H100, 2026-12-07, results/2026-12-07-h100-triton-fuse): fusing B=1 GQA 4K's 16 splits
# saves 7.8 us of host per call (one launch) but costs 6.8 us of GPU time, and the eager call is 5 us slower.
FUSED_MERGE_MAX_SPLITS = 8

# Notional SM count when planning for a CPU tensor (torch backend): it runs all splits as one
# vectorised batch, so splitting buys no parallelism; 16 keeps the padded work small while still
# exercising the split/merge path that the GPU uses.
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


# A tile forced by `tile_override` (the bench's tile sweep, `python -m splitkv bench --sweep-tiles`):
# dict of block_n / num_warps / num_stages / fused_merge, or None (the rules decide).
_TILE_OVERRIDE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("splitkv_tile_override", default=None)


@contextlib.contextmanager
def tile_override(block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  fused_merge: bool | None = None):
    """Plans built inside this context take these tile fields instead of the rules' (None keeps the
    rule's). For tuning measurements only: the split rule sizes its chunks with the forced block_n,
    so the plan stays consistent; block_m always follows the group size. fused_merge: whether a
    split plan merges in its split kernel (FUSED_MERGE_MAX_SPLITS) or launches the merge kernel."""
    forced = {k: v for k, v in dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages).items()
              if v is not None}
    for k, v in forced.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"tile_override: {k} must be an int >= 1, got {v!r}")
    if fused_merge is not None:
        if not isinstance(fused_merge, bool):
            raise ValueError(f"tile_override: fused_merge must be a bool, got {fused_merge!r}")
        forced["fused_merge"] = fused_merge
    token = _TILE_OVERRIDE.set(forced or None)
    try:
        yield
    finally:
        _TILE_OVERRIDE.reset(token)


def _overridden(tile: TileConfig) -> TileConfig:
    forced = {k: v for k, v in (_TILE_OVERRIDE.get() or {}).items() if k != "fused_merge"}
    return replace(tile, **forced) if forced else tile


def fused_merge(rule_fuses: bool) -> bool:
    """The fused-merge decision of a split plan: the rule's, or tile_override's fused_merge."""
    return (_TILE_OVERRIDE.get() or {}).get("fused_merge", rule_fuses)


def tile_config(head_dim: int, rows: int, splitting: bool = True, kv_fp8: bool = False) -> TileConfig:
    """Tile shape for `rows` packed query rows (qhead_per_kvhead * q_len) at `head_dim`.

    Measured on the H200 (`python -m splitkv bench --sweep-tiles`, graph replay, bf16, D=128,
    2026-12-02, results/2026-12-02-h200-tune/tiles.md and tiles_after.md):
      * split plans (chunks of 256-8K keys): block_n 64, 4 warps, 3 stages is best or within 2%
        (B=1 GQA 32/8 32K: 39.7 us vs 45.4 for block_n 128; 4K: 12.0 vs 11.8-11.9 for the others);
      * plans whose CTAs stream whole sequences (streams_whole_sequences): block_n 128, 4 warps,
        3 stages (B=16 MHA 32K 1854.7 us vs 2296.1 for 64x4x3; B=64 GQA 32K 1846.0 vs 2253.4;
        B=16 MHA 4K 244.0 vs 288.1; paged 16 B=16 MHA 32K 2018.1 vs 2403.2).
    At D=256 the key tile halves and warps double so the fp32 accumulator (block_m x 256) and the
    K/V stages fit (not yet tuned on the GPU).
    fp8 K/V (kv_fp8, D <= 128): block_n 128, 4 warps, 3 stages, split or not — half the bytes per
    key, so a tile of twice the keys keeps as many bytes in flight. H200, eager with a plan, e4m3,
    fp16 dots (benchmarks/results/2026-12-02-h200-fp8/fp8_tiles.json): B=1 GQA 32/8 128K 96.6 us
    vs 102.8 at block_n 64 (paged 16: 107.5 vs 135.3); B=1 MHA 32K 94.3 vs 105.6 (paged 111.6 vs
    136.3); B=16 GQA 32K 435 vs 618 (paged 512 vs 648; 8 warps: 380 contiguous but 595 paged).
    """
    block_m = min(max(_next_pow2(rows), MIN_BLOCK_M), MAX_BLOCK_M)
    if _next_pow2(head_dim) >= 256:  # Triton pads D to a power of 2 (D 136..256 -> 256)
        tile = TileConfig(block_m, 32, 8, 2)
    elif kv_fp8:
        tile = TileConfig(block_m, 128, 4, 3)
    elif splitting:
        tile = TileConfig(block_m, 64, 4, 3)
    else:
        tile = TileConfig(block_m, 128, 4, 3)
    return _overridden(tile)


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


# A ragged batch planned for one wave can leave the longest request's CTAs far above the mean (short
# requests still take a whole CTA each): when the largest CTA would stream more than BALANCE x the
# mean CTA's keys, the schedule re-plans for RAGGED_SPLITS_PER_REQUEST x batch CTAs per (KV head,
# m-tile) group instead. Then the ceil rounding costs at most one CTA per request: max / mean <=
# 1 + batch / CTAs = 1 + 1 / RAGGED_SPLITS_PER_REQUEST = 1.25, and the GPU's block scheduler packs
# the several waves. Uniform batches never trigger it (their one-wave plan is balanced).
# The grid's split dimension must cover that re-plan, and every CTA past a request's split count
# still launches and exits (see WORK_LIST_MIN_SAVING for what that costs). So when batch x
# groups already fills the GPU (uniform batches then run unsplit), the split kernel runs a work list
# of ragged_target items instead (`listed`): as many CTAs as a grid of RAGGED_SPLITS_PER_REQUEST
# columns, but any request may take up to the ragged re-plan's splits. H200, graph replay, GQA 32/8
# D 128, lengths 1K..128K geometric, a grid of 4 columns (the earlier rule, which capped every
# request at 4 splits: makespan 2.17x / 1.58x / 1.20x the ideal at B = 17 / 24 / 32) vs the list
# (benchmarks/results/2026-12-05-h200-full-grid): Triton B=17 637.5 -> 474.9 us, B=24 817.6 ->
# 646.6, B=32 992.5 -> 840.3; CuTe 611.5 -> 478.1, 784.6 -> 654.1, 972.1 -> 849.1; uniform rows
# level (B=24 32K Triton 839.2 -> 847.3, CuTe 839.1 -> 835.8; B=32 4K 126.4 -> 128.4 / 124.9 ->
# 125.2); fp8 e4m3 uniform full batches lose their surplus columns' cost (B=16 MHA 32K 1196.6 ->
# 977.6, B=64 GQA 32K 1201.6 -> 980.9). Where a request cannot use more than FULL_GRID_MAX_SPLITS
# splits anyway (short bounds), the grid of that many columns stays.
BALANCE = 1.25
RAGGED_SPLITS_PER_REQUEST = 4

# Batch-invariant mode: every request is cut into chunks of this many keys, whatever else is in the
# batch, so its result is bitwise the same in any batch. 2048 keys is 8 tiles of 256 (MIN_CHUNK_KEYS
# x 8): a 128K request gets 64 splits per KV head (at B=1 GQA 32/8: 512 CTAs, ~4 waves of 132 SMs),
# a 4K request 2 — short requests pay for it: they split less than the balanced rule would.
BATCH_INVARIANT_CHUNK_KEYS = 2048
FULL_GRID_MAX_SPLITS = 4


@dataclass(frozen=True)
class SplitRule:
    """What the split scheduler needs, decided on the host from shapes and the length bound alone.

    The per-request split counts and chunk lengths are then computed from the actual lengths, on the
    device (backends/triton/schedule_kernel.py) or on the host for CPU tensors (`schedule`): the
    same rule, so eager calls, plans reused across layers and CUDA-graph replays balance alike.
    mode: "auto" (balanced chunk length from the actual total work), "forced" (num_splits given),
    "fixed" (batch-invariant: a fixed chunk length).
    """

    mode: str
    block_n: int
    max_splits: int  # S, the grid's split dimension: no request gets more
    splits: int = 0  # forced: the split count
    chunk_tiles: int = 0  # fixed: the chunk, in block_n tiles
    target: int = 0  # auto: CTAs per (KV head x m-tile) group that fill the GPU once
    ragged_target: int = 0  # auto: the same for an unbalanced batch (see BALANCE)
    min_tiles: int = 1  # auto: the shortest chunk, in tiles (MIN_CHUNK_KEYS)
    short_keys: int = 2 * MIN_CHUNK_KEYS  # auto: no split when the longest request is shorter
    cap: int = MAX_SPLITS  # auto: chunks of at least longest / cap
    balance: float = BALANCE  # auto: the ragged re-plan's trigger
    # a sliding window bounds the keys a request's queries can see to span_cap = Sq + left
    # (splitkv.variants.first_key): requests are split over those keys only; UNBOUNDED = no window
    span_cap: int = UNBOUNDED
    # auto, batch x groups fills the GPU: the split kernel runs a work list (see BALANCE)
    listed: bool = False


def split_rule(*, batch: int, groups_per_request: int, block_n: int, max_seqlen: int, num_sms: int,
               blocks_per_sm: int = BLOCKS_PER_SM, num_splits: int | None = None,
               batch_invariant: bool = False, span_cap: int = UNBOUNDED) -> SplitRule:
    rule = _split_rule(batch=batch, groups_per_request=groups_per_request, block_n=block_n,
                       max_seqlen=min(max_seqlen, span_cap), num_sms=num_sms, blocks_per_sm=blocks_per_sm,
                       num_splits=num_splits, batch_invariant=batch_invariant)
    return replace(rule, span_cap=span_cap) if span_cap < rule.span_cap else rule


def _split_rule(*, batch: int, groups_per_request: int, block_n: int, max_seqlen: int, num_sms: int,
                blocks_per_sm: int, num_splits: int | None, batch_invariant: bool) -> SplitRule:
    """The scheduler's parameters for a batch whose lengths are at most max_seqlen.

    groups_per_request = KV heads x query tiles (one CTA each per split).
    * forced: num_splits splits, bounded by what a row can use (one tile of keys per split) and by
      MAX_FORCED_SPLITS;
    * batch-invariant: chunks of BATCH_INVARIANT_CHUNK_KEYS, at most MAX_SPLITS;
    * auto: no split when the bound is under 2 x MIN_CHUNK_KEYS; otherwise the device picks the
      smallest chunk (>= MIN_CHUNK_KEYS, <= MAX_SPLITS per request) that keeps the CTAs within one
      wave of blocks_per_sm per SM (no split when batch x groups already fills it), re-planning a
      ragged batch for more CTAs (BALANCE); the grid's split dimension covers that.
    """
    bound_tiles = max(cdiv(max(max_seqlen, 1), block_n), 1)
    if num_splits is not None:
        s = max(1, min(num_splits, bound_tiles, MAX_FORCED_SPLITS))
        return SplitRule("forced", block_n, s, splits=s)
    if batch_invariant:
        chunk = max(1, BATCH_INVARIANT_CHUNK_KEYS // block_n)
        return SplitRule("fixed", block_n, min(MAX_SPLITS, cdiv(bound_tiles, chunk)), chunk_tiles=chunk)
    min_tiles = cdiv(MIN_CHUNK_KEYS, block_n)
    if bound_tiles * block_n < 2 * MIN_CHUNK_KEYS:
        return SplitRule("auto", block_n, 1, min_tiles=min_tiles)
    target = max(1, num_sms * blocks_per_sm // groups_per_request)
    ragged = max(target, RAGGED_SPLITS_PER_REQUEST * batch)
    s = max(1, min(MAX_SPLITS, cdiv(bound_tiles, min_tiles), ragged))
    listed = batch * groups_per_request >= num_sms and s > FULL_GRID_MAX_SPLITS  # a grid otherwise
    return SplitRule("auto", block_n, s, target=target, ragged_target=ragged, min_tiles=min_tiles,
                     listed=listed)


def _splits(tiles: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.div(tiles + (chunk - 1), chunk, rounding_mode="floor").clamp_(min=1)


def _search(tiles: torch.Tensor, lo: int, hi: int, target: int) -> int:
    """Smallest chunk (tiles) in [lo, hi] whose total split count is <= target (hi if none)."""
    while lo < hi:  # the count is monotone in the chunk
        mid = (lo + hi) // 2
        if int(_splits(tiles, mid).sum()) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def schedule(seqlens: torch.Tensor, rule: SplitRule) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_splits [B], chunk_lens [B]) int32 for these lengths: the rule in plain PyTorch.

    This is the specification; backends/triton/schedule_kernel.py computes the same on the GPU
    (tests check both agree). Split s of request b covers keys [f_b + s * chunk_b, f_b + (s + 1) *
    chunk_b), the last one running on to L_b, from its first visible key f_b = L_b - min(L_b, span_cap)
    (0 without a sliding window); chunks are block_n-aligned and equal within a request (its keys cut
    into num_splits equal parts), so no CTA streams more than its chunk.
    """
    bn = rule.block_n
    span = seqlens.long().clamp(min=0, max=rule.span_cap)  # the keys its queries can see
    tiles = torch.div(span + (bn - 1), bn, rounding_mode="floor")
    if rule.mode == "forced":
        n = torch.full_like(tiles, rule.splits)
        return n.int(), (torch.div(tiles + n - 1, n, rounding_mode="floor").clamp_(min=1) * bn).int()
    if rule.mode == "fixed":
        n = _splits(tiles, rule.chunk_tiles).clamp_(max=rule.max_splits)
    elif rule.max_splits == 1 or tiles.numel() == 0 or int(tiles.max()) * bn < rule.short_keys:
        n = torch.ones_like(tiles)
    else:
        longest = int(tiles.max())
        lo = max(rule.min_tiles, cdiv(longest, rule.cap))
        n = _splits(tiles, _search(tiles, lo, max(lo, longest), rule.target))
        worst = int(torch.div(tiles + n - 1, n, rounding_mode="floor").max())
        if rule.ragged_target > rule.target and worst * int(n.sum()) > rule.balance * int(tiles.sum()):
            n = _splits(tiles, _search(tiles, lo, max(lo, longest), rule.ragged_target))
        n = n.clamp_(max=rule.max_splits)
    chunk = torch.div(tiles + n - 1, n, rounding_mode="floor").clamp_(min=1)
    n = torch.div(tiles + chunk - 1, chunk, rounding_mode="floor").clamp_(min=1)  # no empty trailing split
    return n.int(), (chunk * bn).int()


# Work list (Triton and CuTe split kernels): an auto plan's requests together get at most
# max(ragged_target, batch) splits (the schedule's bound, whatever the lengths), often far fewer
# than the batch x max_splits CTAs of a (split, request) grid, whose surplus CTAs each launch,
# read the split table and exit. Where that bound is at most 1 / WORK_LIST_MIN_SAVING of the grid,
# the schedule also writes the list of (request, split) items and the grid has one CTA per item
# and KV head instead — but only while the bound is the one-wave target itself (batch x
# RAGGED_SPLITS_PER_REQUEST <= target: no ragged headroom, so a uniform batch leaves no item
# empty). H200, graph replay, Triton, GQA 32/8 D 128, grid vs work list
# (benchmarks/results/2026-12-02-h200-fp8/worklist_ab_head_fast.json):
#   B=4 32K (33 items, 32 used): bf16 143.4 -> 130.1 us, fp8 e4m3 115.4 -> 89.5 (paged 16: bf16
#   157.7 -> 132.7, fp8 135.2 -> 100.5);
#   B=16 (64 items, 32 used when uniform): 32K bf16 548.0 -> 586.6, fp8 430.0 -> 427.1; lengths
#   1K..128K bf16 514.4 -> 550.1, fp8 338.5 -> 320.8 — so B=16 keeps the grid.
# The CuTe kernel takes the same list (2026-12-04, results/2026-12-04-h200-capture): its plans aim
# at one split CTA per SM, so B=2-4 GQA 32/8 contiguous (B=2-8 paged) qualify; B=4 GQA 4K ran its
# planner's 4 splits per request in a 512-CTA grid at 24.3 us against 21.7 forced (128 CTAs); with
# the list, same run: B=4 GQA 4K 24.7 -> 21.9 us, 32K 145.9 -> 123.0, 128K 469.9 -> 472.4 (graph).
WORK_LIST_MIN_SAVING = 2


def work_items(rule: SplitRule, batch: int) -> int | None:
    """Items of the split kernel's work list for this rule (an upper bound on the splits of the
    whole batch), or None where the (split, request) grid is used (forced and fixed rules, where
    every request may take max_splits; rules with ragged headroom; grids the list would not
    shrink enough): see WORK_LIST_MIN_SAVING; always for a `listed` rule (see BALANCE)."""
    if rule.mode != "auto" or rule.max_splits == 1 or (rule.ragged_target > rule.target and not rule.listed):
        return None
    full = batch * rule.max_splits
    items = min(max(rule.ragged_target, rule.target, batch), full)
    return items if rule.listed or items * WORK_LIST_MIN_SAVING <= full else None


def work_list(num_splits: torch.Tensor, items: int) -> torch.Tensor:
    """int32 [2, items]: (request, split) of every split of the batch in request order, -1 in both
    rows past the last (the specification of the schedule kernel's WORK output)."""
    n = num_splits.long()
    total = int(n.sum())
    if total > items:
        raise AssertionError(f"{total} splits exceed the work list's {items} items")
    req = torch.repeat_interleave(torch.arange(n.numel()), n)
    first = torch.cumsum(n, 0) - n
    out = torch.full((2, items), -1, dtype=torch.int32)
    out[0, :total] = req.int()
    out[1, :total] = (torch.arange(total) - first[req]).int()
    return out


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
# launch at once (griddepcontrol.launch_dependents), so the merge's CTAs, and the next call's split
# CTAs, are resident before the previous grid drains: the launch gap between the two kernels of a
# decode, and between decodes under a CUDA graph, overlaps the previous kernel's tail.
# Prediction before the H200 run: -1..2 us per decode on small shapes (B=1 GQA 4K graph: 11.0 us).
CUTLASS_PDL = True

# The CuTe DSL split kernel merges the partials itself (the last split CTA of each tile, all its
# threads in parallel: backends/cutlass/fused_merge.py) up to this many splits, instead of a merge
# launch. Prediction before the H200 run: the merge costs ~3 us of B=1 GQA 4K's 10.6 us (graph,
# split kernel alone 7.4 us); a parallel merge of 16 splits' partials from L2 should take ~1 us.
CUTLASS_FUSED_MERGE_MAX_SPLITS = MAX_SPLITS
# ... and only on tiles of at most this many packed query rows (group x Sq, at most block_m): the
# merging CTA walks rows x splits partials (4 columns of a row per thread and pass), so its time grows
# with the rows, where the merge kernel spreads them over the GPU. H100, graph replay, bf16 D 128,
# 8 KV heads, 16 splits, fused vs merge kernel, µs (2026-12-07, results/2026-12-07-h100-share-prefix/
# fused_merge_rows_call*.log): 4 rows B=1 4K 9.5 vs 9.8, 32K 51.1 vs 51.7; 8 rows within 1.3 either way
# (B=1 4K 11.5 vs 10.6, 32K 51.9 vs 51.2, 128K 177.8 vs 177.2, B=4 4K 30.1 vs 31.4); 16 rows B=1 4K
# 15.0 vs 11.5, 32K 56.0 vs 52.7; 32 rows B=1 32K 66.2 vs 56.6; 64 rows B=1 32K 145.7 vs 64.7, 128K
# 285.2 vs 198.8, B=4 8K 129.9 vs 68.4, one prefix group's 64 query heads per KV head at 8K 106.1 vs 29.3.
CUTLASS_FUSED_MERGE_MAX_ROWS = 8
# ... and only where that CTA walks at most this many (row, split) partials, counting the splits a
# request at the plan's length bound gets: the same data, by partials per merging CTA, put the line
# between 64 (4 rows x 16 splits, fused ahead by 0.3-0.6 us; 8 rows x 4 splits at B=4, by 1.3) and
# 128 (8 rows x 16 splits at B=1 GQA 64/8 and at GQA 32/8 Sq 2: the merge kernel ahead by 0.6-0.9).
# Checked on 13 cases (H100, graph replay, results/2026-12-07-h100-merge-bind/, probe_fused_merge_rows.py):
# merge kernel ahead past 64 at 8 x 16 (B=1 GQA 64/8 4K / 32K / 128K: 10.6 vs 11.4, 50.8 vs 51.3, 175.2
# vs 176.3; paged 11.5 vs 12.0; Sq 2 10.8 vs 11.4), 8 x 32 (GQA 32/4 32K 30.4 vs 33.2), 4 x 64 (8/2 32K
# 15.7 vs 16.6); fused ahead at 4 x 16 (9.5 vs 10.0) and 8 x 4 (30.2 vs 31.8); one row against, 4 x 33
# (GQA 32/8 paged 128K: fused 180.3 vs 181.7; its 32K twin 52.7 vs 52.3).
CUTLASS_FUSED_MERGE_MAX_PARTIALS = 64


def cutlass_fuses_merge(rule: "SplitRule", rows: int, block_m: int, batch: int, bound: int) -> bool:
    """Whether a CuTe split plan merges in its split kernel: some splits, at most
    CUTLASS_FUSED_MERGE_MAX_SPLITS, at most CUTLASS_FUSED_MERGE_MAX_ROWS rows in a tile, and at
    most CUTLASS_FUSED_MERGE_MAX_PARTIALS rows x the splits a request `bound` long gets in a batch
    of `batch` (uniform_schedule, asked only once the cheap checks pass)."""
    rows = min(rows, block_m)
    if not (1 < rule.max_splits <= CUTLASS_FUSED_MERGE_MAX_SPLITS and rows <= CUTLASS_FUSED_MERGE_MAX_ROWS):
        return False
    return rows * uniform_schedule(rule, batch, bound)[0] <= CUTLASS_FUSED_MERGE_MAX_PARTIALS


# A backend's unsplit tile (block_n 128) also serves split plans whose CTAs stream long chunks: a
# plan's tile is fixed when it is made, its split counts only on the device, so the plan asks how many
# keys one CTA streams when every request is at the length bound (uniform_chunk_keys). H200, graph
# replay: cutlass (2026-12-01, results/2026-12-01-h200-lean/sweep_*.json) B=4 MHA 32K, whose auto
# plan has a 16-split grid of which the device uses 1, took 556.3 us with n64 s3 against 478.1 with
# the n128 s2 plan of num_splits=1; B=16 GQA 32/8 128K 2191.7 vs 1907.4. Triton (2026-12-02,
# results/2026-12-02-h200-tune/tiles_long.md, the planner's 2 splits of 16K / 64K keys): B=4 MHA 32K
# 64x4x3 533.5 us, 64x4x4 490.1, 128x4x3 485.0; B=16 GQA 128K 2185.3 / 1937.9 / 1913.3. At 1K-8K-key
# chunks the 64-key tile stays (B=1 GQA 32K; B=1 GQA 128K, 4K chunks: Triton 130.1 vs 134.0 at
# 128x4x3).
LONG_CHUNK_KEYS = 16384


@functools.lru_cache(maxsize=4096)
def uniform_schedule(rule: "SplitRule", batch: int, bound: int) -> tuple[int, int]:
    """(splits per request, keys per CTA) that `schedule` gives a batch of `batch` requests all
    `bound` long (memoised: a pure function of its arguments, and the schedule's search costs ~0.2 ms
    of host time)."""
    if batch == 0:
        return 0, 0
    n, chunk = schedule(torch.full((batch,), bound, dtype=torch.int32), rule)
    return int(n[0]), int(chunk[0])


def uniform_chunk_keys(rule: "SplitRule", batch: int, bound: int) -> int:
    """Keys per CTA that `schedule` gives a batch of `batch` requests all `bound` long."""
    return uniform_schedule(rule, batch, bound)[1]


# The long-chunk evidence above is of grids that a uniform batch fills only in part (B=4 MHA 32K:
# 128 of 2048 CTAs work; B=16 GQA 128K: 128 of 8192). In a grid whose every CTA works at the bound
# the CuTe split tile streams long chunks better: H200, graph replay, 2026-12-04
# (results/2026-12-04-h200-layout/tiles_unsplit.md), B=1 MHA 128K (4 splits of 32K keys per KV head,
# 128 CTAs, all working): n64 s3 472.3 us vs n128 s2 481.3 and n128 s3 485.1; same-call sweeps after
# (results/2026-12-04-h200-waves/dense_tiles_call*.md, NOTES #55): B=1 MHA 128K 467.5 vs 472.1,
# B=4 GQA 32/8 128K (a work list of 4 x 32K-key items) 465.3 vs 470.7, GQA 64/8 466.3 vs 471.9.
DENSE_LONG_CHUNKS_SPLIT_TILE_DIMS = (128,)


def streams_whole_sequences(backend: str, rule: SplitRule, batch: int, bound: int, batch_invariant: bool,
                            head_dim: int, items: int) -> bool:
    """Whether a plan takes its backend's unsplit tile although its grid may split (the tile is fixed
    when the plan is made, the split counts only on the device): the CTAs of a uniform batch at the
    length bound stream long chunks: chunks >= LONG_CHUNK_KEYS, and for Triton also one chunk
    per request (the device splits nothing at the bound); H200 tile sweep (2026-12-02, graph replay,
    bf16 D 128, results/2026-12-02-h200-tune/tiles.md), split tile 64x4x3 vs unsplit 128x4x3:
    B=16 MHA 32K 2296.1 vs 1854.7 us, B=64 GQA 32/8 32K 2253.4 vs 1846.0, B=16 MHA 4K 288.1 vs 244.0,
    paged 16 B=16 MHA 32K 2403.2 vs 2018.1; plans that split keep 64x4x3 (B=1 GQA 32K, 32 chunks
    of 1K keys: 39.7 vs 45.4). Batch-invariant plans keep one tile whatever the batch and bound.
    CuTe D 128 plans whose grid (items: its work list's length, 0 without one: batch x max_splits
    columns) works in full at the bound keep the split tile (DENSE_LONG_CHUNKS_SPLIT_TILE_DIMS)."""
    if batch_invariant or batch == 0:
        return False
    splits, chunk = uniform_schedule(rule, batch, bound)
    if backend != "cutlass":
        return chunk >= LONG_CHUNK_KEYS or chunk >= bound
    dense = batch * splits >= (items or batch * rule.max_splits)
    return chunk >= LONG_CHUNK_KEYS and not (dense and head_dim in DENSE_LONG_CHUNKS_SPLIT_TILE_DIMS)


_UNSPLIT_TILES = {80: (128, 3), 96: (64, 4)}  # (block_n, stages) of D 80 / 96 unsplit contiguous plans

# CuTe D 128 contiguous plans whose CTAs stream whole sequences in several waves (a uniform batch at
# the bound gets one chunk per request, and has more CTAs than WAVES_MIN_CTAS_PER_SM per SM):
# block_n 128 x 3 stages (196 KB, one CTA per SM, two stages in flight while it computes on the
# third). H200, graph replay, bf16, tile sweeps of 2026-12-04 (results/2026-12-04-h200-layout/
# tiles_unsplit.md, tiles_mha.md; NOTES #50), the planner's tile vs n128 s3: B=16 MHA 32K 1919.4 us
# (n128 s2) vs 1902.0 and 1913.5 vs 1898.9; B=64 MHA 4K 964.9 (n64 s3) vs 954.4 and 967.6 vs 956.7;
# B=16 MHA 4K 246.2 vs 244.3; B=64 GQA 32/8 32K within 0.2%. Behind in one wave of <= 132 CTAs:
# B=4 MHA 32K 479.0 (n128 s2) vs 485.1, B=1 MHA 128K 481.3 vs 485.1. A/B in one process after
# (results/2026-12-04-h200-waves/probe_ab.txt, NOTES #52): B=64 MHA 4K 966.6 -> 957.1, B=16 MHA 4K
# 246.0 -> 243.9, B=16 MHA 32K 1899.5 -> 1890.5, B=64 GQA 32K 1891.3 -> 1888.5; but B=32 GQA 32/8 4K
# (256 CTAs: one wave of the split tile's two per SM) 124.7 -> 125.0, hence the threshold of two.
WAVES_TILE = (128, 3)
WAVES_MIN_CTAS_PER_SM = 2


def streams_in_waves(rule: SplitRule, batch: int, bound: int, groups_per_request: int, num_sms: int,
                     batch_invariant: bool) -> bool:
    """Whether a uniform batch of `batch` requests at the length bound runs one CTA per request and
    (KV head, m-tile) group, more than WAVES_MIN_CTAS_PER_SM per SM (cutlass_tile's waves tile)."""
    if batch_invariant or batch == 0 or batch * groups_per_request <= WAVES_MIN_CTAS_PER_SM * num_sms:
        return False
    return rule.max_splits == 1 or uniform_chunk_keys(rule, batch, bound) >= bound


# CuTe fp8 split tile at D <= 128 (block_n, stages): cutlass_tile's docstring has its sweep.
FP8_TILE = (128, 4)


def cutlass_tile(head_dim: int, splitting: bool = True, paged: bool = False, kv_fp8: bool = False,
                 waves: bool = False) -> tuple[int, int]:
    """(block_n, num_stages) of the CuTe DSL split kernel at `head_dim`.

    Split plans: every stage holds K and V tiles of block_n x D (2 B each); the rule keeps a stage
    at 32 KB for D <= 128 and 3 stages = 96 KB, so two blocks fit per SM (2 x ~100 KB of 228 KB)
    and each keeps two stages (64 KB) in flight while it computes on the third: ~130 KB in flight
    per SM, far more than the ~30 KB that covers HBM latency at 4.8 TB/s over 132 SMs. D = 256
    needs block_n >= 64 (16 keys per warp for the 4 key-split warps), so 64 KB stages, 2 of them.

    Unsplit plans at D = 128 (one CTA streams a whole sequence; B >= 16 grids of 256-512 CTAs), and
    split plans whose CTAs stream >= LONG_CHUNK_KEYS keys (plan.build passes splitting=False):
    block_n 128, 2 stages (128 KB, one CTA per SM). H200 tile sweep (2026-12-02, graph replay, bf16,
    `python -m splitkv bench --sweep-tiles`, results/2026-12-02-h200-tune/tiles.md), n64 s3 / n128 s3 /
    n128 s2: B=16 MHA 32K 1871.1 / 1859.1 / 1875.0 us; B=64 GQA 32/8 32K 1861.3 / 1851.7 / 1849.1
    (within 1%: n128 s2 led by 1-2% on 2026-11-29, NOTES #14). Split plans keep n64 s3: B=1 GQA 32K
    36.3 us vs 36.7 (n128 s3) and 38.0 (n128 s2); B=1 GQA 4K 10.0 / 9.8 / 10.5. Paged unsplit plans
    keep n64 s3: page 16, B=16 MHA 32K 1883.5 / 1884.8 / 1990.1.

    D 80 / 96 run on 128-column smem tiles: D 128's rule, but unsplit contiguous plans take their
    own tiles (_UNSPLIT_TILES). D 192, like 256, 64-key stages x 2, except contiguous split plans
    (x 3). H200 tile sweep (2026-12-02, graph replay, bf16, GQA 32/8,
    results/2026-12-02-h200-cutlass-variants/tiles_*.md), n128 s2 / n128 s3 / n64 s4 / n64 s3:
    B=16 32K D 80 396.1 / 313.7 / 398.2 / 617.6 us, D 96 415.5 / 460.5 / 397.2 / 609.4; paged 16
    keeps n64 s3 (D 80 408.1 vs 432.9 n128 s3, D 96 407.7 vs 462.6). D 192, B=1 32K: s3 53.8 vs s2
    55.7 contiguous, 66.6 vs 59.0 paged.

    waves: a D 128 contiguous plan whose CTAs stream whole sequences in several waves
    (streams_in_waves) takes WAVES_TILE whether its grid may split or not.

    fp8 caches: 1-byte stages, so block_n 128 at D 128 (64 at 256) keeps D 128 bf16's 32 KB per
    stage. D 128 takes 4 stages (133 KB: one CTA per SM, three stages in flight while it computes
    on the fourth). Tile sweep of the register-converting kernel (fp8.py; H100, graph replay, e4m3,
    results/2026-12-05-h100-fp8-tiles/), 128x3 (two per SM) / 128x4 / 128x5 / 64x4 / 128x2: B=1
    GQA 32/8 128K 100.7 / 97.9 / - / 109.6 / 108.0 us, paged 16 105.6 / 102.9 / 103.4; B=16 GQA
    32K 370.3 / 358.3 / - / 408.5 / 395.0, paged 383.7 / 378.9 / 379.1; B=1 MHA 32K 99.7 / 97.6 /
    98.0, paged 103.1 / 100.2 / 100.8. D 256: 64 x 3 (two per SM), not swept.
    """
    padded = padded_head_dim(head_dim)  # 80 and 96 run on 128-column tiles (constants.padded_head_dim)
    if kv_fp8:
        block_n, stages = FP8_TILE if padded <= 128 else (64, 3)
    elif padded == 64:
        block_n, stages = 128, 3
    elif waves and head_dim == 128 and not paged:
        block_n, stages = WAVES_TILE
    elif padded == 128:
        block_n, stages = (64, 3) if splitting or paged else _UNSPLIT_TILES.get(head_dim, (128, 2))
    else:
        block_n, stages = (64, 3) if head_dim == 192 and splitting and not paged else (64, 2)
    forced = _TILE_OVERRIDE.get() or {}
    return forced.get("block_n", block_n), forced.get("num_stages", stages)


# backend="auto" on sm90 with the CuTe DSL installed: cutlass for plans that split, Triton for plans
# that do not. Split plans, where the cutlass kernel merges the splits itself and launches with PDL,
# each backend at its own planner's plan (H200, 2026-12-02, bf16 D=128, CUDA-graph replay,
# results/2026-12-02-h200-tune/tiles.md, planner rows of one run): B=1 GQA 32/8 4K 10.0 us vs
# Triton 12.0, B=1 GQA 32K 36.3 vs 39.9, paged 16 B=16 MHA 32K 1879.3 vs 2399.9 (Triton's
# 2018.2 after streams_whole_sequences, tiles_after.md); the split sweeps, B=1 GQA 128K: 124.4 vs
# 129.4 (sweep_*.md). Unsplit plans (max_splits 1: the grid is full without splitting) stay on
# Triton, 0.3-1.0% ahead of cutlass's n128 s2 tile on 2026-11-29 (NOTES #14: B=64 GQA 32K 1881.5
# vs 1887.2 us, B=16 MHA 32K 1888.6 vs 1907.9).
# Inside a random-weight bf16 Llama (8 layers, 32K prompt, 2026-11-29, NOTES #13), on the model's
# own inputs at every layer and step, cutlass (fused, unfused, 1 split, dense) and Triton have the
# same max error vs the fp64 reference (0.06-0.12 on |o| <= 57, bf16 rounding); teacher-forced
# logits differ from transformers' by 0.136 / 0.160 (B=1 / 4) vs Triton's 0.148 / 0.164.
AUTO_CUTLASS = True
AUTO_CUTLASS_MIN_SPLITS = 2
# ... but Triton for split plans of more than 32 query rows per KV head (the m64 tile: speculative
# Sq 16 at GQA 4, share_prefix's group batch): H100, graph replay, each backend at its own plan,
# bf16 D 128 GQA x/8 (benchmarks/probes/probe_tile_rows_backend.py, results/2026-12-07-h100-prefix-fold),
# cutlass / Triton: Sq 16 at GQA 4: B=1 32K 63.4 / 59.9 us, 128K 201.0 / 189.8, B=4 8K 68.3 / 65.1,
# B=1 32K paged 16 68.8 / 62.6; 512 query heads (a group of 16 x GQA 4), paged 64: 8K 30.1 / 22.1,
# 32K 69.5 / 61.7. At m32 (Sq 8) cutlass stays ahead: 55.7 / 57.4, 57.9 / 58.8. Not measured on the H200.
AUTO_CUTLASS_MAX_BLOCK_M = 32
# fp8 caches: `auto` takes the cutlass kernel (fp8.py, FP8_TILE) for contiguous caches with one
# query per head, split or not, and Triton's fp8 path for paged caches and multi-token queries.
# H100 (not the H200: none was lent), graph replay, each backend's own graph-safe plan, e4m3, rounds
# interleaved, cutlass / Triton (results/2026-12-05-h100-fp8-tiles/: fp8.md, then probe_fp8_auto.txt):
# contiguous B=1 GQA 32/8 128K 98.4 / 100.4 us, B=16 GQA 32K 360.8 / 368.3, B=1 MHA 32K 97.2 /
# 100.8; B=4 GQA 4K 18.9 / 19.9, B=8 GQA 128K 720.6 / 730.3, B=16 MHA 32K 1430.9 / 1447.8, B=64
# GQA 32K 1450.5 / 1470.7, B=1 D 256 32K 59.0 / 77.9; level: B=1 GQA 4K 10.8 / 10.6, GQA 64/8 32K
# 33.7 / 33.5, ragged B=16 1K..128K 354.3 / 352.5. Behind: Sq 4 (B=1 GQA 32K) 37.4 / 34.6; paged
# 16 B=16 GQA 32K 382.6 / 370.3 (fp8.md), B=1 GQA 4K 11.7 / 11.0; level paged: B=1 GQA 128K
# 101.6 / 101.4 (fp8.md), B=16 MHA 32K 1459.5 / 1468.2, B=8 GQA 128K 735.2 / 733.9.
# On the H200 the same rows go the other way at D 128 (results/2026-12-07-h200-issues, `auto` =
# cutlass there, graph replay): B=16 GQA 32K contiguous 269.2 us vs 251.5 for the paged Triton row
# of the same run (Triton contiguous: 247.6 on 2026-12-04, results/2026-12-04-h200-fp8v), B=1 GQA
# 128K 71.7 vs 70.9 (2026-12-04), B=1 MHA 32K 70.8 vs 69.7 (2026-12-04): so on the devices named
# here `auto` keeps Triton for fp8 at D <= 128 (D 256, 59.0 vs 77.9 on the H100, is not measured
# on the H200 and stays on cutlass). Not yet an A/B in one run on the H200.
AUTO_CUTLASS_FP8 = True
AUTO_TRITON_FP8_DEVICES = ("H200",)


def auto_prefers_cutlass_fp8(paged: bool, q_len: int, head_dim: int = 128, device_name: str = "") -> bool:
    if not AUTO_CUTLASS_FP8 or paged or q_len != 1:
        return False
    return head_dim > 128 or not any(name in device_name for name in AUTO_TRITON_FP8_DEVICES)


def auto_prefers_cutlass(max_splits: int, block_m: int = MIN_BLOCK_M) -> bool:
    return AUTO_CUTLASS and max_splits >= AUTO_CUTLASS_MIN_SPLITS and block_m <= AUTO_CUTLASS_MAX_BLOCK_M
