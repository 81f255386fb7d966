"""Every input check of splitkv.decode, in one place.

Each error names the argument and says what was expected. Checks that need the host values of
cache_seqlens (negative or too long lengths) run only when the caller did not pass a plan: with a
plan the lengths may live on the GPU inside a CUDA graph, and reading them would synchronise.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

from .constants import BACKEND_CHOICES, HEAD_DIM_RANGE, MAX_Q_LEN
from .variants import FP8_DTYPES

HEAD_DIM_RULE = f"a multiple of 8 in [{HEAD_DIM_RANGE[0]}, {HEAD_DIM_RANGE[1]}]"
BACKENDS = BACKEND_CHOICES  # what backend= accepts (splitkv.constants)
LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Problem:
    """The shape facts every later layer needs, read off validated inputs."""

    batch: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_seqlen: int  # keys addressable per request: Lmax, or max_pages * page_size when paged
    page_size: int | None  # None for a contiguous cache
    dtype: torch.dtype
    kv_fp8: bool = False  # K/V in float8 (e4m3fn / e5m2), read with k_scale / v_scale
    # what the eager path remembers for inputs of this signature (validated Problems are cached
    # per signature, so one Problem object = one signature): plan -> bound launch (splitkv.execute)
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def head_dim_ok(d) -> bool:
    return isinstance(d, int) and HEAD_DIM_RANGE[0] <= d <= HEAD_DIM_RANGE[1] and d % 8 == 0


def _need(cond: bool, exc: type[Exception], msg: str) -> None:
    if not cond:
        raise exc(msg)


def as_int(x) -> int | None:
    """x as a Python int when it is an integer (Python, NumPy or a 0-d integer tensor; not a bool),
    else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and (x.dim() != 0 or x.dtype == torch.bool)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def check_num_splits(num_splits) -> None:
    if num_splits is not None:
        _need(isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits >= 1, ValueError,
              f"num_splits: expected None or an int >= 1, got {num_splits!r}")


def check_backend(backend: str) -> None:
    _need(isinstance(backend, str) and backend in BACKENDS, ValueError,
          f"backend: expected one of {BACKENDS}, got {backend!r}")


_SEEN: dict = {}  # signature of inputs that passed -> Problem (validation is ~40 us of host time)


def _signature(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, backend):
    """Everything the checks below look at except values: shapes, strides, dtypes, devices (a
    flat tuple: this is built on every call)."""
    bt = (block_table.shape, block_table.stride(), block_table.dtype, block_table.device) if block_table is not None \
        else None
    return (num_splits, softmax_scale, backend, type(num_splits), type(softmax_scale),
            q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device, bt)


def forget() -> None:
    """Drop every remembered signature (and with it, each Problem's memo)."""
    _SEEN.clear()


def forget_signature(key) -> None:
    """Drop one signature's Problem (and its memo); the next call with it validates again."""
    _SEEN.pop(key, None)


def check_keyed(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, backend,
                causal) -> tuple:
    """(key, Problem): key = the inputs' signature (None when not hashable). One Problem object per
    signature, so its memo belongs to that signature."""
    try:
        key = (_signature(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, backend),
               causal, type(causal))
        prob = _SEEN.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable: the full checks say what is wrong
        key = prob = None
    if prob is not None:
        return key, prob
    check_causal(causal)
    prob = _check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, backend)
    if key is not None:
        if len(_SEEN) > 1024:
            _SEEN.clear()
        _SEEN[key] = prob
    return key, prob


def check_causal(causal) -> None:
    _need(isinstance(causal, bool), TypeError, f"causal: expected a Python bool, got {causal!r} of {type(causal)}")


def check_softmax_scale(softmax_scale) -> None:
    if softmax_scale is not None:
        _need(isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
              and math.isfinite(softmax_scale) and softmax_scale > 0, ValueError,
              f"softmax_scale: expected a finite positive float, got {softmax_scale!r}")


def check_tensors(q, k_cache, v_cache, cache_seqlens) -> None:
    """The tensor arguments are tensors and q is 4-D (checked first, also before a variant's own
    arguments are read against q's shape)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        _need(isinstance(t, torch.Tensor), TypeError, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _need(q.dim() == 4, ValueError, f"q: expected rank 4 [B, Sq, Hq, D], got shape {tuple(q.shape)}")


def _check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale,
                         backend: str) -> Problem:
    check_tensors(q, k_cache, v_cache, cache_seqlens)
    check_backend(backend)
    allowed = LOW_DTYPES + ((torch.float32,) if backend in ("torch", "auto") else ())
    _need(q.dtype in allowed, TypeError,
          f"q: expected dtype in {allowed} for backend {backend!r}, got {q.dtype}")
    B, Sq, Hq, D = q.shape
    _need(1 <= Sq <= MAX_Q_LEN, ValueError, f"q: expected 1 <= Sq (dim 1) <= {MAX_Q_LEN}, got Sq={Sq}")
    _need(head_dim_ok(D), ValueError, f"q: head dim {D} not supported, expected {HEAD_DIM_RULE}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need(t.dim() == 4, ValueError,
              f"{name}: expected rank 4 [B, Lmax, Hkv, D] or [num_pages, page_size, Hkv, D], got shape {tuple(t.shape)}")
        _need(t.dtype == q.dtype or t.dtype in FP8_DTYPES, TypeError,
              f"{name}: dtype {t.dtype} does not match q's dtype {q.dtype} (nor is it a float8 dtype {FP8_DTYPES})")
        _need(t.device == q.device, ValueError, f"{name}: on {t.device} but q is on {q.device}")
        _need(t.stride(-1) == 1, ValueError,
              f"{name}: head dim (last) must have unit stride, got strides {tuple(t.stride())}")
    _need(k_cache.dtype == v_cache.dtype, TypeError,
          f"v_cache: dtype {v_cache.dtype} does not match k_cache's {k_cache.dtype}")
    _need(k_cache.shape == v_cache.shape, ValueError,
          f"v_cache: shape {tuple(v_cache.shape)} does not match k_cache's {tuple(k_cache.shape)}")
    _need(q.stride(-1) == 1, ValueError, f"q: head dim (last) must have unit stride, got strides {tuple(q.stride())}")
    Hkv, Dk = k_cache.shape[2], k_cache.shape[3]
    _need(Dk == D, ValueError, f"k_cache: head dim {Dk} does not match q's head dim {D}")
    _need(Hq >= 1, ValueError, f"q: expected at least one query head (dim 2), got shape {tuple(q.shape)}")
    _need(Hkv >= 1 and Hq % Hkv == 0, ValueError,
          f"q: number of query heads {Hq} must be a multiple of k_cache's KV heads {Hkv}")
    _need(cache_seqlens.dim() == 1 and cache_seqlens.shape[0] == B, ValueError,
          f"cache_seqlens: expected shape [{B}] (one length per request), got {tuple(cache_seqlens.shape)}")
    _need(cache_seqlens.dtype == torch.int32, TypeError, f"cache_seqlens: expected dtype int32, got {cache_seqlens.dtype}")
    _need(cache_seqlens.device == q.device, ValueError, f"cache_seqlens: on {cache_seqlens.device} but q is on {q.device}")
    check_num_splits(num_splits)
    check_softmax_scale(softmax_scale)

    if block_table is None:
        _need(k_cache.shape[0] == B, ValueError,
              f"k_cache: batch dim {k_cache.shape[0]} does not match q's batch {B} (contiguous cache)")
        max_seqlen, page_size = k_cache.shape[1], None
    else:
        _need(isinstance(block_table, torch.Tensor), TypeError,
              f"block_table: expected a torch.Tensor, got {type(block_table).__name__}")
        _need(block_table.dtype == torch.int32, TypeError, f"block_table: expected dtype int32, got {block_table.dtype}")
        _need(block_table.dim() == 2 and block_table.shape[0] == B, ValueError,
              f"block_table: expected shape [{B}, max_pages], got {tuple(block_table.shape)}")
        _need(block_table.device == q.device, ValueError, f"block_table: on {block_table.device} but q is on {q.device}")
        page_size = k_cache.shape[1]
        _need(page_size >= 1, ValueError,
              f"k_cache: page size (dim 1 of a paged cache) must be >= 1, got shape {tuple(k_cache.shape)}")
        max_seqlen = block_table.shape[1] * page_size
    return Problem(B, Sq, Hq, Hkv, D, max_seqlen, page_size, q.dtype, k_cache.dtype in FP8_DTYPES)


def check_plan_args(cache_seqlens, num_q_heads, num_kv_heads, head_dim, q_len, num_splits, max_seqlen, backend,
                    paged, dtype, batch_invariant, *, num_sms=None, kv_dtype=None) -> None:
    """splitkv.plan's arguments, held to the same rules as decode's inputs."""
    _need(isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 1, ValueError,
          "cache_seqlens: expected a 1-D int32 tensor [B]")
    _need(cache_seqlens.dtype == torch.int32, TypeError, f"cache_seqlens: expected dtype int32, got {cache_seqlens.dtype}")
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("q_len", q_len)):
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, ValueError,
              f"{name}: expected a positive int, got {v!r}")
    _need(num_q_heads % num_kv_heads == 0, ValueError,
          f"num_q_heads: {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    _need(head_dim_ok(head_dim), ValueError, f"head_dim: {head_dim} not supported, expected {HEAD_DIM_RULE}")
    _need(q_len <= MAX_Q_LEN, ValueError, f"q_len: expected 1 <= q_len <= {MAX_Q_LEN}, got {q_len}")
    check_num_splits(num_splits)
    if max_seqlen is not None:
        _need(isinstance(max_seqlen, int) and not isinstance(max_seqlen, bool) and max_seqlen >= 1, ValueError,
              f"max_seqlen: expected a positive int, got {max_seqlen!r}")
    if cache_seqlens.numel() and cache_seqlens.device.type == "cpu":  # free to read here (no device sync)
        lo, hi = cache_seqlens.aminmax()
        _need(int(lo) >= 0, ValueError, "cache_seqlens: lengths must be >= 0")
        _need(max_seqlen is None or int(hi) <= max_seqlen, ValueError,
              f"cache_seqlens: longest length {int(hi)} exceeds max_seqlen {max_seqlen}")
    check_backend(backend)
    _need(isinstance(paged, bool), TypeError, f"paged: expected a bool, got {type(paged).__name__}")
    _need(isinstance(batch_invariant, bool), TypeError,
          f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    _need(dtype is None or dtype in LOW_DTYPES + (torch.float32,), TypeError,
          f"dtype: expected None, torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
    _need(dtype != torch.float32 or backend in ("torch", "auto"), TypeError,
          f"dtype: torch.float32 runs on the torch backend only, got backend {backend!r}")
    _need(kv_dtype is None or kv_dtype in FP8_DTYPES
          or (kv_dtype in LOW_DTYPES + (torch.float32,) and kv_dtype == (dtype or kv_dtype)), TypeError,
          f"kv_dtype: expected None, the queries' dtype or a float8 dtype {FP8_DTYPES}, got {kv_dtype!r}"
          f"{f' with dtype {dtype}' if dtype is not None else ''}")
    if num_sms is not None:
        n = as_int(num_sms)
        _need(n is not None and n >= 1, ValueError, f"num_sms: expected None or a positive int, got {num_sms!r}")


def check_scale_values(k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Per-KV-head fp8 scales read on the host (where decode reads its lengths there too): each a
    finite value > 0, as float scales must be."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        vals = s.tolist()
        bad = [(h, x) for h, x in enumerate(vals) if not (math.isfinite(x) and x > 0)]
        if bad:
            raise ValueError(f"{name}: every per-KV-head scale must be a finite float > 0, got {bad[0][1]!r} at "
                             f"KV head {bad[0][0]}")


def check_seqlens_host(lengths: list[int], prob: Problem, block_table, num_pages: int) -> None:
    """Host-side length checks (used when decode builds its own plan and so reads lengths anyway)."""
    bad = [(b, L) for b, L in enumerate(lengths) if L < 0 or L > prob.max_seqlen]
    if bad:
        b, L = bad[0]
        what = "max_pages * page_size" if block_table is not None else "Lmax (k_cache dim 1)"
        raise ValueError(f"cache_seqlens: entry {b} is {L}, expected 0 <= length <= {what} = {prob.max_seqlen}")
    if block_table is not None and lengths:
        ps = prob.page_size
        used = [-(-L // ps) for L in lengths]
        cols = torch.arange(block_table.shape[1], device=block_table.device)
        mask = cols[None, :] < torch.tensor(used, device=block_table.device)[:, None]
        ids = block_table[mask]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
            raise ValueError(f"block_table: page ids of used pages must be in [0, {num_pages}), "
                             f"got range [{int(ids.min())}, {int(ids.max())}]")


def check_out(out, lse_shape, prob: Problem, q: torch.Tensor) -> None:
    if out is None:
        return
    _need(isinstance(out, torch.Tensor), TypeError, f"out: expected a torch.Tensor, got {type(out).__name__}")
    _need(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, ValueError,
          f"out: expected shape {tuple(q.shape)}, dtype {q.dtype} on {q.device}, got "
          f"{tuple(out.shape)}, {out.dtype} on {out.device}")
    _need(out.stride(-1) == 1, ValueError, "out: head dim (last) must have unit stride")
