"""CuTe DSL merge kernel: one warp = one output row (request b, query head h, token t); 4 rows
per CTA.

Math (exact merge of normalised partial states, natural-log LSE):
    m = max_i lse_i;  w_i = exp(lse_i - m);  o = sum_i w_i o_i / sum_i w_i;  lse = m + log sum_i w_i
Only the first num_splits[b] partials of the row are read (capped at the partials' split axis);
an empty partial (lse -inf, or +inf: FlashAttention's value for a row with no key) has w_i = 0
and never enters the sum (selected away, so a NaN in its o_i cannot leak); a row whose every
partial is empty gives o = 0, lse = -inf. A NaN lse_i propagates: fmax drops it from the max, but
its weight exp2(NaN) is NaN and the tests are `!= 0` (unordered), so o and lse come out NaN. With skip_single,
rows of requests with one split are left alone (the split kernel wrote them already). With sinks
(a float32 [H] pointer, 0 = none) each row's softmax takes one more term exp(sinks[h]) with no
value (splitkv.variants), once, after the splits (epilogue.with_sink).

Each lane owns elems_per_lane contiguous columns (a power of 2: D / 32 rounded up; at D 80, 96 and
192 the lanes past D / elems_per_lane hold none, and only join the shuffles). Lane j loads the
LSE of split j once, for the max and the weight (a second load only past 32 splits). Splits go
in groups of 32: lane j computes the weight of split s0 + j, then the warp walks the group in
split order, broadcasting each weight by shuffle, with the group's o loads unrolled so they are
all in flight together. Deterministic: splits are added in index order.

Layouts: o_part [S, B, H, T, D] (fp32, fp16 or bf16; unit stride on D), lse_part [S, B, H, T] fp32,
out [B, T, H, D], lse [B, H, T]: all strides are arguments, so merge_states can feed partials from
anywhere.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from splitkv.backends.cutlass.config import MergeConfig
from splitkv.backends.cutlass.epilogue import with_sink
from splitkv.backends.cutlass.paging import gmem_vec
from splitkv.constants import LOG2E

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, "float32": Float32}

ROWS_PER_CTA = 4
SPLIT_GROUP = 32  # splits per weight group: one per lane


def empty_as_neg_inf(lse):
    """+inf (a row with no key, as FlashAttention writes it) is empty, like -inf."""
    return cutlass.select_(lse == Float32.inf, -Float32.inf, lse)


def warp_allreduce_max(val):
    for off in (16, 8, 4, 2, 1):
        val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=off, mask=-1, mask_and_clamp=31))
    return val


class MergeKernel:
    def __init__(self, cfg: MergeConfig):
        self.cfg = cfg
        self.part_dtype = DTYPES[cfg.part_dtype]
        self.out_dtype = DTYPES[cfg.out_dtype]

    def __repr__(self):  # the DSL mangles the repr into the kernel's symbol: keep it stable
        return self.cfg.name

    @cute.jit
    def __call__(self, o_part: Int64, lse_part: Int64, nsplits: Int64, out: Int64, lse: Int64, sinks: Int64,
                 max_splits: Int32, batch: Int32, num_heads: Int32, q_len: Int32, skip_single: Int32,
                 s_ps: Int64, s_pb: Int64, s_ph: Int64, s_pt: Int64,
                 s_ls: Int64, s_lb: Int64, s_lh: Int64, s_lt: Int64,
                 s_ob: Int64, s_ot: Int64, s_oh: Int64, s_lob: Int64, s_loh: Int64, s_lot: Int64,
                 stream: cuda.CUstream):
        rows = batch * num_heads * q_len
        self.kernel(o_part, lse_part, nsplits, out, lse, sinks, max_splits, num_heads, q_len, rows, skip_single,
                    (s_ps, s_pb, s_ph, s_pt), (s_ls, s_lb, s_lh, s_lt), (s_ob, s_ot, s_oh), (s_lob, s_loh, s_lot),
                    ).launch(grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1],
                             block=[32 * ROWS_PER_CTA, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, o_part: Int64, lse_part: Int64, nsplits: Int64, out: Int64, lse: Int64, sinks: Int64,
               max_splits: Int32, num_heads: Int32, q_len: Int32, rows: Int32, skip_single: Int32,
               part_strides, lpart_strides, out_strides, lse_strides):
        EPL = self.cfg.elems_per_lane
        ACTIVE = self.cfg.active_lanes
        pbytes = self.part_dtype.width // 8
        obytes = self.out_dtype.width // 8
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        col = cutlass.min(lane, ACTIVE - 1) * EPL  # idle lanes (lane >= ACTIVE) re-read a valid column
        row = bid * ROWS_PER_CTA + warp
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the split grid's partials are visible after this
            cute.arch.griddepcontrol_launch_dependents()
        if row < rows:
            t = row % q_len
            h = (row // q_len) % num_heads
            b = row // (q_len * num_heads)
            n_splits = gmem_vec(Int32, nsplits + Int64(b) * 4, 1, 4)[0]
            if skip_single == 0 or n_splits != 1:
                n = cutlass.min(n_splits, max_splits)
                sl = lpart_strides
                lse_row = lse_part + (Int64(b) * sl[1] + Int64(h) * sl[2] + Int64(t) * sl[3]) * 4
                sp = part_strides
                o_row = o_part + (Int64(b) * sp[1] + Int64(h) * sp[2] + Int64(t) * sp[3]
                                  + Int64(col)) * pbytes

                # lane j keeps the LSE of split j: with <= 32 splits the weights need no second load
                l_first = -Float32.inf
                if lane < n:
                    l_first = empty_as_neg_inf(gmem_vec(Float32, lse_row + Int64(lane) * sl[0] * 4, 1, 4)[0])
                m = l_first
                for s in cutlass.range(lane + 32, n, 32, unroll=1):
                    g = gmem_vec(Float32, lse_row + Int64(s) * sl[0] * 4, 1, 4)
                    m = cute.arch.fmax(m, empty_as_neg_inf(g[0]))
                m = warp_allreduce_max(m)
                m_use = 0.0 if m == -Float32.inf else m

                total = Float32(0.0)
                acc = cute.make_rmem_tensor((EPL,), Float32)
                acc.fill(0.0)
                for s0 in cutlass.range(0, n, SPLIT_GROUP, unroll=1):
                    mine = s0 + lane
                    l_mine = l_first
                    if s0 > 0:
                        l_mine = -Float32.inf
                        if mine < n:
                            l_mine = empty_as_neg_inf(gmem_vec(Float32, lse_row + Int64(mine) * sl[0] * 4, 1, 4)[0])
                    w_mine = Float32(0.0)
                    if l_mine != -Float32.inf:  # unordered: a NaN lse gets a NaN weight
                        w_mine = cute.math.exp2((l_mine - m_use) * LOG2E, fastmath=True)
                    for j in cutlass.range_constexpr(SPLIT_GROUP):
                        w = cute.arch.shuffle_sync(w_mine, j)
                        # splits past n are in the workspace (s < max_splits) but hold anything:
                        # read a valid address, and let w = 0 select them away
                        s = cutlass.min(s0 + j, max_splits - 1)
                        o = gmem_vec(self.part_dtype, o_row + Int64(s) * sp[0] * pbytes, EPL, min(16, EPL * pbytes))
                        val = cute.make_rmem_tensor((EPL,), Float32)
                        val.store(o.load().to(Float32))  # unconditional (no branch): the loads overlap
                        total = total + w
                        live = w != 0.0  # NaN is live (poisons the row); an empty split is not
                        for e in cutlass.range_constexpr(EPL):
                            acc[e] = acc[e] + cutlass.select_(live, val[e] * w, Float32(0.0))
                has_key = total != 0.0  # NaN passes: only a row with no live partial is 0 / -inf
                inv = 1.0 / total if has_key else 0.0
                lse_row_val = (m_use + cute.math.log(total, fastmath=False)) if has_key else -Float32.inf
                w = Float32(1.0)
                if sinks != 0:
                    w, lse_row_val = with_sink(lse_row_val, gmem_vec(Float32, sinks + Int64(h) * 4, 1, 4)[0])
                so = out_strides
                if lane < ACTIVE:
                    dst = gmem_vec(self.out_dtype, out + (Int64(b) * so[0] + Int64(t) * so[1] + Int64(h) * so[2]
                                                          + Int64(col)) * obytes, EPL, min(16, EPL * obytes))
                    dst.store((acc.load() * (inv * w)).to(self.out_dtype))
                if lane == 0:
                    so = lse_strides
                    g_lse = gmem_vec(Float32, lse + (Int64(b) * so[0] + Int64(h) * so[1] + Int64(t) * so[2]) * 4, 1, 4)
                    g_lse[0] = lse_row_val
