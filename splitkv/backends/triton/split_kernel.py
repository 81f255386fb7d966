"""Triton split kernel: one program = (split s, request b, KV head, query tile).
Grid: (B x KV heads x m-tiles, max_splits), or with HAS_WORK (KV heads x m-tiles, work items) where
column i of the plan's work list WORK [2, s_work] gives (b, s) (-1: no work; heuristics.work_list).
Blocks start in grid order (x fastest): the splits every request has come before the empty ones
(split on y), so working blocks spread evenly over the SMs; with the work list, every KV head of
one (request, split) starts together — their loads share DRAM pages (a [.., Hkv, D] row holds all
heads) — and the empty items come last.

Algorithm: online softmax (base 2) over the keys of split s of request b,
    keys [f + s * chunk_lens[b], min(f + (s+1) * chunk_lens[b], L_b))  (the last split runs on to L_b),
where f = 0, or with a sliding window the first key any query sees, max(0, L_b - Sq - left).
Variants (splitkv.variants has the math; constexpr flags, so a plain decode compiles none of it):
SOFTCAP (tanh), ALIBI (slope x distance), WINDOW (masks + the start f), SINKS (joined to the
softmax once per row: in the unsplit store or the merge, never in a partial).
KV_FP8: float8 K/V converted to fp16 in registers and both dots done in fp16, q converted once
(clamped to fp16's range; a bf16 q loses no bits above 2^-14). e4m3 -> fp16 is one cvt per two
values on sm_90, e4m3 -> bf16 three (via fp16): H200, B=16 GQA 32K contiguous, block_n 128:
380-435 us in fp16 vs 497-515 in bf16 (benchmarks/results/2026-12-02-h200-fp8/fp8_tiles.json).
k_scale is folded into qk_mul, v_scale (v_mul) into the normalised output; SCALE_PER_HEAD: both
loaded per KV head (one per program).
V_PAIRS (fp8, where every V stride but D's and the pointer are even: launch._v_pairs): V is read as
int16 words [BLOCK_N, BLOCK_D / 2], each two columns of one key. For P @ V the dot needs pairs of
keys per column, which sm_90 cannot load from fp8 bytes (no 8-bit ldmatrix.trans): read byte by
byte, V took 132 shared loads per thread per tile. As 16-bit words ldmatrix.trans loads them, one
byte permute per two words gathers the even columns' bytes and the odd ones', one cvt per half
converts them (_fp8_pairs), and two dots over half the columns each (acc, acc2) replace one; the
epilogue interleaves them back. sm_90 SASS of the key loop (D 128, group 4): 1094 -> 717
instructions; H200, B=1 GQA 32/8 128K e4m3 84.7 -> 70.2 us (results/2026-12-04-h200-fp8v/).
HOIST_ROWS (contiguous caches; launch.HOIST_ROWS, off by default, fp8 only): a tile's row offsets
as one scalar (its first key) plus j * stride, loop-invariant, instead of a 64-bit product per row
and tile. sm_90 SASS of the fp8 key loop (D 128, group 4): 717 -> 681 instructions, 184 -> 239
registers (two CTAs per SM either way); bf16 tiles gain registers too (e.g. 96 -> 140), so bf16
keeps the per-row products. Not yet measured on the GPU.
Head dims: any D, padded to BLOCK_D (a power of 2) in registers; columns past D are masked.
with all qhead_per_kvhead query heads of the KV head x Sq tokens packed as the M rows of one
tile (row r -> token r // G, head kvh * G + r % G), so each K/V byte is read once per KV head.

Layouts: q [B, Sq, Hq, D]; K/V contiguous [B, Lmax, Hkv, D] or paged [P, page_size, Hkv, D] with
block_table [B, max_pages] (pages gathered here, per key row; entries past the last used page are
never read); any strides with unit stride on D. PAGE_ALIGNED (the launch sets it where every tile
starts at a multiple of min(PAGE_SIZE, BLOCK_N), heuristics.aligned_page_lookup): a row's place in
its page is the tile's constant row index, so no per-row division and the offsets leave the loop.
Outputs: a request with num_splits == 1 writes o (q dtype) and lse directly — no merge needed;
otherwise o_part [S, B, Hq, Sq, D] fp32 (normalised) and lse_part [S, B, Hq, Sq] fp32 (natural
log, -inf for a split that saw no key; then o_part = 0). NaN in q or in a used key / value
propagates to o and lse (as in SDPA): "saw a key" is l != 0, which NaN passes; only a row with no
visible key is o = 0, lse = -inf. With FUSED_MERGE the last split block
of each (request, KV head, m-tile) to arrive (an atomic counter per group, COUNTERS, zero between
launches) merges the group's partials itself, so no merge launch follows.
Deterministic: a fixed reduction order per program and a merge in split order; the counter only
decides which block merges, not the arithmetic.
Offsets: every product of an index and a stride is 64-bit (the index is cast first), so a cache
or workspace of more than 2^31 elements (e.g. [B, Hkv, L, D] storage viewed with .transpose(1, 2),
where kvh * s_kh passes 2^31 once (Hkv - 1) * Lmax * D does) is addressed correctly.
"""

import triton
import triton.language as tl

from ...constants import LN2 as _LN2
from ...constants import LOG2E as _LOG2E
from .merge_kernel import with_sink

LN2 = tl.constexpr(_LN2)  # the host passes scale * LOG2E (splitkv.constants): the kernel works in base 2
LOG2E = tl.constexpr(_LOG2E)


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 (portable: the interpreter has no libdevice); +-1 beyond |x| ~ 9.
    Below |x| = 1/8 its Taylor polynomial (relative error < 1e-7), where 1 - 2 / (e^2x + 1) cancels:
    a large softcap (scores / cap ~ 1e-6) would lose every digit of its scores."""
    x2 = x * x
    small = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0)))
    return tl.where(tl.abs(x) < 0.125, small, 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0))


@triton.jit
def _fp8_pairs(w, E5M2: tl.constexpr):
    """int16 words of two fp8 values (low byte: even column) -> (even, odd) fp16. Two words of
    consecutive keys share a 32-bit register: one byte permute puts the even columns' bytes in its
    low half and the odd ones' in its high half, and one cvt per half converts each pair."""
    if E5M2:
        cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
    else:
        cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
        + cvt + " $0, lo; " + cvt + " $1, hi; }",
        "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _attend_tile(q, k_head, v_head, BT, b, n0, end, qpos, d_ok, d, m_i, l_i, acc, acc2, qk_mul, cap_mul, slope,
                 win_left, win_right, s_kb, s_kn, s_vb, s_vn, s_btb,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
                 CAUSAL: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                 WINDOW: tl.constexpr, KV_FP8: tl.constexpr, V_PAIRS: tl.constexpr, E5M2: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HOIST_ROWS: tl.constexpr):
    """One key tile [n0, min(n0 + BLOCK_N, end)) of the online softmax (keys past end are never
    read); returns the updated (m, l, acc, acc2): with V_PAIRS acc holds the even columns and acc2 the
    odd ones, otherwise acc2 is an unused placeholder. Scores are in base 2 (qk_mul, cap_mul, slope
    carry LOG2E)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    if V_PAIRS and not UPCAST:  # V is read as int16 words: its row offsets in units of two bytes
        s_vb = s_vb // 2
        s_vn = s_vn // 2
    if PAGED:
        bt_row = BT + b.to(tl.int64) * s_btb
        if PAGE_ALIGNED and PAGE_SIZE <= BLOCK_N:  # n0 % PAGE_SIZE == 0: a row's place in its page is fixed
            j = tl.arange(0, BLOCK_N)
            page = tl.load(bt_row + n0 // PAGE_SIZE + j // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            in_page = (j % PAGE_SIZE).to(tl.int64)  # loop-invariant: hoisted out of the key loop
        elif PAGE_ALIGNED:  # n0 % BLOCK_N == 0 and BLOCK_N divides PAGE_SIZE: the tile lies in one page
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            in_page = (n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        else:
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            in_page = (offs_n % PAGE_SIZE).to(tl.int64)
        k_row = page * s_kb + in_page * s_kn
        v_row = page * s_vb + in_page * s_vn
    elif HOIST_ROWS:  # the tile's start as one scalar; j * stride is loop-invariant (hoisted)
        j = tl.arange(0, BLOCK_N).to(tl.int64)
        k_row = (b.to(tl.int64) * s_kb + n0.to(tl.int64) * s_kn) + j * s_kn
        v_row = (b.to(tl.int64) * s_vb + n0.to(tl.int64) * s_vn) + j * s_vn
    else:
        k_row = b.to(tl.int64) * s_kb + offs_n.to(tl.int64) * s_kn  # B * Lmax * Hkv * D may pass 2^31
        v_row = b.to(tl.int64) * s_vb + offs_n.to(tl.int64) * s_vn
    kv_ok = n_ok[:, None] & d_ok[None, :]  # columns past the head dim (padded to a power of 2): 0
    k = tl.load(k_head + k_row[:, None] + d[None, :], mask=kv_ok, other=0.0)
    if V_PAIRS and UPCAST:  # the interpreter has no inline asm: the same columns, split by a reshape
        v = tl.load(v_head + v_row[:, None] + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
        v, v2 = tl.split(v.reshape([BLOCK_N, BLOCK_D // 2, 2]))
    elif V_PAIRS:
        d2 = tl.arange(0, BLOCK_D // 2)
        w = tl.load(v_head.to(tl.pointer_type(tl.int16)) + v_row[:, None] + d2[None, :],
                    mask=n_ok[:, None] & (d2 < HEAD_DIM // 2)[None, :], other=0)
        v, v2 = _fp8_pairs(w, E5M2)
    else:
        v = tl.load(v_head + v_row[:, None] + d[None, :], mask=kv_ok, other=0.0)
        v2 = v
    if UPCAST or KV_FP8:  # fp8 K/V: converted in registers to q's dtype (fp16; fp32 in the interpreter)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_mul
    if SOFTCAP:  # qk_mul = scale / softcap, cap_mul = softcap * LOG2E
        s = _tanh(s) * cap_mul
    dist = offs_n[None, :] - qpos[:, None]  # key position - query position
    if ALIBI:
        s -= slope[:, None] * tl.abs(dist).to(tl.float32)
    ok = n_ok[None, :]
    if CAUSAL:
        ok = ok & (dist <= 0)
    if WINDOW:
        ok = ok & (dist >= -win_left) & (dist <= win_right)
    s = tl.where(ok, s, float("-inf"))
    # NaN scores (NaN in q or a used key): whether max keeps the NaN (interpreter) or drops it
    # (GPU maxnumf), p = exp2(NaN - m) is NaN, so l and acc turn NaN and stay NaN
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    if V_PAIRS:
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2)
    return m_new, l_i, acc, acc2


@triton.jit
def _merge_rows(O_PART, LSE_PART, O, LSE, p_rows, l_rows, n, s_ps, s_ls, o_rows, lse_rows, row_ok, d_ok, sink,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """Exact merge of n normalised partials of BLOCK_M rows (same math and NaN / empty rules as
    merge_kernel.py). Loads bypass L1 (.cg): the partials were written by other SMs."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.full((), 0, tl.int64)  # 64-bit: s * s_ps may pass 2^31
    while s < n:
        ls = tl.load(LSE_PART + s * s_ls + l_rows, mask=row_ok, other=float("-inf"),
                     cache_modifier=".cg")
        m = tl.maximum(m, tl.where(ls == float("inf"), float("-inf"), ls))
        s += 1
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    s = tl.full((), 0, tl.int64)
    while s < n:
        ls = tl.load(LSE_PART + s * s_ls + l_rows, mask=row_ok, other=float("-inf"),
                     cache_modifier=".cg")
        empty = (ls == float("-inf")) | (ls == float("inf"))  # weight exactly 0, o never read
        w = tl.where(empty, 0.0, tl.exp(ls - m_use))  # NaN lse -> NaN weight: propagates
        live = w != 0.0  # NaN != 0: a NaN partial is read and poisons the row, as it must
        o = tl.load(O_PART + s * s_ps + p_rows, mask=live[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        acc += tl.where(live[:, None], o * w[:, None], 0.0)
        den += w
        s += 1
    has = den != 0.0  # NaN passes; only a row with no live partial is 0 / -inf
    out = tl.where(has[:, None], acc / tl.where(has, den, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_use + tl.log(tl.where(has, den, 1.0)), float("-inf"))
    if SINKS:
        w, lse = with_sink(lse, sink)
        out = out * w[:, None]
    tl.store(O + o_rows, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + lse_rows, lse, mask=row_ok)


@triton.jit
def split_kernel(
    Q, K, V, SEQLENS, NSPLITS, CHUNKS, WORK, BT, O_PART, LSE_PART, O, LSE, COUNTERS, SINKS_PTR, ALIBI_PTR,
    KS_PTR, VS_PTR, qk_mul, cap_mul, v_mul, win_left, win_right, s_work,
    s_qb, s_qt, s_qh,
    s_kb, s_kn, s_kh,
    s_vb, s_vn, s_vh,
    s_btb,
    s_ps, s_pb, s_ph, s_pt,
    s_ls, s_lb, s_lh,
    s_ob, s_ot, s_oh,
    s_lob, s_loh,
    NUM_KV_HEADS: tl.constexpr, M_TILES: tl.constexpr, G: tl.constexpr, SQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    WINDOW: tl.constexpr, SINKS: tl.constexpr, KV_FP8: tl.constexpr, SCALE_PER_HEAD: tl.constexpr,
    HAS_WORK: tl.constexpr, V_PAIRS: tl.constexpr = False, E5M2: tl.constexpr = False,
    HOIST_ROWS: tl.constexpr = False,
):
    if HAS_WORK:  # grid (KV heads x m-tiles, work items): the item names the request and split
        group = tl.program_id(0)
        b = tl.load(WORK + tl.program_id(1))
        split = tl.load(WORK + s_work + tl.program_id(1))
        if b < 0:
            return
        pid = b * (M_TILES * NUM_KV_HEADS) + group
    else:  # grid (B x KV heads x m-tiles, max_splits)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // (M_TILES * NUM_KV_HEADS)
    mt = pid % M_TILES
    kvh = (pid // M_TILES) % NUM_KV_HEADS
    # the three per-request scalars are loaded together: one memory latency, not three in a row
    n_splits = tl.load(NSPLITS + b)
    seqlen = tl.load(SEQLENS + b)
    chunk = tl.load(CHUNKS + b)
    if split >= n_splits:
        return
    first = 0  # the first key any query of the request sees (splitkv.variants.first_key)
    if WINDOW:
        first = tl.maximum(seqlen - SQ - win_left, 0)
    start = first + split * chunk
    end = tl.minimum(start + chunk, seqlen)
    if split == n_splits - 1:
        end = seqlen

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < SQ * G
    tok = rows // G
    head = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # 64-bit offsets: cast every index before it meets a stride (the products may pass 2^31)
    b64 = b.to(tl.int64)
    tok64 = tok.to(tl.int64)
    head64 = head.to(tl.int64)
    q = tl.load(Q + b64 * s_qb + tok64[:, None] * s_qt + head64[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong (triton#11584): do it in fp32 there
        q = q.to(tl.float32)
    elif KV_FP8:  # fp8 K/V: both dots in fp16 (see the module docstring)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    qpos = seqlen - SQ + tok  # bottom-right causal: absolute position of each row's token
    slope = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope = tl.load(ALIBI_PTR + head, mask=row_ok, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if V_PAIRS:
        acc = tl.zeros([BLOCK_M, BLOCK_D // 2], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        acc2 = tl.zeros([BLOCK_M, 2], tl.float32)
    if SCALE_PER_HEAD:  # fp8 scales per KV head: this program's head's, folded into the score scale
        qk_mul = qk_mul * tl.load(KS_PTR + kvh)
        v_mul = v_mul * tl.load(VS_PTR + kvh)
    k_head = K + kvh.to(tl.int64) * s_kh  # (Hkv - 1) * s_kh passes 2^31 for [B, Hkv, L, D] storage
    v_head = V + kvh.to(tl.int64) * s_vh
    if UPCAST:  # interpreter: program ids are 1-element arrays, which `range` rejects
        n0 = start
        while n0 < end:
            m_i, l_i, acc, acc2 = _attend_tile(q, k_head, v_head, BT, b, n0, end, qpos, d_ok, d, m_i, l_i, acc, acc2,
                                               qk_mul, cap_mul, slope, win_left, win_right,
                                               s_kb, s_kn, s_vb, s_vn, s_btb, BLOCK_N, PAGE_SIZE, PAGED, PAGE_ALIGNED,
                                               CAUSAL, UPCAST, SOFTCAP, ALIBI, WINDOW, KV_FP8, V_PAIRS, E5M2,
                                               HEAD_DIM, BLOCK_D, HOIST_ROWS)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc, acc2 = _attend_tile(q, k_head, v_head, BT, b, n0, end, qpos, d_ok, d, m_i, l_i, acc, acc2,
                                               qk_mul, cap_mul, slope, win_left, win_right,
                                               s_kb, s_kn, s_vb, s_vn, s_btb, BLOCK_N, PAGE_SIZE, PAGED, PAGE_ALIGNED,
                                               CAUSAL, UPCAST, SOFTCAP, ALIBI, WINDOW, KV_FP8, V_PAIRS, E5M2,
                                               HEAD_DIM, BLOCK_D, HOIST_ROWS)

    # saw a key: l != 0 (l >= 1 after any finite score). NaN != 0, so a NaN row keeps o = NaN and
    # lse = NaN; only a row with no visible key (l == 0) is o = 0, lse = -inf
    if V_PAIRS:  # columns 2c (acc) and 2c + 1 (acc2) interleaved back
        acc = tl.join(acc, acc2).reshape([BLOCK_M, BLOCK_D])
    has_key = l_i != 0.0
    o = tl.where(has_key[:, None], acc / tl.where(has_key, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * LN2, float("-inf"))
    if KV_FP8:  # v_scale, applied once to the normalised output (it commutes with every merge)
        o = o * v_mul
    o_rows = b64 * s_ob + tok64[:, None] * s_ot + head64[:, None] * s_oh + d[None, :]
    lse_rows = b64 * s_lob + head64 * s_loh + tok64
    sink = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        sink = tl.load(SINKS_PTR + head, mask=row_ok, other=0.0)
    if n_splits == 1:
        if SINKS:  # the sink enters once per row: here, or where the splits are merged
            w, lse = with_sink(lse, sink)
            o = o * w[:, None]
        tl.store(O + o_rows, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + lse_rows, lse, mask=row_ok)
    else:
        p_rows = b64 * s_pb + head64[:, None] * s_ph + tok64[:, None] * s_pt + d[None, :]
        l_rows = b64 * s_lb + head64 * s_lh + tok64
        tl.store(O_PART + split.to(tl.int64) * s_ps + p_rows, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE_PART + split.to(tl.int64) * s_ls + l_rows, lse, mask=row_ok)
        if FUSED_MERGE:
            # the last split block of this (request, KV head, m-tile) to finish merges all of them,
            # saving the merge launch; the counter is reset by that block, so it is zero again
            # for the next launch or graph replay. Merge order = split index: deterministic.
            tl.debug_barrier()  # every thread's partial stores precede the release below
            arrived = tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel")
            if arrived == n_splits - 1:
                tl.atomic_xchg(COUNTERS + pid, 0)
                _merge_rows(O_PART, LSE_PART, O, LSE, p_rows, l_rows, n_splits, s_ps, s_ls,
                            o_rows, lse_rows, row_ok, d_ok, sink, BLOCK_M, BLOCK_D, SINKS)
