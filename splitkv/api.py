"""splitkv.decode: validate -> plan -> workspace -> backend.run (split + combine)."""

from __future__ import annotations

import math
import os

import torch

from . import backends, debug, validate
from .plan import DecodePlan, build_plan, maybe_print


def decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=True, softmax_scale=None,
           num_splits=None, return_lse=False, out=None, plan: DecodePlan | None = None, backend="auto"):
    """Split-KV decode attention.

    q [B, Sq, Hq, D] fp16/bf16 (fp32 on the torch backend); k_cache/v_cache [B, Lmax, Hkv, D]
    (contiguous) or [num_pages, page_size, Hkv, D] with block_table int32 [B, max_pages] (paged);
    cache_seqlens int32 [B] = valid keys per request, the Sq new ones included. Causal (Sq > 1)
    is bottom-right aligned. Returns o [B, Sq, Hq, D] in q's dtype, and lse [B, Hq, Sq] fp32
    (natural log) when return_lse. A query that sees no key gets o = 0, lse = -inf.

    plan: from splitkv.plan(...), reused across layers; a graph-safe plan (max_seqlen=...) makes
    this call capturable in a CUDA graph (call plan.refresh(cache_seqlens) once per step, inside
    the graph too, to re-balance splits for new lengths; results are correct without it).
    Without a plan, decode plans from the actual lengths, which reads cache_seqlens on the host.
    """
    if plan is None and torch.compiler.is_compiling():
        # under torch.compile the host read of cache_seqlens would break the graph: go through
        # the registered custom op, whose fake impl gives dynamo the output shapes
        from . import ops

        o, lse = ops.decode_op(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale,
                               num_splits, backend)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o
    return decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, causal=causal,
                        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
                        out=out, plan=plan, backend=backend)


def decode_eager(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=True, softmax_scale=None,
                 num_splits=None, return_lse=False, out=None, plan=None, backend="auto"):
    """decode() without the torch.compile dispatch (what the custom op runs)."""
    prob = validate.check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table, num_splits,
                                        softmax_scale, backend)
    validate.check_out(out, None, prob, q)
    name = backends.resolve(backend, q.device)
    if name != "torch" and q.dtype not in validate.LOW_DTYPES:
        raise TypeError(f"q: backend {name!r} takes float16 or bfloat16, got {q.dtype}")
    if plan is None:
        lengths = [int(x) for x in cache_seqlens.tolist()]
        validate.check_seqlens_host(lengths, prob, block_table, k_cache.shape[0])
        plan = build_plan(lengths, batch=prob.batch, num_q_heads=prob.num_q_heads,
                          num_kv_heads=prob.num_kv_heads, head_dim=prob.head_dim, q_len=prob.q_len,
                          device=q.device, num_splits=num_splits, target=backends.plan_target(backend, q.device),
                          paged=block_table is not None)
        maybe_print(plan)
    else:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan: expected a splitkv.DecodePlan, got {type(plan).__name__}")
        if num_splits is not None and num_splits != plan.forced:
            raise ValueError("num_splits: pass it to splitkv.plan(...), not together with plan=")
        plan.check_matches(prob, q.device)
        if os.environ.get("SPLITKV_DEBUG", "0") not in ("", "0"):  # the caller's contract, checked on demand
            validate.check_seqlens_host([int(x) for x in cache_seqlens.tolist()], prob, block_table, k_cache.shape[0])
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(prob.head_dim)
    o = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    name = backends.refine_auto(backend, name, plan, q, k_cache, v_cache, o)
    lse = torch.empty(prob.batch, prob.num_q_heads, prob.q_len, dtype=torch.float32, device=q.device)
    o_part, lse_part = plan.partials()
    backends.get(name).run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part,
                           o, lse, scale, causal)
    if debug.active():
        debug.record(plan, cache_seqlens, o_part, lse_part, lse)
    return (o, lse) if return_lse else o
