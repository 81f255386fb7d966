"""Triton combine kernel: one program = one output row (request b, query head h, token t).

Math (exact merge of normalised partial states, natural-log LSE):
    m = max_i lse_i;  w_i = exp(lse_i - m);  o = sum_i w_i o_i / sum_i w_i;  lse = m + log sum_i w_i
Only the first NSPLITS[b] partials of the row are read; a -inf partial weighs 0 and its o_i is
never used (it may hold anything, NaN included); a row whose every partial is -inf gives o = 0,
lse = -inf. With SKIP_SINGLE, rows of requests with one split are left alone (the split kernel
already wrote them).

Layouts: o_part [S, B, H, T, D] (any float dtype, unit stride on D), lse_part [S, B, H, T] fp32,
out [B, T, H, D], lse [B, H, T]; strides are arguments, so merge_states feeds partials from
anywhere (another kernel, another GPU). Deterministic: splits are summed in index order.
"""

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
    O_PART, LSE_PART, NSPLITS, O, LSE, max_splits,
    s_ps, s_pb, s_ph, s_pt,
    s_ls, s_lb, s_lh, s_lt,
    s_ob, s_ot, s_oh,
    s_lob, s_loh, s_lot,
    NUM_HEADS: tl.constexpr, T: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
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
    lse_row = LSE_PART + b * s_lb + h * s_lh + t * s_lt
    o_row = O_PART + b * s_pb + h * s_ph + t * s_pt
    d = tl.arange(0, HEAD_DIM)

    # while, not range: the loop is short and runs the same under TRITON_INTERPRET (where a
    # loaded scalar is a 1-element array that `range` rejects)
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    s0 = 0
    while s0 < n:
        ls = tl.load(lse_row + (s0 + offs) * s_ls, mask=s0 + offs < n, other=float("-inf"))
        m = tl.maximum(m, ls)
        s0 += BLOCK_S
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)

    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    s0 = 0
    while s0 < n:
        ok = s0 + offs < n
        ls = tl.load(lse_row + (s0 + offs) * s_ls, mask=ok, other=float("-inf"))
        w = tl.exp(ls - m_use)
        live = w > 0.0
        o = tl.load(o_row + (s0 + offs)[:, None] * s_ps + d[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(tl.where(live[:, None], o.to(tl.float32) * w[:, None], 0.0), 0)
        den += w
        s0 += BLOCK_S
    total = tl.sum(den, 0)
    o_out = tl.where(total > 0.0, acc / tl.where(total > 0.0, total, 1.0), 0.0)
    lse_out = tl.where(total > 0.0, m_use + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(O + b * s_ob + t * s_ot + h * s_oh + d, o_out.to(O.dtype.element_ty))
    tl.store(LSE + b * s_lob + h * s_loh + t * s_lot, lse_out)
