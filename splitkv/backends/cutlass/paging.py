"""Row addressing and cp.async tile loads of the split kernel: query rows, and key/value rows of a
contiguous [B, Lmax, Hkv, D] or paged [P, page_size, Hkv, D] cache.

Addresses are 64-bit byte addresses computed per row (one row = D contiguous elements, 16-byte
aligned), so any page size works: key n of request b sits on page block_table[b, n // page_size]
at row n % page_size. Table entries are read only for keys < end, so entries past a request's
last page (garbage) are never used, and cache rows past the split's end are never loaded (NaN in
unused slots cannot reach the output). The split kernel reads a tile's table entries one tile
ahead of its copies (lookup_pages), so their latency hides under the MMA of the tile in between.
Rows that are not loaded are zero-filled in shared memory, because P @ V multiplies them by p = 0
and 0 * NaN would poison the accumulator. So are the padding columns of a head dim that is not a
multiple of 64 (80, 96: tiles of 128 columns), never read from global memory.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from splitkv.backends.cutlass.config import ELEMS_PER_COPY
from splitkv.constants import padded_head_dim


def gmem_vec(dtype, addr, n, align):
    """A rank-1 gmem tensor of n elements at byte address addr."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align),
                            cute.make_layout(n))


@dataclass(frozen=True)
class KVRows:
    """Byte addresses of the K and V rows of one (request, KV head). Frozen: the DSL then treats
    it as read-only inside dynamic control flow. Strides are in cache elements of elem_bytes;
    rows are copied as `dtype` elements (fp8 caches: 16-bit pairs, fp8.py)."""

    paged: bool
    dtype: type
    head_dim: int  # the real row width in `dtype` elements (columns past it in a padded tile are zero-filled)
    elem_bytes: int  # bytes of one cache element (the strides' unit)
    k_base: Int64  # address of (kvh) [paged] or (b, kvh) [contiguous]: the fixed part of the offset
    v_base: Int64
    k_sb: Int64
    k_sn: Int64
    v_sb: Int64
    v_sn: Int64
    table: object  # this request's block-table row (paged), else None
    page_div: object  # FastDivmodDivisor(page_size) (paged), else None

    @staticmethod
    def create(paged: bool, dtype, head_dim: int, k_addr, v_addr, k_strides, v_strides, kvh, b, bt_addr,
               bt_stride, page_size, elem_bytes: int = 2):
        if paged:
            return KVRows(True, dtype, head_dim, elem_bytes,
                          k_addr + Int64(kvh) * k_strides[2] * elem_bytes,
                          v_addr + Int64(kvh) * v_strides[2] * elem_bytes,
                          k_strides[0], k_strides[1], v_strides[0], v_strides[1],
                          gmem_vec(Int32, bt_addr + Int64(b) * bt_stride * 4, 1 << 30, 4),
                          cute.FastDivmodDivisor(page_size))
        return KVRows(False, dtype, head_dim, elem_bytes,
                      k_addr + (Int64(b) * k_strides[0] + Int64(kvh) * k_strides[2]) * elem_bytes,
                      v_addr + (Int64(b) * v_strides[0] + Int64(kvh) * v_strides[2]) * elem_bytes,
                      k_strides[0], k_strides[1], v_strides[0], v_strides[1], None, None)

    @cute.jit
    def page_of(self, n: Int32):
        """The block-table entry (page) holding key n (paged caches)."""
        page_idx, _ = divmod(n, self.page_div)
        return self.table[page_idx]

    @cute.jit
    def row_addrs(self, n: Int32, page=None):
        """(K row address, V row address) of key n; paged: on `page` when given (page_of(n),
        read ahead), else from the block table now."""
        k_off = Int64(0)
        v_off = Int64(0)
        if const_expr(self.paged):
            page_idx, in_page = divmod(n, self.page_div)
            if const_expr(page is None):
                page = self.table[page_idx]
            page64 = Int64(page)  # page * page stride can pass 2^31
            k_off = page64 * self.k_sb + Int64(in_page) * self.k_sn
            v_off = page64 * self.v_sb + Int64(in_page) * self.v_sn
        else:
            k_off = Int64(n) * self.k_sn
            v_off = Int64(n) * self.v_sn
        return self.k_base + k_off * self.elem_bytes, self.v_base + v_off * self.elem_bytes


@cute.jit
def copy_row(gcopy, dtype, addr, tXsX, tXcX, m: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    """cp.async this thread's 16-byte chunks of tile row m (all its column blocks) from addr;
    chunks past head_dim (a padded tile) are zero-filled instead."""
    for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
        dst = tXsX[None, m, k]
        col = tXcX[0, m, k][1]
        src = cute.make_tensor(
            cute.make_ptr(dtype, addr + Int64(col) * (dtype.width // 8), cute.AddressSpace.gmem,
                          assumed_align=2 * ELEMS_PER_COPY),
            cute.make_layout(dst.shape))
        if const_expr(head_dim == padded_head_dim(head_dim)):
            cute.copy(gcopy, src, dst)
        else:
            if col < head_dim:
                cute.copy(gcopy, src, dst)
            else:
                dst.fill(0)


@cute.jit
def lookup_pages(kv: KVRows, tXcX, n0: Int32, end: Int32, pages):
    """pages[m] <- the page of this thread's tile row m, keys [n0, n0 + block_n) clamped to end - 1
    (a valid key): the block-table loads of a tile, issued a tile ahead of its copies so that
    their latency hides under the MMA of the tile in between. Paged caches only."""
    for m in cutlass.range_constexpr(cute.size(tXcX, mode=[1])):
        pages[m] = kv.page_of(cutlass.min(n0 + tXcX[0, m, 0][0], end - 1))


@cute.jit
def load_kv_tile(gcopy, kv: KVRows, tKsK, tVsV, tXcX, n0: Int32, end: Int32, pages=None):
    """Issue the cp.async of keys [n0, n0 + block_n) of K and V into one pipeline stage; rows at or
    past `end` are zero-filled instead. Needs end > n0 (a non-empty tile). pages: the tile's
    lookup_pages (paged caches), else the table is read here."""
    # all of this thread's row addresses first, branch-free (keys clamped to end - 1, a valid
    # key), so that the block-table loads of a paged cache are in flight together
    addrs = []
    for m in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
        n = cutlass.min(n0 + tXcX[0, m, 0][0], end - 1)
        addrs.append(kv.row_addrs(n, pages[m] if const_expr(pages is not None) else None))
    for m in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
        k_row, v_row = addrs[m]
        if n0 + tXcX[0, m, 0][0] < end:
            copy_row(gcopy, kv.dtype, k_row, tKsK, tXcX, m, kv.head_dim)
            copy_row(gcopy, kv.dtype, v_row, tVsV, tXcX, m, kv.head_dim)
        else:
            tKsK[None, m, None].fill(0)
            tVsV[None, m, None].fill(0)


@cute.jit
def load_q_tile(gcopy, dtype, head_dim: cutlass.Constexpr, q_addr: Int64, q_strides, tQsQ, tQcQ, row0: Int32,
                num_rows: Int32, group: Int32, b: Int32, kvh: Int32):
    """cp.async the block's packed query rows: row r of the tile is packed row p = row0 + r, i.e.
    token p // group of query head kvh * group + p % group; rows with p >= num_rows are zeros."""
    nbytes = dtype.width // 8
    for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
        p = row0 + tQcQ[0, m, 0][0]
        if p < num_rows:
            tok = p // group
            head = kvh * group + p - tok * group
            addr = q_addr + (Int64(b) * q_strides[0] + Int64(tok) * q_strides[1]
                             + Int64(head) * q_strides[2]) * nbytes
            copy_row(gcopy, dtype, addr, tQsQ, tQcQ, m, head_dim)
        else:
            tQsQ[None, m, None].fill(0)
