"""Kernel configs of the CuTe DSL backend: pure Python (no cutlass import), so the tile rule, the
variant list and the cache keys are unit-tested on any machine.

A config is everything that changes the compiled code; everything else (lengths, strides, split
table, causal flag, page size, group size) is a runtime argument, so one compiled kernel serves
every batch shape of its variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import heuristics as H
from ...constants import FP8_HEAD_DIMS, LOW_DTYPE_NAMES, padded_head_dim
from ...constants import HEAD_DIMS as SUPPORTED_HEAD_DIMS

# dtype names shared by the torch side (launch) and the DSL side (kernel classes)
DTYPES = LOW_DTYPE_NAMES
PART_DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = SUPPORTED_HEAD_DIMS
KV_FP8_FORMATS = ("", "e4m3", "e5m2")  # SplitConfig.kv_fp8: none, or the cache's fp8 format
BLOCK_MS = (16, 32, 64)  # the planner's query tile rows (heuristics.tile_config): 16 .. 64
NUM_THREADS = 128  # 4 warps: with block_m 16 they split the keys of a tile (see SplitConfig)
MMA_M = 16  # rows of one mma.sync m16n8k16 atom = rows one warp owns
MMA_K = 16
ELEMS_PER_COPY = 8  # 16-byte cp.async / vector loads of fp16/bf16


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class SplitConfig:
    """One compiled split kernel.

    Warp grid: warps_m x warps_n = 4 warps. Warp (wm, wn) owns query rows [16 wm, 16 wm + 16) of
    the block_m-row tile and keys [wn * keys_per_warp, (wn + 1) * keys_per_warp) of every K/V
    tile, and keeps its own online-softmax state; the warps_n states of a row are merged once, in
    the epilogue. So block_m = 16 (a GQA group of 4..16 at Sq = 1) still keeps all 4 warps busy
    without padding M to 64 rows.

    head_dim is the model's D; shared memory and the MMAs work on padded_dim (D rounded up to 64
    columns: 80 and 96 run as 128, zero-padded in shared memory only). softcap / alibi / window
    compile the attention variants' score code in (splitkv.variants; sinks are a runtime pointer:
    they enter once per row, where a row's output is final). kv_fp8 ("e4m3" / "e5m2", D 128 / 256):
    the K/V stages hold the cache's fp8 bytes, converted in registers as the fp16 MMAs load them
    (fp8.py); dtype stays the query / output dtype.
    """

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    num_stages: int
    paged: bool
    softcap: bool = False
    alibi: bool = False
    window: bool = False
    kv_fp8: str = ""  # "", "e4m3" or "e5m2": the cache's fp8 format
    pdl: bool = H.CUTLASS_PDL  # programmatic dependent launch (see heuristics.CUTLASS_PDL)

    def __post_init__(self):
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("head_dim", self.head_dim, HEAD_DIMS)
        _one_of("block_m", self.block_m, BLOCK_MS)
        if self.keys_per_warp % MMA_K or self.block_n % 16:
            raise ValueError(f"block_n: {self.block_n} keys split over {self.warps_n} warps must give "
                             f"a multiple of {MMA_K} keys per warp")
        if self.num_stages < 2:
            raise ValueError(f"num_stages: a cp.async pipeline needs >= 2 stages, got {self.num_stages}")
        _one_of("kv_fp8", self.kv_fp8, KV_FP8_FORMATS)
        if self.kv_fp8 and self.head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"head_dim: fp8 caches run at {FP8_HEAD_DIMS}, got {self.head_dim}")
        if self.kv_fp8 and (self.softcap or self.alibi):  # k_scale rides in the softmax scale they read
            raise ValueError("kv_fp8: fp8 caches run without softcap / ALiBi on this backend")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self}: needs {self.smem_bytes} B of shared memory, limit {SMEM_LIMIT}")

    @property
    def padded_dim(self) -> int:
        return padded_head_dim(self.head_dim)

    @property
    def warps_m(self) -> int:
        return self.block_m // MMA_M

    @property
    def warps_n(self) -> int:
        return (NUM_THREADS // 32) // self.warps_m

    @property
    def keys_per_warp(self) -> int:
        return self.block_n // self.warps_n

    @property
    def elem_bytes(self) -> int:
        return 2

    @property
    def mma_dtype(self) -> str:
        """The MMAs' operand dtype: fp16 for fp8 caches (one cvt per two fp8 values), else dtype."""
        return "float16" if self.kv_fp8 else self.dtype

    @property
    def kv_stage_bytes(self) -> int:
        return 2 * self.block_n * self.padded_dim * (1 if self.kv_fp8 else self.elem_bytes)

    @property
    def reduce_bytes(self) -> int:
        """Epilogue scratch: every warp's fp32 [16, D] output and its row max / sum."""
        pitch = self.padded_dim + 4  # epilogue.scratch_layouts pads rows by 4 floats
        return 4 * (self.warps_n * self.block_m * pitch + 2 * self.warps_n * self.block_m)

    @property
    def smem_bytes(self) -> int:
        q = self.block_m * self.padded_dim * self.elem_bytes
        # the epilogue scratch reuses the K/V ring once the pipeline has drained
        return q + max(self.num_stages * self.kv_stage_bytes, self.reduce_bytes) + 1024

    @property
    def name(self) -> str:
        mods = "".join(tag for on, tag in ((self.softcap, "_cap"), (self.alibi, "_alibi"), (self.window, "_win")) if on)
        return (f"split_{self.dtype}_d{self.head_dim}_m{self.block_m}_n{self.block_n}_s{self.num_stages}"
                f"_{'paged' if self.paged else 'dense'}{mods}{'_kv' + self.kv_fp8 if self.kv_fp8 else ''}"
                f"{'' if self.pdl else '_nopdl'}")


@dataclass(frozen=True)
class MergeConfig:
    """One compiled merge kernel: one warp per output row (request, query head, token)."""

    part_dtype: str
    out_dtype: str
    head_dim: int
    pdl: bool = H.CUTLASS_PDL

    def __post_init__(self):
        _one_of("part_dtype", self.part_dtype, PART_DTYPES)
        _one_of("out_dtype", self.out_dtype, DTYPES)
        _one_of("head_dim", self.head_dim, HEAD_DIMS)

    @property
    def elems_per_lane(self) -> int:
        return merge_elems_per_lane(self.head_dim)

    @property
    def active_lanes(self) -> int:
        return self.head_dim // self.elems_per_lane

    @property
    def name(self) -> str:
        return f"merge_{self.part_dtype}_to_{self.out_dtype}_d{self.head_dim}{'' if self.pdl else '_nopdl'}"


def merge_elems_per_lane(head_dim: int) -> int:
    """Contiguous columns per lane of the merge kernel: a power of 2 (vector loads), D / 32 rounded
    up to one; lanes >= D / this hold no column (D 80: 4 x 20 lanes, 192: 8 x 24)."""
    n = 1
    while n * 32 < head_dim:
        n *= 2
    return n


# sm90 allows 227 KB of dynamic shared memory per block.
SMEM_LIMIT = 227 * 1024


def tile_for(head_dim: int, splitting: bool = True, paged: bool = False, kv_fp8: bool = False,
             waves: bool = False) -> tuple[int, int]:
    """(block_n, num_stages) of the split kernel: the rule lives in splitkv/heuristics.py."""
    return H.cutlass_tile(head_dim, splitting, paged, kv_fp8, waves)


def split_config(dtype: str, head_dim: int, block_m: int, paged: bool, pdl: bool = H.CUTLASS_PDL,
                 splitting: bool = True, kv_fp8: str = "", waves: bool = False) -> SplitConfig:
    block_n, stages = tile_for(head_dim, splitting, paged, bool(kv_fp8), waves)
    return SplitConfig(dtype, head_dim, block_m, block_n, stages, paged, kv_fp8=kv_fp8, pdl=pdl)


# (splitting, waves) of heuristics.cutlass_tile: a split plan, an unsplit one, one streaming in waves
_TILE_CASES = ((True, False), (False, False), (False, True))


def split_variants() -> list[SplitConfig]:
    """Every split kernel the backend can launch (block_m comes from the plan's tile; the tile
    rule may differ for plans that split, plans that do not and plans whose CTAs stream whole
    sequences in several waves), fp8 caches included."""
    every = [split_config(dt, d, bm, paged, splitting=sp, waves=w) for dt in DTYPES for d in HEAD_DIMS
             for bm in BLOCK_MS for paged in (False, True) for sp, w in _TILE_CASES]
    every += [split_config(dt, d, bm, paged, kv_fp8=f) for f in KV_FP8_FORMATS[1:] for dt in DTYPES
              for d in FP8_HEAD_DIMS for bm in BLOCK_MS for paged in (False, True)]
    return list({c.name: c for c in every}.values())


def merge_variants() -> list[MergeConfig]:
    """Every merge kernel: fp32 partials from our split kernel, fp16/bf16 from merge_states users."""
    return [MergeConfig(p, o, d) for p in PART_DTYPES for o in DTYPES for d in HEAD_DIMS]
