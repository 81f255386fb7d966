"""fp8 K/V in the CuTe split kernel: the stages hold the cache's bytes, converted per tile into fp16.

A K/V row of D fp8 values is moved as D / 2 16-bit "pairs": the cp.async path, the swizzled smem
layout and the row addressing are the 16-bit ones (layouts.py, paging.py) at half the width. After
a tile lands, each thread converts the 16-byte chunks it copied itself (cvt.rn.f16x2.e4m3x2 /
e5m2x2: one instruction per two values) into one fp16 [block_n, D] K tile and V tile, which the
fp16 MMAs read as they read a bf16 stage (mainloop.py). Queries are fp16 in shared memory too: a
bf16 query tile is converted on its way in (load_q_tile_f16). Why fp16, not bf16: e4m3 -> bf16 is
three conversions per two values on sm_90 (via fp16 and fp32), e4m3 -> fp16 one, and the Triton
kernel measured the difference (heuristics.tile_config, NOTES #18). Scales: k_scale folds into
the softmax scale, v_scale multiplies the output once (split_kernel.py).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Int16, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import dsl_user_op

from splitkv.backends.cutlass.config import ELEMS_PER_COPY

_CVT = {"e4m3": "cvt.rn.f16x2.e4m3x2 $0, $1;", "e5m2": "cvt.rn.f16x2.e5m2x2 $0, $1;"}


@dsl_user_op
def pair_to_f16x2(pair, fmt: str, *, loc=None, ip=None):
    """Two fp8 values (the bytes of a 16-bit `pair`, low byte first) -> (lo, hi) Float16."""
    bits = llvm.bitcast(Int16.mlir_type, pair.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    packed = llvm.inline_asm(Int32.mlir_type, [bits], _CVT[fmt], "=r,h")
    halves = llvm.bitcast(ir.VectorType.get([2], Float16.mlir_type, loc=loc), packed, loc=loc, ip=ip)
    lo = vector.extract(halves, dynamic_position=[], static_position=[0], loc=loc, ip=ip)
    hi = vector.extract(halves, dynamic_position=[], static_position=[1], loc=loc, ip=ip)
    return Float16(lo), Float16(hi)


@cute.jit
def convert_chunks(tXs8, tXcX, s16, fmt: cutlass.Constexpr):
    """This thread's chunks of one landed fp8 stage (tXs8: its cp.async partition of the pair
    view, tXcX: the pair coordinates) -> the same rows and columns of the fp16 tile s16. A rolled
    loop over rows: unrolled, the conversions' registers spilled next to D 256's accumulator."""
    for m in cutlass.range(cute.size(tXs8, mode=[1]), unroll=1):
        for k in cutlass.range_constexpr(cute.size(tXs8, mode=[2])):
            pairs = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), Float16)
            cute.autovec_copy(tXs8[None, m, k], pairs)
            vals = cute.make_rmem_tensor(cute.make_layout(2 * ELEMS_PER_COPY), Float16)
            for i in cutlass.range_constexpr(ELEMS_PER_COPY):
                lo, hi = pair_to_f16x2(pairs[i], fmt)
                vals[2 * i] = lo
                vals[2 * i + 1] = hi
            row, col = tXcX[0, m, k]  # in pairs: fp16 columns 2 col .. 2 col + 15 (16-aligned)
            cute.autovec_copy(vals, cute.local_tile(s16[row, None], (2 * ELEMS_PER_COPY,), (col // ELEMS_PER_COPY,)))


@cute.jit
def load_q_tile_f16(dtype, q_addr: Int64, q_strides, tQsQ, tQcQ, row0: Int32, num_rows: Int32, group: Int32,
                    b: Int32, kvh: Int32):
    """paging.load_q_tile for an fp16 query tile from a bf16 q: plain loads, converted in registers,
    stored to shared memory (visible after the next barrier)."""
    for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
        p = row0 + tQcQ[0, m, 0][0]
        if p < num_rows:
            tok = p // group
            head = kvh * group + p - tok * group
            addr = q_addr + (Int64(b) * q_strides[0] + Int64(tok) * q_strides[1] + Int64(head) * q_strides[2]) * 2
            for k in cutlass.range_constexpr(cute.size(tQsQ, mode=[2])):
                col = tQcQ[0, m, k][1]
                src = cute.make_tensor(cute.make_ptr(dtype, addr + Int64(col) * 2, cute.AddressSpace.gmem,
                                                     assumed_align=2 * ELEMS_PER_COPY),
                                       cute.make_layout(ELEMS_PER_COPY))
                raw = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), dtype)
                cute.autovec_copy(src, raw)
                half = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), Float16)
                half.store(raw.load().to(Float16))
                cute.autovec_copy(half, tQsQ[None, m, k])
        else:
            tQsQ[None, m, None].fill(0)
