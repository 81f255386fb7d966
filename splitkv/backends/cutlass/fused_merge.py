"""Fused merge of the CuTe DSL split kernel: the last split CTA of each (request, KV head,
m-tile) to finish merges the tile's partials itself, so no merge kernel follows.

Arrival: every thread has stored its partials (epilogue.merge_and_store); fence.acq_rel.gpu and a
CTA barrier order those stores before thread 0's atom.acq_rel.gpu.add on the tile's counter
(plan.counters, int32 [B * Hkv * m_tiles], zero between launches). The CTA that reads
num_splits - 1 is last: it resets the counter to 0 (zero again for the next launch or graph
replay) and merges. The counter decides only which CTA merges, never the arithmetic.

Merge: the same items as the epilogue (row, 4 columns) spread over the CTA's threads, so the whole
CTA works (Triton's fused merge walks the splits of a row serially, one L2 round trip each, and
loses past 8 splits: heuristics.FUSED_MERGE_MAX_SPLITS). Each item walks the splits in groups of
SPLIT_GROUP with every load of a group issued before any is used, and rescales its running state between
groups (online softmax over splits). Split order is fixed: deterministic. Semantics as the merge
kernel: an empty partial (lse -inf, or +inf) weighs exactly 0 and contributes nothing (selected
away, so its o cannot leak NaN); a row whose every partial is empty gets o = 0, lse = -inf; a NaN
partial (NaN in q or a used key / value) makes the row's o and lse NaN (fmax drops the NaN from
the max, but its weight exp2(NaN) is NaN, and the tests are `!= 0`, which NaN passes). A call
with attention sinks joins each row's sink here, after the splits (epilogue.with_sink).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from splitkv.backends.cutlass.epilogue import VEC, tile_items
from splitkv.backends.cutlass.paging import gmem_vec
from splitkv.constants import LOG2E

SPLIT_GROUP = 8  # splits whose loads are in flight together per item


@dsl_user_op
def arrive(addr: Int64, *, loc=None, ip=None) -> Int32:
    """atom.acq_rel.gpu.global.add.u32 [addr], 1; returns the old value."""
    res = llvm.inline_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
                          "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", "=r,l",
                          has_side_effects=True, asm_dialect=0, loc=loc, ip=ip)
    return Int32(res)


@cute.jit
def is_last_arrival(counter: Int64, n_splits: Int32, sFlag, tidx: Int32):
    """All threads: True in the one CTA of the tile that arrives last (which resets the counter)."""
    cute.arch.fence_acq_rel_gpu()  # this thread's partial stores, before the barrier and the atomic
    cute.arch.barrier()
    if tidx == 0:
        old = arrive(counter)
        last = Int32(0)
        if old == n_splits - 1:
            last = Int32(1)
            gmem_vec(Int32, counter, 1, 4)[0] = Int32(0)
        sFlag[0] = last
    cute.arch.barrier()
    cute.arch.fence_acq_rel_gpu()  # the other CTAs' partials, after their release by the atomic
    return sFlag[0] != 0


@cute.jit
def merge_partials(outs, n_splits: Int32, tidx: Int32, row0: Int32, num_rows: Int32,
                   block_m: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    """Merge the n_splits partials of this tile's rows into the final o / lse (outs.single is True)."""
    sp, sl = outs.part_strides, outs.lpart_strides
    b = Int64(outs.b)
    for _row, col, p in tile_items(tidx, row0, block_m, head_dim):
        if p < num_rows:
            tok = p // outs.group
            head = Int64(outs.kvh * outs.group + p - tok * outs.group)
            l_row = outs.lpart_addr + (b * sl[1] + head * sl[2] + Int64(tok)) * 4
            o_row = outs.part_addr + (b * sp[1] + head * sp[2] + Int64(tok) * sp[3] + Int64(col)) * 4
            m_run = -Float32.inf
            total = Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            for s0 in cutlass.range(0, n_splits, SPLIT_GROUP, unroll=1):
                lv = cute.make_rmem_tensor((SPLIT_GROUP,), Float32)
                ov = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(SPLIT_GROUP)]
                for j in cutlass.range_constexpr(SPLIT_GROUP):
                    # past n_splits: re-read the last split (a valid address), selected away below
                    s = Int64(cutlass.min(s0 + j, n_splits - 1))
                    g = gmem_vec(Float32, l_row + s * sl[0] * 4, 1, 4)
                    l_s = g[0]
                    l_s = cutlass.select_(l_s == Float32.inf, -Float32.inf, l_s)  # +inf: empty too
                    lv[j] = cutlass.select_(s0 + j < n_splits, l_s, -Float32.inf)
                    ov[j].store(gmem_vec(Float32, o_row + s * sp[0] * 4, VEC, 4 * VEC).load())
                m_new = m_run
                for j in cutlass.range_constexpr(SPLIT_GROUP):
                    m_new = cute.arch.fmax(m_new, lv[j])
                m_use = 0.0 if m_new == -Float32.inf else m_new
                rescale = cute.math.exp2((m_run - m_use) * LOG2E, fastmath=True)  # m_run = -inf -> 0
                total = total * rescale
                for e in cutlass.range_constexpr(VEC):
                    acc[e] = acc[e] * rescale
                for j in cutlass.range_constexpr(SPLIT_GROUP):
                    w = cute.math.exp2((lv[j] - m_use) * LOG2E, fastmath=True)
                    total = total + w
                    live = w != 0.0  # unordered: a NaN weight is live (poisons the row), 0 is not
                    for e in cutlass.range_constexpr(VEC):
                        acc[e] = acc[e] + cutlass.select_(live, ov[j][e] * w, Float32(0.0))
                m_run = m_new
            has_key = total != 0.0  # NaN passes: a NaN row stays NaN; only no live partial is 0 / -inf
            inv = 1.0 / total if has_key else 0.0
            lse = (m_run + cute.math.log(total, fastmath=False)) if has_key else -Float32.inf
            w, lse = outs.sink_weight(p, lse)  # the row's sink, once, here where its splits meet
            outs.store(p, col, acc.load() * (inv * w), lse, col == 0)
