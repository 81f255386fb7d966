"""splitkv.decode: the public entry. Eager calls run splitkv.execute (validate -> plan -> schedule
-> launch); under torch.compile every call goes through the registered custom op (one with a plan is
checked against it and runs its backend and split rule)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import execute, ops, validate
from . import variants as V
from .plan import DecodePlan

_NO_WINDOW = (-1, -1)


def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, *, block_table: Tensor | None = None,
           causal: bool = True, softmax_scale: float | None = None, num_splits: int | None = None,
           return_lse: bool = False, out: Tensor | None = None, plan: DecodePlan | None = None, backend: str = "auto",
           batch_invariant: bool = False, window_size: tuple[int, int] = _NO_WINDOW, softcap: float = 0.0,
           sinks: Tensor | None = None, alibi_slopes: Tensor | None = None, k_scale: float | Tensor | None = None,
           v_scale: float | Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Split-KV decode attention.

    q [B, Sq, Hq, D] fp16/bf16 (fp32 on the torch backend); k_cache/v_cache [B, Lmax, Hkv, D]
    (contiguous) or [num_pages, page_size, Hkv, D] with block_table int32 [B, max_pages] (paged);
    cache_seqlens int32 [B] = valid keys per request, the Sq new ones included. Causal (Sq > 1)
    is bottom-right aligned. Returns o [B, Sq, Hq, D] in q's dtype, and lse [B, Hq, Sq] fp32
    (natural log) when return_lse. A query that sees no key gets o = 0, lse = -inf; NaN inputs
    propagate.

    Without a plan the split table is computed on the GPU from cache_seqlens (never read on the
    host: no sync), so the call itself may be captured in a CUDA graph. plan: from splitkv.plan(...),
    reused across layers (call plan.refresh(cache_seqlens) once per step when lengths change).
    Under torch.compile every call is one custom op (fullgraph=True works); with a plan the call is
    checked against it and runs its backend, forced split count and batch-invariant mode, the op
    scheduling on the device from the cache's capacity (the plan's max_seqlen, num_sms and table
    are not used there; eager calls use them).
    batch_invariant: a request's output does not depend on the rest of the batch (bitwise).

    Attention variants, with FlashAttention's flash_attn_with_kvcache conventions (the math is in
    splitkv.variants): window_size=(left, right) sliding window (query at position p sees keys
    p - left .. p + right, -1 = unbounded; causal bounds the right side at p); softcap > 0: scores
    become softcap * tanh(scores / softcap); sinks float32 [Hq]: a per-head logit joining each
    row's softmax denominator, with no value (lse includes it); alibi_slopes float32 [Hq]: scores
    get -slope[h] * |key position - query position|. Head dims: every multiple of 8 in [32, 256]
    (torch and triton; cutlass 64/80/96/128/192/256: 'auto' picks triton otherwise). Every backend
    takes every variant on fp16 / bf16 caches.

    FP8 KV cache: k_cache / v_cache in torch.float8_e4m3fn or float8_e5m2 (q stays fp16/bf16)
    holding K / k_scale and V / v_scale; k_scale and v_scale are required: a float each (per
    tensor) or float32 [Hkv] tensors (per KV head). Torch and triton: every head dim and variant;
    cutlass: head dims 128 / 256 with the window and sinks, not softcap or ALiBi.
    """
    compiling = torch.compiler.is_compiling()
    if (window_size is _NO_WINDOW or window_size is None or window_size == _NO_WINDOW) and sinks is None \
            and alibi_slopes is None and type(softcap) in (float, int) and softcap == 0 and k_scale is None \
            and v_scale is None:
        variant = V.PLAIN
    else:  # an eager call with scalar options only reuses the Variant its options made before
        key = (V.scalar_key(window_size, softcap, k_scale, v_scale, k_cache.dtype)
               if sinks is None and alibi_slopes is None and not compiling and isinstance(k_cache, torch.Tensor)
               else None)
        variant = V.cached_scalar(key, lambda: _make_variant(q, k_cache, v_cache, cache_seqlens, window_size, softcap,
                                                            sinks, alibi_slopes, k_scale, v_scale))
    if compiling:
        if plan is not None:  # the plan's checks, backend and split rule; the op schedules on the device
            backend, num_splits, batch_invariant = _traced_plan(plan, q, k_cache, block_table, backend, num_splits,
                                                                batch_invariant, variant)
        ks, vs = variant.k_scale, variant.v_scale
        if variant.fp8 == "tensor":  # the op takes tensors: 0-dim CPU ones (read without a sync)
            ks, vs = torch.tensor(ks, dtype=torch.float32), torch.tensor(vs, dtype=torch.float32)
        o, lse = ops.decode_op(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale,
                               num_splits, backend, batch_invariant, variant.window_left, variant.window_right,
                               variant.softcap, variant.sinks, variant.alibi_slopes, ks, vs)
        if out is not None:
            validate.check_out(out, None, None, q)  # eager decode checks it too
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o
    return execute.decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, causal=causal,
                                softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
                                out=out, plan=plan, backend=backend, batch_invariant=batch_invariant,
                                variant=variant)


def _make_variant(q, k_cache, v_cache, cache_seqlens, window_size, softcap, sinks, alibi_slopes, k_scale, v_scale):
    """decode's variant options checked into a Variant (PLAIN for options that change nothing)."""
    validate.check_tensors(q, k_cache, v_cache, cache_seqlens)  # before the variant reads their shapes
    variant = V.make(window_size, softcap, sinks, alibi_slopes, num_q_heads=q.shape[2], device=q.device,
                     k_scale=k_scale, v_scale=v_scale, kv_dtype=k_cache.dtype,
                     num_kv_heads=k_cache.shape[2] if k_cache.dim() == 4 else -1)
    return V.PLAIN if variant.plain else variant  # e.g. window_size=[-1, -1]: the plain call, lean path included


def _traced_plan(plan, q, k_cache, block_table, backend, num_splits, batch_invariant, variant):
    """decode(..., plan=p) under torch.compile: the call is checked against p and runs p's backend,
    forced split count and batch-invariant mode through the custom op, which keeps its own
    workspace per input signature and computes the split table on the device from the lengths, as
    a call without a plan does: p's table, workspace, max_seqlen and num_sms are not used."""
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a splitkv.DecodePlan, got {type(plan).__name__}")
    validate.check_backend(backend)
    if not isinstance(num_splits, torch.SymInt):  # a count dynamo made dynamic was checked when first seen
        validate.check_num_splits(num_splits)
    plan.check_options(num_splits, batch_invariant)
    plan.check_traced(q, k_cache, block_table, backend, variant)
    return plan.backend, plan.forced, plan.batch_invariant
