"""Online softmax of one warp over its keys, base 2 (scores pre-multiplied by scale * log2 e).

State per accumulator row: m (running max of scaled scores, -inf before any unmasked key) and
l (this thread's share of the running sum; the 4 threads of a quad hold one row, l is summed
over the quad only in the epilogue, because every rescale factor is quad-uniform).

A row that has seen no key keeps m = -inf: exponents then use m_use = 0, so exp2(-inf - 0) = 0
and nothing is NaN; its l stays 0, which the epilogue turns into o = 0, lse = -inf.
NaN scores (NaN in q or in a used key) propagate: fmax drops a NaN (m stays the max of the other
scores, or -inf), but p = exp2(NaN - m_use) is NaN, so l and the row of O turn NaN and stay NaN;
the epilogue's "saw a key" test is l != 0, which NaN passes, so o and lse come out NaN.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from splitkv.backends.cutlass.layouts import mn_view


def quad_allreduce(val, op):
    """op-reduce val over the 4 lanes of a quad (the lanes that share an mma accumulator row)."""
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2, mask=-1, mask_and_clamp=31))
    return op(val, cute.arch.shuffle_sync_bfly(val, offset=1, mask=-1, mask_and_clamp=31))


def _fmax(a, b):
    return cute.arch.fmax(a, b)


def _add(a, b):
    return a + b


@dataclass(frozen=True)
class OnlineSoftmax:
    """Per-thread state for its accumulator rows (frozen: read-only to the DSL's control flow;
    the register tensors inside are updated in place)."""

    row_max: object  # rmem fp32 [rows]
    row_sum: object  # rmem fp32 [rows]
    scale_log2: Float32

    @staticmethod
    def create(num_rows: int, scale_log2: Float32):
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(row_max, row_sum, scale_log2)

    @cute.jit
    def update(self, acc_s, acc_o):
        """acc_s (masked raw scores, -inf = masked) -> probabilities p in place; rescale acc_o."""
        s_mn = mn_view(acc_s)
        o_mn = mn_view(acc_o)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_mn[r, None].load() * self.scale_log2
            m_tile = quad_allreduce(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), _fmax)
            m_prev = self.row_max[r]
            m_new = cute.arch.fmax(m_prev, m_tile)
            m_use = 0.0 if m_new == -Float32.inf else m_new
            p = cute.math.exp2(row - m_use, fastmath=True)
            alpha = cute.math.exp2(m_prev - m_use, fastmath=True)
            self.row_sum[r] = self.row_sum[r] * alpha + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            self.row_max[r] = m_new
            o_mn[r, None] = o_mn[r, None].load() * alpha
            s_mn[r, None] = p

    @cute.jit
    def finalize(self):
        """Sum l over each quad; after this every lane of the quad holds the row's (m, l)."""
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            self.row_sum[r] = quad_allreduce(self.row_sum[r], _add)
