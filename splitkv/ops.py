"""torch.library custom ops (namespace "splitkv") with fake impls, so torch.compile traces decode,
the merge and the cache append as single opaque nodes: no graph break (fullgraph=True works)
and no host read of cache_seqlens inside the traced graph.

    splitkv::decode   (q, k_cache, v_cache, cache_seqlens, block_table?, causal, softmax_scale?,
                       num_splits?, backend, batch_invariant, window_left, window_right, softcap,
                       sinks?, alibi_slopes?) -> (o [B, Sq, Hq, D] q.dtype, lse [B, Hq, Sq] fp32)
    splitkv::merge    (o_part [S, B, H, T, D], lse_part [S, B, H, T], num_splits [B])
                       -> (o [B, T, H, D] o_part.dtype, lse [B, H, T] fp32)
    splitkv::append   (k_pool!, v_pool!, k, v, pages, starts, ntok, cos?, sin?, neox, backend, k_scale?, v_scale?)
                       -> ()   (PagedKVCache's device write; pools mutated in place)

decode_op runs the eager path (splitkv.execute), which never reads cache_seqlens on the host: its
plan is sized for the cache's capacity (Lmax, or max_pages * page_size) and the split table is
computed on the device. So a compiled step never synchronises on the lengths, and with
mode="reduce-overhead" the warm-up call compiles the very kernel variants the capture records.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backends
from . import variants as V
from .execute import decode_eager


@torch.library.custom_op("splitkv::decode", mutates_args=())
def decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, block_table: Tensor | None,
              causal: bool, softmax_scale: float | None, num_splits: int | None,
              backend: str, batch_invariant: bool = False, window_left: int = -1, window_right: int = -1,
              softcap: float = 0.0, sinks: Tensor | None = None, alibi_slopes: Tensor | None = None,
              k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    # checked by splitkv.decode; float fp8 scales travel as 0-dim float32 tensors (a custom op has no
    # "float or Tensor" argument type)
    if k_scale is not None and k_scale.dim() == 0:
        k_scale, v_scale = float(k_scale), float(v_scale)
    variant = V.Variant(window_left, window_right, softcap, sinks, alibi_slopes, k_scale, v_scale)
    return decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, causal=causal,
                        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True, backend=backend,
                        batch_invariant=batch_invariant, variant=V.PLAIN if variant.plain else variant)


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits, backend,
                 batch_invariant=False, window_left=-1, window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None,
                 k_scale=None, v_scale=None):
    B, Sq, Hq, _ = q.shape
    o = q.new_empty(q.shape)  # contiguous, as decode_eager allocates it
    lse = q.new_empty((B, Hq, Sq), dtype=torch.float32)
    return o, lse


@torch.library.custom_op("splitkv::merge", mutates_args=())
def merge_op(o_part: Tensor, lse_part: Tensor, num_splits: Tensor) -> tuple[Tensor, Tensor]:
    S, B, H, T, D = o_part.shape
    o = o_part.new_empty((B, T, H, D))
    lse = lse_part.new_empty((B, H, T), dtype=torch.float32)
    # the Triton kernel needs a real GPU; on the CPU (interpreter or not) the torch merge is the
    # same math and far faster than interpreting
    name = "triton" if o_part.is_cuda and backends.triton_available() else "torch"
    backends.get(name).merge(o_part, lse_part, num_splits, o, lse)
    return o, lse


@merge_op.register_fake
def _merge_fake(o_part, lse_part, num_splits):
    S, B, H, T, D = o_part.shape
    return o_part.new_empty((B, T, H, D)), lse_part.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("splitkv::append", mutates_args=("k_pool", "v_pool"))
def append_op(k_pool: Tensor, v_pool: Tensor, k: Tensor, v: Tensor, pages: Tensor, starts: Tensor,
              ntok: Tensor, cos: Tensor | None, sin: Tensor | None, neox: bool, backend: str,
              k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    if backend == "triton":
        from .backends.triton.append_kernel import append_kv as write
    else:
        from .cache import append_torch as write
    write(k_pool, v_pool, k, v, pages, starts, ntok, cos, sin, neox=neox, k_scale=k_scale, v_scale=v_scale)


@append_op.register_fake
def _append_fake(k_pool, v_pool, k, v, pages, starts, ntok, cos, sin, neox, backend, k_scale=None, v_scale=None):
    return None


def append_kv(k_pool, v_pool, k, v, pages, starts, ntok, cos=None, sin=None, *, neox=True, backend="torch",
              k_scale=None, v_scale=None):
    """The device write of PagedKVCache.append as one custom op: same arguments as
    splitkv.cache.append_torch / the Triton append_kv, plus the resolved backend ("torch" or
    "triton"). Host bookkeeping (page allocation) stays in the cache, outside the op."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    torch.ops.splitkv.append(k_pool, v_pool, k, v, pages, starts, ntok, cos, sin, bool(neox), backend, k_scale,
                             v_scale)
