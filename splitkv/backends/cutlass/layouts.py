"""Shared-memory layouts, copy atoms and the MMA of the split kernel (trace-time builders).

Every smem tile is [rows, D] in 8 x 64-element swizzled atoms (Swizzle<3,3,3>): a 64-element row
segment is 128 bytes, so the swizzle spreads the 8 rows of an atom over all 32 banks for both the
16-byte cp.async writes and the ldmatrix reads. Tiles are the padded head dim wide (64, 128, 192 or
256: a whole number of atoms; D 80 and 96 run on 128 columns, constants.padded_head_dim).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from splitkv.backends.cutlass.config import ELEMS_PER_COPY, MMA_K, MMA_M, NUM_THREADS

ATOM_COLS = 64
THREADS_PER_ROW = ATOM_COLS // ELEMS_PER_COPY  # 8 threads copy one 128-byte row segment


def smem_tile(rows: int, head_dim: int, stages: int = 0):
    """Swizzled [rows, D] layout, or [rows, D, stages] for a pipeline ring."""
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                     cute.make_layout((8, ATOM_COLS), stride=(ATOM_COLS, 1)))
    if stages:
        return cute.tile_to_shape(atom, (rows, head_dim, stages), (0, 1, 2))
    return cute.tile_to_shape(atom, (rows, head_dim), (0, 1))


def g2s_copy(dtype):
    """cp.async.cg of 16 bytes per thread (L1 bypassed: K/V are streamed once), 128 threads laid
    out 16 rows x 8 columns; a [rows, D] tile repeats that pattern over rows and 64-column blocks."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=8 * 2 * ELEMS_PER_COPY)
    thr = cute.make_layout((NUM_THREADS // THREADS_PER_ROW, THREADS_PER_ROW), stride=(THREADS_PER_ROW, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, ELEMS_PER_COPY)))


def warp_mma(dtype):
    """One warp's mma.sync m16n8k16 (fp32 accumulate) tiled to 16 x 16 x 16, so that ldmatrix.x4
    feeds the B operand for 16 columns at a time."""
    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, cutlass.Float32, (MMA_M, 8, MMA_K)), (1, 1, 1),
                               permutation_mnk=(MMA_M, 16, MMA_K))


def ldmatrix(dtype, transpose: bool):
    return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)


def transposed(s_tile, rows: int, head_dim: int):
    """[D, rows] view of a [rows, D] smem tile (V as the B operand of P @ V)."""
    return cute.composition(s_tile, cute.make_layout((head_dim, rows), stride=(rows, 1)))


def mn_view(acc):
    """(rows, cols) view of an mma accumulator fragment ((2, 2), MMA_M, MMA_N): row r holds the
    values one thread has of accumulator row r (two rows per atom: lane / 4 and lane / 4 + 8)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def as_a_operand(p):
    """Reinterpret the S accumulator layout (4, MMA_M, MMA_N) as the A operand of the next MMA,
    ((4, 2), MMA_M, MMA_N / 2): two n8 accumulator atoms make one k16 A atom."""
    div = cute.logical_divide(p.layout, (None, None, 2))
    lay = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(p.iterator, lay)
