"""Benchmark inputs: random tensors for a Shape, in splitkv's layout, plus rotating copies.

Canonical layout (what splitkv and FlashInfer take; peers that want another layout copy it once,
outside the timed region):
  q            [B, Sq, Hq, D]
  contiguous   k_cache, v_cache [B, Lcap, Hkv, D], Lcap = max length rounded up to a multiple of 16
               (so the same storage is a valid page pool of 16-key pages for paged-only peers)
  paged        k_cache, v_cache [P, page_size, Hkv, D]; block_table int32 [B, max_pages] maps each
               request to a shuffled set of pages (as a real allocator leaves them); unused
               entries are 0
  cache_seqlens int32 [B]
  fp8 rows     K/V float8_e4m3fn (standard normal values cast), read with the per-tensor scales
               FP8_SCALES (k_scale, v_scale: both != 1, so a kernel that drops one is wrong)
  variant rows sinks ~ N(4, 2^2) (a sizeable share of each row) and ALiBi slopes ~ U(0, 0.01) per
               query head, float32

Rotation: CUDA-graph timing replays N calls back to back with no L2 flush in between, so the calls
cycle over copies of q/K/V whose total size exceeds the L2 (50 MB on H200) several times over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .shapes import Shape

# Bytes of distinct K/V one graph replay must cycle through so every call reads cold data: about
# five H200 L2s (50 MB), the figure PEERS.md used (> 240 MB per rotation).
ROTATION_BYTES = 256 * 2**20
MAX_ROTATION = 64  # tiny shapes: beyond this many copies the capture itself dominates set-up time
FP8_SCALES = (0.5, 2.0)
KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}

# Padding unit of contiguous capacity: FlashInfer views the storage as 16-key pages.
CAPACITY_ALIGN = 16


@dataclass
class TensorSet:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None


@dataclass
class Case:
    shape: Shape
    dtype: torch.dtype
    device: torch.device
    base: TensorSet
    _copies: list[TensorSet]
    variant: dict | None = None  # decode's variant keywords (window_size, softcap, sinks, alibi_slopes)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_kwargs(self) -> dict:
        """decode's / the reference's scale arguments for this case's cache ({} unless fp8)."""
        return dict(zip(("k_scale", "v_scale"), FP8_SCALES, strict=True)) if self.shape.kv_dtype else {}

    @property
    def call_kwargs(self) -> dict:
        """Every keyword beyond the tensors that decode (and the reference) take for this case."""
        return {**(self.variant or {}), **self.kv_kwargs}

    def rotation_count(self) -> int:
        per_set = max(self.shape.bytes(self.elem_bytes), 1)
        return min(MAX_ROTATION, max(1, math.ceil(ROTATION_BYTES / per_set)))

    def rotation(self, count: int) -> list[TensorSet]:
        """`count` tensor sets with equal contents and distinct storage (set 0 is the base)."""
        b = self.base
        while len(self._copies) < count - 1:
            self._copies.append(TensorSet(b.q.clone(), b.k_cache.clone(), b.v_cache.clone(),
                                          b.cache_seqlens, b.block_table))
        return [b] + self._copies[:count - 1]

    def release(self) -> None:
        self._copies.clear()


def build_case(shape: Shape, dtype: torch.dtype, device, seed: int = 0) -> Case:
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, Sq, Hq, Hkv, D = shape.batch, shape.q_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim

    kv_dtype = KV_DTYPES[shape.kv_dtype] if shape.kv_dtype else dtype

    def randn(*size, out=dtype):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype).to(out)

    q = randn(B, Sq, Hq, D)
    seqlens = torch.tensor(shape.seqlens, dtype=torch.int32, device=device)
    if shape.paged:
        ps = shape.page_size
        pages = [math.ceil(L / ps) for L in shape.seqlens]
        total = max(sum(pages), 1)
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        table = torch.zeros(B, max(max(pages), 1), dtype=torch.int32)
        off = 0
        for b, n in enumerate(pages):
            table[b, :n] = perm[off:off + n]
            off += n
        k, v = randn(total, ps, Hkv, D, out=kv_dtype), randn(total, ps, Hkv, D, out=kv_dtype)
        block_table = table.to(device)
    else:
        cap = math.ceil(shape.max_seqlen / CAPACITY_ALIGN) * CAPACITY_ALIGN
        k, v = randn(B, cap, Hkv, D, out=kv_dtype), randn(B, cap, Hkv, D, out=kv_dtype)
        block_table = None
    variant = {}
    if shape.window_left >= 0:
        variant["window_size"] = (shape.window_left, -1)
    if shape.softcap:
        variant["softcap"] = shape.softcap
    g = torch.Generator().manual_seed(seed + 2)
    if shape.sinks:
        variant["sinks"] = (torch.randn(Hq, generator=g) * 2 + 4).to(device)
    if shape.alibi:
        variant["alibi_slopes"] = (torch.rand(Hq, generator=g) * 0.01).to(device)
    return Case(shape, dtype, device, TensorSet(q, k, v, seqlens, block_table), [], variant)


def page_view(ts: TensorSet, shape: Shape, page_size: int = CAPACITY_ALIGN):
    """(k_pages, v_pages, indptr, indices, last_page_len) of a tensor set for a paged-KV peer.

    Paged sets are passed through; contiguous storage [B, Lcap, Hkv, D] is viewed, without a copy,
    as B * Lcap / page_size pages with request b owning pages b * Lcap / page_size + j."""
    dev = ts.q.device
    lengths = list(shape.seqlens)
    if ts.block_table is not None:
        page_size = ts.k_cache.shape[1]
        k_pages, v_pages = ts.k_cache, ts.v_cache
        rows = [ts.block_table[b, :math.ceil(L / page_size)] for b, L in enumerate(lengths)]
    else:
        B, cap = ts.k_cache.shape[:2]
        per = cap // page_size
        k_pages = ts.k_cache.view(B * per, page_size, *ts.k_cache.shape[2:])
        v_pages = ts.v_cache.view(B * per, page_size, *ts.v_cache.shape[2:])
        rows = [torch.arange(math.ceil(L / page_size), dtype=torch.int32, device=dev) + b * per
                for b, L in enumerate(lengths)]
    counts = [r.numel() for r in rows]
    indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    indices = torch.cat(rows).to(torch.int32)
    last = torch.tensor([L - (n - 1) * page_size if n else 0 for L, n in zip(lengths, counts, strict=True)],
                        dtype=torch.int32, device=dev)
    return k_pages, v_pages, indptr, indices, last
