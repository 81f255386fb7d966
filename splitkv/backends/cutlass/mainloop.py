"""One warp's work on one K/V tile: S = Q K^T (mma.sync) and O += P V (the mask and the variants' score
code are score_mod.py's, the online softmax softmax.py's).

The warp owns 16 query rows (sQ_w, [16, D]) and `keys_per_warp` keys of each stage
(sK_w / sV_w, [keys_per_warp, D]); operands go smem -> registers with ldmatrix (V transposed by
ldmatrix.trans), one k-block ahead of the MMA that uses them.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from splitkv.backends.cutlass import layouts
from splitkv.backends.cutlass.config import MMA_M


@dataclass(frozen=True)
class WarpAttention:
    dtype: type
    head_dim: int
    keys: int  # keys per warp per tile
    tiled_mma: object
    thr_mma: object
    copy_q: object  # ldmatrix thread slices for Q, K and (transposed) V
    copy_k: object
    copy_v: object
    tSrQ: object  # Q fragments, refilled from smem every tile (registers go to the accumulator)
    tSsQ: object
    tSrQ_view: object
    acc_o: object  # fp32 [16, D] accumulator fragment
    s_coords: object  # (row, key) of each score value this thread holds, mn view
    o_coords: object  # (row, col) of each output value this thread holds, mn view

    @staticmethod
    def create(dtype, head_dim: int, keys_per_warp: int, lane: Int32, sQ_w):
        tiled_mma = layouts.warp_mma(dtype)
        thr_mma = tiled_mma.get_slice(lane)
        copy_q = cute.make_tiled_copy_A(layouts.ldmatrix(dtype, False), tiled_mma).get_slice(lane)
        copy_k = cute.make_tiled_copy_B(layouts.ldmatrix(dtype, False), tiled_mma).get_slice(lane)
        copy_v = cute.make_tiled_copy_B(layouts.ldmatrix(dtype, True), tiled_mma).get_slice(lane)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_w))
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((MMA_M, head_dim)), Float32)
        acc_o.fill(0.0)
        s_coords = layouts.mn_view(thr_mma.partition_C(cute.make_identity_tensor((MMA_M, keys_per_warp))))
        o_coords = layouts.mn_view(thr_mma.partition_C(cute.make_identity_tensor((MMA_M, head_dim))))
        return WarpAttention(dtype, head_dim, keys_per_warp, tiled_mma, thr_mma, copy_q, copy_k, copy_v,
                             tSrQ, copy_q.partition_S(sQ_w), copy_q.retile(tSrQ), acc_o, s_coords, o_coords)

    @cute.jit
    def scores(self, sK_w):
        """S [16, keys_per_warp] = Q_w K_w^T in fp32."""
        tSrK = self.thr_mma.make_fragment_B(self.thr_mma.partition_B(sK_w))
        tSsK = self.copy_k.partition_S(sK_w)
        tSrK_view = self.copy_k.retile(tSrK)
        acc_s = cute.make_rmem_tensor(self.thr_mma.partition_shape_C((MMA_M, self.keys)), Float32)
        acc_s.fill(0.0)
        num_k = cute.size(self.tSsQ.shape[2])
        cute.copy(self.copy_q, self.tSsQ[None, None, 0], self.tSrQ_view[None, None, 0])
        cute.copy(self.copy_k, tSsK[None, None, 0], tSrK_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):  # fetch the next k-block while this one multiplies
                cute.copy(self.copy_q, self.tSsQ[None, None, k + 1], self.tSrQ_view[None, None, k + 1])
                cute.copy(self.copy_k, tSsK[None, None, k + 1], tSrK_view[None, None, k + 1])
            cute.gemm(self.tiled_mma, acc_s, self.tSrQ[None, None, k], tSrK[None, None, k], acc_s)
        return acc_s

    @cute.jit
    def accumulate(self, acc_s, sV_w):
        """O_w += P V_w, with P = acc_s (probabilities) rounded to the input dtype."""
        p = cute.make_fragment_like(acc_s, self.dtype)
        p.store(acc_s.load().to(self.dtype))
        tOrP = layouts.as_a_operand(p)
        sVt = layouts.transposed(sV_w, self.keys, self.head_dim)
        tOrV = self.thr_mma.make_fragment_B(self.thr_mma.partition_B(sVt))
        tOsV = self.copy_v.partition_S(sVt)
        tOrV_view = self.copy_v.retile(tOrV)
        num_k = cute.size(tOrP.shape[2])
        cute.copy(self.copy_v, tOsV[None, None, 0], tOrV_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(self.copy_v, tOsV[None, None, k + 1], tOrV_view[None, None, k + 1])
            cute.gemm(self.tiled_mma, self.acc_o, tOrP[None, None, k], tOrV[None, None, k], self.acc_o)
