"""The eager decode path: validate (cached per input signature) -> plan (made once per signature and
stream, or passed in) -> schedule on the device -> backend launch.

Per call, without a plan, the host does: one signature lookup, one plan lookup, the schedule launch
(skipped when the lengths tensor is unchanged since the plan's last schedule: the layers of a step
share one) and the split launch (+ the merge launch where the merge is not fused), and allocates o (and lse
when returned). It never reads cache_seqlens: no device->host sync, and the call can be captured in
a CUDA graph (its plan is sized for the cache's capacity: Lmax, or max_pages * page_size).

The second call of a signature takes the lean path: the first one, through the backend's run(),
compiled and checked everything; the backend's bind() then returns a launch with every argument
but the call's data pointers bound (Triton's C launcher, or the CuTe host function, directly), kept
in the signature's Problem.memo under the plan (or, without one, the stream). A lean call reads the
pointers, allocates o, checks 16-byte alignment (what the kernels were specialised for) and
launches; anything else (an out= that is not a contiguous tensor like q, a debug capture, a
misaligned pointer, another current device) takes the full path, which gives the same result.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from . import debug, validate
from .plan import DecodePlan, build, maybe_print
from .variants import PLAIN, PLAIN_KEY

# (signature, stream or thread) -> DecodePlan, oldest first. Past MAX_PLANS entries (a cache grown
# by torch.cat makes a new signature every step) the oldest plans go, down to 3/4 of it, with their
# signatures' bound launches: CPU plans, and CUDA plans of the device's default stream, which were
# allocated on the stream they run on, so the allocator reuses their memory only after their
# launches (stream order). Never evicted: the plan the call is making, plans a CUDA-graph capture
# ran (DecodePlan.captured: a graph replays into their workspace) and plans of other streams (their
# memory was allocated on the default stream, by workspace.outside_graph_pools' helper thread);
# splitkv.clear_plans(), which synchronises first, is the explicit release of those.
MAX_PLANS = 128
_PLANS: dict = {}
_LOCK = threading.Lock()


# SPLITKV_DEBUG=1 (read at import): host-side checks of lengths and page ids on every call
DEBUG = os.environ.get("SPLITKV_DEBUG", "0") not in ("", "0")
_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds; CUDA inputs only


def _owner(device: torch.device):
    """Who may use a cached plan's workspace: the current CUDA stream, or the thread on the CPU."""
    if device.type == "cuda":
        return _stream_of(device.index)
    return threading.get_ident()


def _align_bits(*ts) -> int:
    bits = 0
    for t in ts:
        bits |= t.data_ptr()
    return bits & 15


def _cached_plan(key, prob, q, k_cache, v_cache, out, backend, num_splits, batch_invariant, variant):
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    from .backends.cutlass import layout_ok

    ok = q.device.type == "cuda" and layout_ok(q, k_cache, v_cache, out if out is not None else q)
    plan = build(prob, q.device, backend=backend, num_splits=num_splits, batch_invariant=batch_invariant,
                 layout_ok=ok, variant=variant)
    maybe_print(plan)
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        plan.captured[0] = True  # made inside a capture: the graph holds its workspace
    with _LOCK:
        _PLANS[key] = plan
        if len(_PLANS) > MAX_PLANS:
            _evict(MAX_PLANS * 3 // 4, key)
    return plan


def _evict(keep: int, newest) -> None:
    """Drop the oldest plans that may go (see _PLANS) until `keep` are left; under _LOCK."""
    for key, plan in list(_PLANS.items()):
        if len(_PLANS) <= keep:
            break
        if key == newest or plan.captured[0]:
            continue
        if plan.device.type == "cuda" and key[1][0] != torch.cuda.default_stream(plan.device).cuda_stream:
            continue
        del _PLANS[key]
        validate.forget_signature(key[0])  # its Problem's memo holds the plan's bound launches


def clear_plans() -> None:
    """Drop the plans decode() made for itself (they hold workspace memory). Do not call it while a
    CUDA graph that captured a plain decode may still be replayed."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no launch of theirs may still be reading the memory given back
    with _LOCK:
        _PLANS.clear()
        validate.forget()  # the signatures' memos hold plans and their bound launches too


def _memo_key(stream, batch_invariant, plan, vkey):
    base = (stream, batch_invariant) if plan is None else plan
    return base if vkey is None else (base, vkey)


def _lean(q, k_cache, v_cache, cache_seqlens, block_table, plan, return_lse, batch_invariant, memo, out, variant):
    """The lean path (module docstring): o, or (o, lse); None when the full path must run."""
    dev = q.get_device()
    if dev < 0:
        return None
    vkey = vptrs = None
    if variant is not PLAIN:  # bound per kernel_key; its tensors' pointers are passed per call
        vkey, vptrs = variant.kernel_key(), variant.pointers()
        if vptrs is None:
            return None
    stream = _stream_of(dev)
    hit = memo.get(_memo_key(stream, batch_invariant, plan, vkey))
    if hit is None or torch._C._cuda_getDevice() != dev:
        return None
    p, launch, plain = hit
    qp, kp, vp, lp = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr()
    bp = block_table.data_ptr() if block_table is not None else lp
    if (qp | kp | vp | lp | bp) & 15:
        return None
    if out is None:  # plain: q is contiguous, so empty_like keeps the bound layout (and is the cheaper call)
        o = torch.empty_like(q) if plain else torch.empty_like(q, memory_format=torch.contiguous_format)
    elif (type(out) is torch.Tensor and out.get_device() == dev and out.dtype == q.dtype and out.shape == q.shape
          and out.is_contiguous()):  # the layout the launch was bound for (a contiguous o)
        o = out
    else:
        return None
    op = o.data_ptr()
    if op & 15:
        return None
    lse = torch.empty_like(p.lse_scratch) if return_lse else p.lse_scratch
    with p.lock:
        if plan is None:
            p.schedule_if_new(cache_seqlens)
        if vptrs is None:
            launch(stream, qp, kp, vp, lp, bp, op, lse.data_ptr())  # lse: a torch allocation, 512-byte aligned
        else:
            launch(stream, qp, kp, vp, lp, bp, op, lse.data_ptr(), vptrs)
    return (o, lse) if return_lse else o


def _remember(memo, q, k_cache, v_cache, cache_seqlens, block_table, plan, own_plan, out, lse, scale, causal,
              batch_invariant, variant) -> None:
    """After a full call: bind its launch for the lean path, where the call qualifies."""
    bind = getattr(plan.module, "bind", None)
    if bind is None or q.device.type != "cuda" or not cache_seqlens.is_contiguous():
        return
    if block_table is not None and block_table.stride(-1) != 1:
        return
    ptrs = q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | cache_seqlens.data_ptr() | out.data_ptr()
    if (ptrs | lse.data_ptr() | (block_table.data_ptr() if block_table is not None else 0)) & 15:
        return
    launch = bind(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal, variant=variant)
    if launch is not None:
        plain = q.is_contiguous() and q.stride() == out.stride()
        vkey = None if variant is PLAIN else variant.kernel_key()
        memo[_memo_key(_stream_of(q.get_device()), batch_invariant, None if own_plan else plan, vkey)] = (
            plan, launch, plain)


def decode_eager(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=True, softmax_scale=None,
                 num_splits=None, return_lse=False, out=None, plan=None, backend="auto", batch_invariant=False,
                 variant=PLAIN):
    """splitkv.decode without the torch.compile dispatch (what the custom op runs). variant: a
    checked splitkv.variants.Variant (a repeated variant call takes the lean path too: its launch
    is bound per Variant.kernel_key, and its tensors' pointers are passed per call)."""
    if type(batch_invariant) is not bool:  # before the lean path, whose memo key 0 would equal False
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    key, prob = validate.check_keyed(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale,
                                     backend, causal)
    if prob is not None and prob.kv_fp8 and variant.k_scale is None:
        raise ValueError(f"k_scale: required with a {k_cache.dtype} cache (with v_scale: floats, or float32 [Hkv])")
    lean = (prob is not None and not DEBUG and not debug.active()
            and (plan is None or (type(plan) is DecodePlan and plan.admits(batch_invariant))))
    if lean:
        res = _lean(q, k_cache, v_cache, cache_seqlens, block_table, plan, return_lse, batch_invariant, prob.memo,
                    out, variant)
        if res is not None:
            return res
    if out is not None:
        validate.check_out(out, None, prob, q)
    copied, bt_copied = not cache_seqlens.is_contiguous(), False
    if copied:  # the kernels read lengths (and table rows) unit-stride
        cache_seqlens = cache_seqlens.contiguous()
    if block_table is not None and block_table.stride(-1) != 1:
        block_table, bt_copied = block_table.contiguous(), True
    own_plan = plan is None
    # lengths and page ids: read on the host only where that is free (a decode on the CPU, with or
    # without a plan) or asked for (SPLITKV_DEBUG=1); on a GPU with a plan they are the caller's contract
    if (q.device.type == "cpu" and not torch.compiler.is_compiling()) or DEBUG:
        validate.check_seqlens_host(cache_seqlens.tolist(), prob, block_table, k_cache.shape[0])
        if variant.fp8 == "head":
            validate.check_scale_values(variant.k_scale, variant.v_scale)
    if own_plan:
        extra = (_owner(q.device), batch_invariant, _align_bits(q, k_cache, v_cache), variant.key())
        plan = _cached_plan((key, extra), prob, q, k_cache, v_cache, out, backend, num_splits, batch_invariant,
                            variant)
    else:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan: expected a splitkv.DecodePlan, got {type(plan).__name__}")
        plan.check_options(num_splits, batch_invariant)
        if plan.checked[0] is not prob or backend != "auto":  # validated Problems are cached: same object, same call
            plan.check_call(prob, backend, q.device)
            plan.checked[0] = prob if backend == "auto" else None
        if variant is not PLAIN or plan.variant_key != PLAIN_KEY:
            plan.check_variant(variant)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(prob.head_dim)
    o = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = (torch.empty(prob.batch, prob.num_q_heads, prob.q_len, dtype=torch.float32, device=q.device)
           if return_lse else plan.lse_scratch)
    with plan.lock:
        if own_plan:
            plan.schedule(cache_seqlens) if copied else plan.schedule_if_new(cache_seqlens)
            if copied and q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                plan.captured[0] = True  # schedule_if_new marks the other calls
        plan.module.run(q, k_cache, v_cache, cache_seqlens, block_table, plan, plan.o_part, plan.lse_part, o, lse,
                        scale, causal, variant)
    if debug.active():
        debug.record(plan, cache_seqlens, plan.o_part, plan.lse_part, lse, o)
    # bound for a contiguous o; never for strided lengths or table: the lean path would pass the
    # caller's strided tensors where the kernels read the copies made above
    elif lean and key is not None and not (copied or bt_copied) and (out is None or out.is_contiguous()):
        _remember(prob.memo, q, k_cache, v_cache, cache_seqlens, block_table, plan, own_plan, o, lse, scale, causal,
                  batch_invariant, variant)
    return (o, lse) if return_lse else o
