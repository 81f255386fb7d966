"""Epilogue of the split kernel: merge the warps' softmax states of each row, normalise, store.

Each warp leaves an unnormalised fp32 output O_w [16, D] and per row (m_w, l_w) (base-2 max and
sum over its keys). For a row with warps w = 0 .. warps_n - 1 (in index order: deterministic):
    m = max_w m_w;  a_w = exp2(m_w - m);  L = sum_w a_w l_w;  o = sum_w a_w O_w / L
    lse = (m + log2 L) * ln 2        (natural log, as the API and the partials use)
L == 0 (no key seen) gives o = 0, lse = -inf; L = NaN (NaN in q or a used key / value) passes the
"saw a key" test L != 0 (unordered compare), so o and lse come out NaN, never 0 / -inf.
A request with one split writes o (input dtype) and lse straight to the outputs (joined first by
the row's attention sink, when the call has sinks: splitkv.variants); otherwise o_part
[S, B, Hq, Sq, D] and lse_part [S, B, Hq, Sq] fp32, without the sink (the merge adds it once).
The scratch rows are the padded head dim wide (the accumulator's); items cover the real D only.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from splitkv.backends.cutlass.config import NUM_THREADS
from splitkv.backends.cutlass.paging import gmem_vec
from splitkv.constants import LN2, LOG2E

VEC = 4  # fp32 values per thread per store: 16-byte partial stores, 8-byte fp16/bf16 stores


def scratch_layouts(block_m: int, head_dim: int, warps_n: int):
    """fp32 [block_m, D, warps_n] outputs (rows padded by 4 floats against bank conflicts, still
    16-byte aligned) and [warps_n, block_m] row max / row sum."""
    pitch = head_dim + VEC
    red = cute.make_layout((block_m, head_dim, warps_n), stride=(pitch, 1, block_m * pitch))
    stats = cute.make_layout((warps_n, block_m), stride=(block_m, 1))
    return red, stats


@cute.jit
def stash_warp_state(wa, sm, sRed_w, sMax, sSum, wn: Int32, row_base: Int32, lane: Int32):
    """Write this warp's O_w (fp32) and its rows' (m, l) to shared memory."""
    wa.thr_mma.partition_C(sRed_w).store(wa.acc_o.load())
    if lane % 4 == 0:
        for r in cutlass.range_constexpr(cute.size(sm.row_max)):
            row = row_base + wa.o_coords[r, 0][0]
            sMax[wn, row] = sm.row_max[r]
            sSum[wn, row] = sm.row_sum[r]


@dataclass(frozen=True)
class Outputs:
    """Where row p of the tile goes: token p // group, query head kvh * group + p % group."""

    out_dtype: type
    single: object  # Boolean: this request has one split -> final o / lse, else partials
    b: Int32
    kvh: Int32
    split: Int32
    group: Int32
    out_addr: Int64
    out_strides: tuple
    lse_addr: Int64
    lse_strides: tuple
    part_addr: Int64
    part_strides: tuple
    lpart_addr: Int64
    lpart_strides: tuple
    sinks: Int64  # float32 [Hq] attention-sink logits, or 0 (none)

    @cute.jit
    def head_of(self, p: Int32):
        tok = p // self.group
        return self.kvh * self.group + p - tok * self.group

    @cute.jit
    def sink_weight(self, p: Int32, lse: Float32):
        """(w, lse') of a final row: joined by its head's sink when the call has sinks, else (1, lse)."""
        w = Float32(1.0)
        if self.sinks != 0:
            w, lse = with_sink(lse, gmem_vec(Float32, self.sinks + Int64(self.head_of(p)) * 4, 1, 4)[0])
        return w, lse

    @cute.jit
    def store(self, p: Int32, col: Int32, o, lse: Float32, write_lse):
        tok = p // self.group
        head = self.kvh * self.group + p - tok * self.group
        b = Int64(self.b)
        if self.single:
            so = self.out_strides
            addr = self.out_addr + (b * so[0] + Int64(tok) * so[1] + Int64(head) * so[2] + Int64(col)) * (
                self.out_dtype.width // 8)
            gmem_vec(self.out_dtype, addr, VEC, VEC * self.out_dtype.width // 8).store(o.to(self.out_dtype))
            if write_lse:
                sl = self.lse_strides
                # (a named tensor: the DSL's region analysis treats call()[i] = x as writing every name in call)
                g_lse = gmem_vec(Float32, self.lse_addr + (b * sl[0] + Int64(head) * sl[1] + Int64(tok)) * 4, 1, 4)
                g_lse[0] = lse
        else:
            sp = self.part_strides
            s = Int64(self.split)
            addr = self.part_addr + (s * sp[0] + b * sp[1] + Int64(head) * sp[2] + Int64(tok) * sp[3]
                                     + Int64(col)) * 4
            gmem_vec(Float32, addr, VEC, 4 * VEC).store(o)
            if write_lse:
                sl = self.lpart_strides
                g_lse = gmem_vec(Float32, self.lpart_addr + (s * sl[0] + b * sl[1] + Int64(head) * sl[2]
                                                             + Int64(tok)) * 4, 1, 4)
                g_lse[0] = lse


@cute.jit
def with_sink(lse: Float32, sink: Float32):
    """(w, lse') for a finished row joined by one more softmax term exp(sink) with no value (natural
    log): lse' = log(exp(lse) + exp(sink)), o' = w o with w = exp(lse - lse'). No key (lse = -inf):
    o stays 0, lse' = sink; sink = -inf changes nothing; sink = +inf takes the whole row (o = 0,
    lse' = +inf); NaN propagates (fmax drops it, exp2 keeps it)."""
    lse, sink = Float32(lse), Float32(sink)
    m = Float32(cute.arch.fmax(lse, sink))
    none = m == -Float32.inf
    big = m == Float32.inf  # m_use 0: exp2(inf) = inf, never inf - inf
    m_use = Float32(0.0 if none else (0.0 if big else m))
    both = Float32(cute.math.exp2(Float32((lse - m_use) * LOG2E), fastmath=True)
                   + cute.math.exp2(Float32((sink - m_use) * LOG2E), fastmath=True))
    total = Float32(-Float32.inf if none else m_use + cute.math.log(both, fastmath=False))
    w = Float32(1.0 if none else cute.math.exp2(Float32((lse - total) * LOG2E), fastmath=True))
    return w, total


def tile_items(tidx: Int32, row0: Int32, block_m: int, head_dim: int):
    """This thread's (row in tile, first column, packed row p) items: the tile's block_m x (D / VEC)
    items of VEC columns, spread over the CTA's threads (a trace-time generator: the loop unrolls,
    each item's index math emitted just before its body). When the items do not fill the last round
    (D 80 / 96), the threads past the end get p = 2^30, which no `p < num_rows` test passes."""
    chunks = head_dim // VEC
    total = block_m * chunks
    for i in range((total + NUM_THREADS - 1) // NUM_THREADS):
        idx = tidx + NUM_THREADS * i
        row = idx // chunks
        p = row0 + row
        if (i + 1) * NUM_THREADS > total:
            p = cutlass.select_(idx < total, p, Int32(1 << 30))
        yield row, (idx - row * chunks) * VEC, p


@cute.jit
def merge_and_store(sRed, sMax, sSum, outs: Outputs, tidx: Int32, row0: Int32, num_rows: Int32,
                    block_m: cutlass.Constexpr, head_dim: cutlass.Constexpr, warps_n: cutlass.Constexpr):
    """All threads: rows x (D / 4) items, each merging the warps_n partial states of 4 columns."""
    for row, col, p in tile_items(tidx, row0, block_m, head_dim):
        if p < num_rows:
            m = sMax[0, row]
            for w in cutlass.range_constexpr(1, warps_n):
                m = cute.arch.fmax(m, sMax[w, row])
            m_use = 0.0 if m == -Float32.inf else m
            total = Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            for w in cutlass.range_constexpr(warps_n):
                a = cute.math.exp2(sMax[w, row] - m_use, fastmath=True)
                total = total + a * sSum[w, row]
                part = cute.local_tile(sRed[row, None, w], (VEC,), (col // VEC,))
                acc.store(acc.load() + part.load() * a)
            has_key = total != 0.0  # unordered: NaN passes, so a NaN row stays NaN
            inv = 1.0 / total if has_key else 0.0
            lse = (m_use + cute.math.log2(total, fastmath=False)) * LN2 if has_key else -Float32.inf
            w = Float32(1.0)
            if outs.single:
                w, lse = outs.sink_weight(p, lse)
            outs.store(p, col, acc.load() * (inv * w), lse, col == 0)
