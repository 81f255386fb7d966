"""Triton merge kernel: one program = one output row (request b, query head h, token t).

Math (exact merge of normalised partial states, natural-log LSE):
    m = max_i lse_i;  w_i = exp(lse_i - m);  o = sum_i w_i o_i / sum_i w_i;  lse = m + log sum_i w_i
Only the first NSPLITS[b] partials of the row are read; an empty partial (lse_i = -inf, or +inf:
what FlashAttention returns for a row with no key) weighs exactly 0 and its o_i is never used (it
may hold anything, NaN included); a row whose every partial is empty gives o = 0, lse = -inf. A
NaN lse_i propagates: o and lse of the row are NaN (never mistaken for an empty row). With
SKIP_SINGLE, rows of requests with one split are left alone (the split kernel already wrote them).
With SINKS, each row's softmax takes one more term exp(sinks[h]) with no value (splitkv.variants).
D is padded to BLOCK_D (a power of 2); columns past D are masked.

Layouts: o_part [S, B, H, T, D] (any float dtype, unit stride on D), lse_part [S, B, H, T] fp32,
out [B, T, H, D], lse [B, H, T]; strides are arguments, so merge_states feeds partials from
anywhere (another kernel, another GPU). Deterministic: splits are summed in index order.
Offsets are 64-bit (indices cast before they meet a stride): a workspace may pass 2^31 elements.
"""

import triton
import triton.language as tl


@triton.jit
def with_sink(lse, sink):
    """(w, lse') for a finished softmax row joined by one more term, exp(sink), that has no value:
    lse' = log(exp(lse) + exp(sink)) and the row's o shrinks to w * o, w = exp(lse - lse'). A row
    with no key (lse = -inf) keeps o = 0 and gets lse' = sink; sink = -inf changes nothing; NaN
    propagates; sink = +inf takes the whole row (o = 0, lse' = +inf, as the reference). Elementwise:
    lse and sink are [M] or scalars."""
    m = tl.maximum(lse, sink)
    none = m == float("-inf")
    m_use = tl.where(none | (m == float("inf")), 0.0, m)  # +inf: exp(sink - 0) = inf, never inf - inf
    total = tl.where(none, float("-inf"), m_use + tl.log(tl.exp(lse - m_use) + tl.exp(sink - m_use)))
    return tl.where(none, 1.0, tl.exp(lse - total)), total


@triton.jit
def merge_kernel(
    O_PART, LSE_PART, NSPLITS, O, LSE, SINKS_PTR, max_splits,
    s_ps, s_pb, s_ph, s_pt,
    s_ls, s_lb, s_lh, s_lt,
    s_ob, s_ot, s_oh,
    s_lob, s_loh, s_lot,
    NUM_HEADS: tl.constexpr, T: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    SKIP_SINGLE: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid % T
    h = (pid // T) % NUM_HEADS
    b = pid // (T * NUM_HEADS)
    n = tl.load(NSPLITS + b)
    if SKIP_SINGLE and n == 1:
        return
    n = tl.minimum(n, max_splits)  # never read past the partials' split axis
    offs = tl.arange(0, BLOCK_S)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    t64 = t.to(tl.int64)
    lse_row = LSE_PART + b64 * s_lb + h64 * s_lh + t64 * s_lt
    o_row = O_PART + b64 * s_pb + h64 * s_ph + t64 * s_pt
    d = tl.arange(0, BLOCK_D)  # D padded to a power of 2; columns past D masked
    d_ok = d < HEAD_DIM

    # while, not range: the loop is short and runs the same under TRITON_INTERPRET (where a
    # loaded scalar is a 1-element array that `range` rejects)
    # +inf (FlashAttention's "no key") is empty like -inf. NaN: whether max keeps it or drops it
    # (GPU maxnumf), the NaN partial's weight below is NaN, so the row ends NaN
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    s0 = tl.full((), 0, tl.int64)  # 64-bit: split * s_ps may pass 2^31
    while s0 < n:
        ls = tl.load(lse_row + (s0 + offs) * s_ls, mask=s0 + offs < n, other=float("-inf"))
        m = tl.maximum(m, tl.where(ls == float("inf"), float("-inf"), ls))
        s0 += BLOCK_S
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)

    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    s0 = tl.full((), 0, tl.int64)
    while s0 < n:
        ok = s0 + offs < n
        ls = tl.load(lse_row + (s0 + offs) * s_ls, mask=ok, other=float("-inf"))
        empty = (ls == float("-inf")) | (ls == float("inf"))
        w = tl.where(empty, 0.0, tl.exp(ls - m_use))  # exactly 0 for an empty partial; NaN stays NaN
        live = w != 0.0  # NaN != 0: a NaN partial is read (and poisons the row), an empty one never
        o = tl.load(o_row + (s0 + offs)[:, None] * s_ps + d[None, :], mask=live[:, None] & d_ok[None, :],
                    other=0.0)
        acc += tl.sum(tl.where(live[:, None], o.to(tl.float32) * w[:, None], 0.0), 0)
        den += w
        s0 += BLOCK_S
    total = tl.sum(den, 0)
    has = total != 0.0  # NaN passes: only a row with no live partial is 0 / -inf
    o_out = tl.where(has, acc / tl.where(has, total, 1.0), 0.0)
    lse_out = tl.where(has, m_use + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    if SINKS:  # attention sinks: one more softmax term per row, joined once, here
        w, lse_out = with_sink(lse_out, tl.load(SINKS_PTR + h))
        o_out = o_out * w
    tl.store(O + b64 * s_ob + t64 * s_ot + h64 * s_oh + d, o_out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + b64 * s_lob + h64 * s_loh + t64 * s_lot, lse_out)
