"""Attention-variant score code of the CuTe split kernel (the math is splitkv.variants'): logit
softcap, ALiBi and the sliding-window bounds, applied to one warp's raw scores S = Q K^T before the
online softmax multiplies them by scale_log2. Each piece is compiled in only when its SplitConfig
flag is on, so a plain kernel is the same code as before.

  * softcap: S <- tanh(S * pre_mul) with pre_mul = scale / softcap, and the launch passes
    scale_log2 = softcap * log2(e): the softmax then sees softcap * tanh(scale S / softcap) in base 2;
  * ALiBi: S <- S - slope_raw[r] * |key - pos[r]|, where slope_raw = slope * log2(e) / scale_log2 is
    the slope in raw-score units (so that after the softmax's multiply it is slope * |distance| in
    base 2, after the softcap as FlashAttention orders them);
  * window: row r sees keys pos[r] - left .. pos[r] + right (and, causal, .. pos[r]): the lower
    bound is one more per-row limit (row_low), the upper folds into the causal row_limit. The
    kernel starts a request at its first visible key (variants.first_key), so only the first tile
    of a split and the last need the mask.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from splitkv.backends.cutlass.layouts import mn_view
from splitkv.backends.cutlass.paging import gmem_vec
from splitkv.constants import LOG2E


@dataclass(frozen=True)
class RowBounds:
    """Per accumulator row of this thread: the key limit (exclusive), the window's first key, the
    row's position and ALiBi slope (raw-score units). Frozen: the register tensors are filled once."""

    limit: object  # rmem int32 [rows]
    low: object  # rmem int32 [rows] (window), else None
    pos: object  # rmem int32 [rows] (ALiBi), else None
    slope: object  # rmem fp32 [rows] (ALiBi), else None

    @staticmethod
    def create(rows: int, window: bool, alibi: bool):
        return RowBounds(cute.make_rmem_tensor((rows,), Int32),
                         cute.make_rmem_tensor((rows,), Int32) if window else None,
                         cute.make_rmem_tensor((rows,), Int32) if alibi else None,
                         cute.make_rmem_tensor((rows,), Float32) if alibi else None)

    @cute.jit
    def fill(self, r: cutlass.Constexpr, p: Int32, group: Int32, kvh: Int32, seqlen: Int32, q_len: Int32,
             end: Int32, causal: Int32, win_left: Int32, win_right: Int32, alibi: Int64, scale_log2: Float32):
        """Row r of this thread is packed row p: token p // group of query head kvh * group + p % group."""
        tok = p // group
        pos = seqlen - q_len + tok
        lim = end
        if causal != 0:
            lim = cutlass.min(lim, pos + 1)
        if cutlass.const_expr(self.low is not None):
            lim = cutlass.min(lim, pos + win_right + 1)
            self.low[r] = pos - win_left
        self.limit[r] = lim
        if cutlass.const_expr(self.pos is not None):
            head = kvh * group + p - tok * group
            self.pos[r] = pos
            self.slope[r] = gmem_vec(Float32, alibi + Int64(head) * 4, 1, 4)[0] * (LOG2E / scale_log2)


@cute.jit
def apply(acc_s, s_coords, key0: Int32, rows: RowBounds, softcap: cutlass.Constexpr, pre_mul: Float32):
    """Softcap and ALiBi on one warp's raw scores of keys key0 + column (before any mask)."""
    s_mn = mn_view(acc_s)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        if cutlass.const_expr(softcap):
            s_mn[r, None] = cute.math.tanh(s_mn[r, None].load() * pre_mul, fastmath=False)
        if cutlass.const_expr(rows.pos is not None):
            base = key0 - rows.pos[r]
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                d = base + s_coords[r, c][1]
                s_mn[r, c] = s_mn[r, c] - rows.slope[r] * Float32(cutlass.max(d, -d))


@cute.jit
def mask(acc_s, s_coords, key0: Int32, rows: RowBounds):
    """-inf where key0 + column >= limit[r], or (window) < low[r]."""
    s_mn = mn_view(acc_s)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        lim = rows.limit[r] - key0
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            if s_coords[r, c][1] >= lim:
                s_mn[r, c] = -Float32.inf
        if cutlass.const_expr(rows.low is not None):
            low = rows.low[r] - key0
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if s_coords[r, c][1] < low:
                    s_mn[r, c] = -Float32.inf
