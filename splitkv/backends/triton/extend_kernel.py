"""Triton kernel of splitkv.extend.attend_new_keys: one program = one output row (request b,
query head h, token t) attends the step's own Sq keys and folds them into the row's state.

Math (fp32, natural-log LSE): s_j = scale * q_t . k_j over the new keys j the row sees (j <= t
when causal: bottom-right, the new tokens are the last Sq positions; all Sq otherwise);
lse_n = logsumexp_j s_j, o_n = softmax_j(s) @ V. Then the exact merge with the old state (o, lse)
over the cached keys: an old lse of -inf or +inf is empty (weight 0, its o never read), a NaN
lse or NaN score propagates. Reads o / lse and writes the merged row to out / lse_out (which
may be the same tensors: each program reads its row before writing it).

Layouts: q, o, out [B, T, Hq, D]; new_k / new_v [B, T, Hkv, D]; lse, lse_out [B, Hq, T] fp32;
any strides with unit stride on D. D is padded to BLOCK_D (power of 2) and masked; offsets 64-bit.
"""

import triton
import triton.language as tl


@triton.jit
def extend_kernel(
    Q, K, V, O, LSE, OUT, LSE_OUT, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh, s_lb, s_lh,
    s_xb, s_xt, s_xh, s_yb, s_yh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid % T
    h = (pid // T) % NUM_HEADS
    b = (pid // (T * NUM_HEADS)).to(tl.int64)
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    kvh = (h // GROUP).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    j = tl.arange(0, BLOCK_T)
    seen = j <= t if CAUSAL else j < T

    q = tl.load(Q + b * s_qb + t64 * s_qt + h64 * s_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    kv_mask = seen[:, None] & d_ok[None, :]
    k = tl.load(K + b * s_kb + j[:, None].to(tl.int64) * s_kt + kvh * s_kh + d[None, :], mask=kv_mask,
                other=0.0).to(tl.float32)
    s = tl.where(seen, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
    m_n = tl.max(s, 0)  # finite unless q or k holds NaN / inf: key j = t is always seen
    p = tl.exp(s - m_n)
    l_n = tl.sum(p, 0)
    v = tl.load(V + b * s_vb + j[:, None].to(tl.int64) * s_vt + kvh * s_vh + d[None, :], mask=kv_mask,
                other=0.0).to(tl.float32)
    o_n = tl.sum(p[:, None] * v, 0) / l_n
    lse_n = m_n + tl.log(l_n)

    lse_o = tl.load(LSE + b * s_lb + h64 * s_lh + t64)
    empty = (lse_o == float("-inf")) | (lse_o == float("inf"))
    lse_a = tl.where(empty, float("-inf"), lse_o)
    m = tl.maximum(lse_a, lse_n)
    w_a = tl.where(empty, 0.0, tl.exp(lse_a - m))  # NaN stays NaN
    w_n = tl.exp(lse_n - m)
    o_a = tl.load(O + b * s_ob + t64 * s_ot + h64 * s_oh + d, mask=d_ok, other=0.0).to(tl.float32)
    total = w_a + w_n
    o_out = (tl.where(w_a != 0.0, w_a * o_a, 0.0) + w_n * o_n) / total  # an empty state's o may be NaN
    tl.store(OUT + b * s_xb + t64 * s_xt + h64 * s_xh + d, o_out.to(OUT.dtype.element_ty), mask=d_ok)
    tl.store(LSE_OUT + b * s_yb + h64 * s_yh + t64, m + tl.log(total))
