"""Triton KV append: write new K and V rows into the paged pools, rotating K (RoPE) on the way in.

One launch for every sequence of an append. One program = (token row r = i * T + t, block of
BLOCK_H KV heads); it copies k[i, t, heads] and v[i, t, heads] to (page, slot) of the pools.

Destination, computed in the kernel from host-made tables (no per-token host work):
    pos  = starts[i] + t                      (the token's absolute position in sequence i)
    page = pages[i, pos // page_size - starts[i] // page_size]
    slot = pos % page_size
pages [N, W] int32 lists, per sequence, the pages its new tokens touch, from the one holding
position starts[i] on. Rows with t >= ntok[i] are skipped (ragged appends).

RoPE (ROPE=True): dim d < ROT_DIM of K becomes x[d] cos[f] + sign x[partner] sin[f] with
    neox: partner = d +- ROT_DIM/2, f = d mod ROT_DIM/2, sign = -1 on the first half;
    gptj: partner = d ^ 1,         f = d // 2,          sign = -1 on even d;
cos/sin fp32 tables [max_pos, ROT_DIM // 2] indexed by pos (splitkv.rope.rope_tables). The partner
is a second load of the same row (same cache lines), so no register shuffle is needed.

Layouts: k, v [N, T, Hkv, D]; pools [num_pages, page_size, Hkv, D]; any strides with unit stride
on D. Math in fp32, one rounding to the pool dtype (fp8 pools: x / scale[h], saturated to the
largest finite fp8 value, then the rounding). Deterministic: each output element is written
by exactly one program.
"""

import torch
import triton
import triton.language as tl

from ... import heuristics


@triton.jit
def append_kernel(
    K, V, K_POOL, V_POOL, PAGES, STARTS, NTOK, COS, SIN, K_SCALE, V_SCALE,
    T,
    s_kn, s_kt, s_kh, s_vn, s_vt, s_vh,
    s_kp, s_ks, s_kph, s_vp, s_vs, s_vph,
    s_pages, s_cos,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr, ROT_DIM: tl.constexpr, NEOX: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    row = tl.program_id(0)
    i = row // T
    t = row % T
    n = tl.load(NTOK + i)
    if t >= n:
        return
    start = tl.load(STARTS + i)
    pos = start + t
    page = tl.load(PAGES + i * s_pages + pos // PAGE_SIZE - start // PAGE_SIZE).to(tl.int64)
    slot = pos % PAGE_SIZE

    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    i64 = i.to(tl.int64)  # N * T * Hkv * D of a long prefill may pass 2^31
    k_row = K + i64 * s_kn + t * s_kt + h[:, None] * s_kh
    v_row = V + i64 * s_vn + t * s_vt + h[:, None] * s_vh

    x = tl.load(k_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        rot = d < ROT_DIM
        if NEOX:
            first = d < ROT_DIM // 2
            partner = tl.where(first, d + ROT_DIM // 2, d - ROT_DIM // 2)
            f = tl.where(first, d, d - ROT_DIM // 2)
            sign = tl.where(first, -1.0, 1.0)
        else:
            partner = d ^ 1
            f = d // 2
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        c = tl.load(COS + pos * s_cos + f, mask=rot, other=1.0)  # dims past ROT_DIM: x * 1 + 0
        s = tl.load(SIN + pos * s_cos + f, mask=rot, other=0.0)
        xp = tl.load(k_row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        x = x * c[None, :] + (sign * s)[None, :] * xp
    if FP8:  # stored as x / scale[h], saturated (the cast alone would give NaN past the largest value)
        ks = tl.load(K_SCALE + h, mask=h < NUM_HEADS, other=1.0)
        x = tl.minimum(tl.maximum(x / ks[:, None], -FP8_MAX), FP8_MAX)
    k_dst = K_POOL + page * s_kp + slot * s_ks + h[:, None] * s_kph + d[None, :]
    tl.store(k_dst, x.to(K_POOL.dtype.element_ty), mask=mask)

    y = tl.load(v_row + d[None, :], mask=mask, other=0.0)
    if FP8:
        vs = tl.load(V_SCALE + h, mask=h < NUM_HEADS, other=1.0)
        y = tl.minimum(tl.maximum(y.to(tl.float32) / vs[:, None], -FP8_MAX), FP8_MAX)
    v_dst = V_POOL + page * s_vp + slot * s_vs + h[:, None] * s_vph + d[None, :]
    tl.store(v_dst, y.to(V_POOL.dtype.element_ty), mask=mask)


def append_kv(k_pool, v_pool, k, v, pages, starts, ntok, cos=None, sin=None, *, neox=True, k_scale=None,
              v_scale=None):
    """Write k, v [N, T, Hkv, D] into k_pool, v_pool [P, page_size, Hkv, D] (see module doc);
    fp8 pools: k_scale, v_scale float32 [Hkv], the pools get K / k_scale and V / v_scale.

    pages int32 [N, W], starts int32 [N], ntok int32 [N] on the pools' device (contiguous 1-D
    starts/ntok); cos/sin fp32 [max_pos, rotary_dim // 2] or None for no RoPE.
    """
    N, T, H, D = k.shape
    if N * T == 0:
        return
    block_h, block_d, num_warps = heuristics.append_tile(H, D)
    rope = cos is not None
    cos_t = cos if rope else starts  # never read without RoPE
    sin_t = sin if rope else starts
    grid = (N * T, triton.cdiv(H, block_h))
    fp8 = k_scale is not None
    append_kernel[grid](
        k, v, k_pool, v_pool, pages, starts, ntok, cos_t, sin_t, k_scale if fp8 else starts,
        v_scale if fp8 else starts,
        T,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        pages.stride(0), cos.stride(0) if rope else 0,
        NUM_HEADS=H, HEAD_DIM=D, PAGE_SIZE=k_pool.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        ROPE=rope, ROT_DIM=2 * cos.shape[1] if rope else 0, NEOX=bool(neox), FP8=fp8,
        FP8_MAX=float(torch.finfo(k_pool.dtype).max) if fp8 else 0.0,
        num_warps=num_warps,
    )
