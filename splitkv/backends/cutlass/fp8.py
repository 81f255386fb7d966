"""fp8 K/V in the CuTe split kernel: the stages hold the cache's bytes, converted in registers.

A K/V row of D fp8 values is moved as D / 2 16-bit "pairs": the cp.async path, the swizzled smem
layout and the row addressing are the 16-bit ones (layouts.py, paging.py) at half the width. The
MMAs run in fp16 (m16n8k16); their operands come from the fp8 stage by ldmatrix of the pairs and
one cvt.rn.f16x2.e4m3x2 (or e5m2x2) per two values, in registers:

  * K (B operand of S = Q K^T, rows = keys, k = D): ldmatrix of a pair tile gives a thread the 4
    consecutive fp8 columns 4a .. 4a + 3 (a = lane % 4) of a 16-column block, where the MMA wants
    columns 2a, 2a + 1, 2a + 8, 2a + 9. D is the reduction dimension, so any order of it is right
    as long as Q uses the same: Q is stored in shared memory with its columns permuted the same
    way (column d of a 16-block at MMA position q_position(d)), once per CTA.
  * V (B operand of O += P V, k = keys, n = D): ldmatrix.trans of a pair tile gives a thread the
    pairs of two consecutive keys at one pair column p; one byte permute (prmt) makes (key0, key1)
    of column 2p and of column 2p + 1, each one cvt. The MMA's output column 8 n_block + n then
    holds head dim column out_column(): the epilogue writes the accumulator through that map.
Queries are fp16 (a bf16 q is converted as it is loaded). Why fp16, not bf16: e4m3 -> bf16 is three
conversions per two values on sm_90 (via fp16 and fp32), e4m3 -> fp16 one (NOTES #18). Scales:
k_scale folds into the softmax scale, v_scale multiplies the output once (split_kernel.py).
The former design converted each landed tile in shared memory into an fp16 tile between two
barriers (NOTES #32, #53: 1.4x slower than Triton's fp8 path at B=1 GQA 128K).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int16, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import dsl_user_op

from splitkv.backends.cutlass import layouts
from splitkv.backends.cutlass.config import ELEMS_PER_COPY, MMA_M

_CVT = {"e4m3": "cvt.rn.f16x2.e4m3x2", "e5m2": "cvt.rn.f16x2.e5m2x2"}


def _halves(packed, loc, ip):
    halves = llvm.bitcast(ir.VectorType.get([2], Float16.mlir_type, loc=loc), packed, loc=loc, ip=ip)
    lo = vector.extract(halves, dynamic_position=[], static_position=[0], loc=loc, ip=ip)
    hi = vector.extract(halves, dynamic_position=[], static_position=[1], loc=loc, ip=ip)
    return Float16(lo), Float16(hi)


@dsl_user_op
def pair_to_f16x2(pair, fmt: str, *, loc=None, ip=None):
    """Two fp8 values (the bytes of a 16-bit `pair`, low byte first) -> (lo, hi) Float16."""
    bits = llvm.bitcast(Int16.mlir_type, pair.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    packed = llvm.inline_asm(Int32.mlir_type, [bits], f"{_CVT[fmt]} $0, $1;", "=r,h")
    return _halves(packed, loc, ip)


@dsl_user_op
def interleave_to_f16x2(pair0, pair1, odd: bool, fmt: str, *, loc=None, ip=None):
    """Pairs (a0, a1) and (b0, b1) of two keys -> (a0, b0) (odd False) or (a1, b1) as Float16."""
    x = [llvm.bitcast(Int16.mlir_type, p.ir_value(loc=loc, ip=ip), loc=loc, ip=ip) for p in (pair0, pair1)]
    sel = "0x0031" if odd else "0x0020"  # result bytes 0, 1 <- source bytes (1, 3) or (0, 2)
    asm = ("{ .reg .b32 t; .reg .b16 l, u; mov.b32 t, {$1, $2}; "
           f"prmt.b32 t, t, 0, {sel}; mov.b32 {{l, u}}, t; {_CVT[fmt]} $0, l; }}")
    packed = llvm.inline_asm(Int32.mlir_type, x, asm, "=r,h,h")
    return _halves(packed, loc, ip)


def q_position(d):
    """MMA position of Q's column d within its 16-column block (the order K's pairs arrive in)."""
    return 2 * (d // 4) + d % 2 + 8 * ((d % 4) // 2)


def out_columns(head_dim: int):
    """(16, D) -> (16, D) layout: accumulator column 16 c + 8 e + n holds head dim column
    16 c + 2 n + e (V's pairs split into even and odd columns); rows unchanged."""
    return cute.make_layout((MMA_M, (8, 2, head_dim // 16)), stride=(1, (2 * MMA_M, MMA_M, 16 * MMA_M)))


@cute.jit
def scores(wa, sK8_w, fmt: cutlass.Constexpr):
    """S [16, keys_per_warp] = Q_w K_w^T in fp32 from a [keys, D / 2] pair tile (the MMA order of
    mainloop.WarpAttention.scores: operands fetched one pair block (two k-blocks) ahead)."""
    tSrK8 = wa.thr_mma.make_fragment_B(wa.thr_mma.partition_B(sK8_w))  # ((2, 2), n blocks, D / 32)
    tSsK8 = wa.copy_k.partition_S(sK8_w)
    tSrK8_view = wa.copy_k.retile(tSrK8)
    tSrK = cute.make_rmem_tensor(wa.thr_mma.partition_shape_B((wa.keys, wa.head_dim)), Float16)
    acc_s = cute.make_rmem_tensor(wa.thr_mma.partition_shape_C((MMA_M, wa.keys)), Float32)
    acc_s.fill(0.0)
    num_kb = cute.size(tSrK8.shape[2])
    cute.copy(wa.copy_k, tSsK8[None, None, 0], tSrK8_view[None, None, 0])
    for kb in cutlass.range_constexpr(num_kb):
        if cutlass.const_expr(kb + 1 < num_kb):
            cute.copy(wa.copy_k, tSsK8[None, None, kb + 1], tSrK8_view[None, None, kb + 1])
        for h in cutlass.range_constexpr(2):  # pair block kb = the MMA's k-blocks 2 kb and 2 kb + 1
            k = 2 * kb + h
            cute.copy(wa.copy_q, wa.tSsQ[None, None, k], wa.tSrQ_view[None, None, k])
            for nb in cutlass.range_constexpr(cute.size(tSrK8.shape[1])):
                for j in cutlass.range_constexpr(2):
                    lo, hi = pair_to_f16x2(tSrK8[(j, h), nb, kb], fmt)
                    tSrK[(0, j), nb, k] = lo
                    tSrK[(1, j), nb, k] = hi
            cute.gemm(wa.tiled_mma, acc_s, wa.tSrQ[None, None, k], tSrK[None, None, k], acc_s)
    return acc_s


@cute.jit
def accumulate(wa, acc_s, sV8_w, fmt: cutlass.Constexpr):
    """O_w += P V_w from a [keys, D / 2] pair tile, into the permuted columns of out_columns()."""
    p = cute.make_fragment_like(acc_s, Float16)
    p.store(acc_s.load().to(Float16))
    tOrP = layouts.as_a_operand(p)
    sVt8 = layouts.transposed(sV8_w, wa.keys, wa.head_dim // 2)
    tOrV8 = wa.thr_mma.make_fragment_B(wa.thr_mma.partition_B(sVt8))  # ((2, 2), D / 16, key blocks)
    tOsV8 = wa.copy_v.partition_S(sVt8)
    tOrV8_view = wa.copy_v.retile(tOrV8)
    tOrV = cute.make_rmem_tensor(wa.thr_mma.partition_shape_B((wa.head_dim, wa.keys)), Float16)
    num_k = cute.size(tOrP.shape[2])
    cute.copy(wa.copy_v, tOsV8[None, None, 0], tOrV8_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(wa.copy_v, tOsV8[None, None, k + 1], tOrV8_view[None, None, k + 1])
        for nb in cutlass.range_constexpr(cute.size(tOrV8.shape[1])):
            for h in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    k0, k1 = interleave_to_f16x2(tOrV8[(0, h), nb, k], tOrV8[(1, h), nb, k], e == 1, fmt)
                    tOrV[(0, h), 2 * nb + e, k] = k0
                    tOrV[(1, h), 2 * nb + e, k] = k1
        cute.gemm(wa.tiled_mma, wa.acc_o, tOrP[None, None, k], tOrV[None, None, k], wa.acc_o)


@cute.jit
def load_q_tile_f16(dtype, q_addr: Int64, q_strides, sQ, tQcQ, row0: Int32, num_rows: Int32, group: Int32,
                    b: Int32, kvh: Int32):
    """paging.load_q_tile for an fp16 query tile from a bf16 / fp16 q, its columns in the MMA order
    of K's pairs (q_position): plain loads, converted in registers, stored one value at a time to
    shared memory (once per CTA; visible after the next barrier)."""
    for m in cutlass.range_constexpr(cute.size(tQcQ, mode=[1])):
        row = tQcQ[0, m, 0][0]
        p = row0 + row
        for k in cutlass.range_constexpr(cute.size(tQcQ, mode=[2])):
            col = tQcQ[0, m, k][1]  # 8-aligned: columns col .. col + 7 of this chunk
            half = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), Float16)
            half.fill(0.0)
            if p < num_rows:
                tok = p // group
                head = kvh * group + p - tok * group
                addr = q_addr + (Int64(b) * q_strides[0] + Int64(tok) * q_strides[1] + Int64(head) * q_strides[2]
                                 + Int64(col)) * 2
                src = cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem,
                                                     assumed_align=2 * ELEMS_PER_COPY),
                                       cute.make_layout(ELEMS_PER_COPY))
                raw = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), dtype)
                cute.autovec_copy(src, raw)
                half.store(raw.load().to(Float16))
            base = col - col % 16
            for i in cutlass.range_constexpr(ELEMS_PER_COPY):
                sQ[row, base + q_position(col % 16 + i)] = half[i]
