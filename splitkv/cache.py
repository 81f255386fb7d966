"""PagedKVCache: a page pool for the KV cache of many sequences, with the block tables decode reads.

Host side (Python): the free list, per-page reference counts, each sequence's page list and lengths.
Device side: one K and one V pool per layer, [num_pages, page_size, Hkv, D], written by append
(one Triton launch on CUDA, the torch `append_torch` elsewhere) and read by splitkv.decode through
`batch()`'s block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import backends, validate
from .rope import RopeConfig, rope_tables, rotate
from .variants import FP8_DTYPES

BACKENDS = ("auto", "torch", "triton")
DTYPES = (torch.float16, torch.bfloat16, torch.float32) + FP8_DTYPES


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] (fp32) -> dtype; an fp8 dtype stores x / scale[h], saturated to its largest
    finite value (torch's cast would give NaN past it). The spec of the append kernel's store."""
    if scale is None:
        return x.to(dtype)
    big = torch.finfo(dtype).max
    return (x / scale[:, None]).clamp(-big, big).to(dtype)


class CacheFullError(RuntimeError):
    """The page pool cannot hold an append; the cache was left exactly as it was."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV cache full: this append needs {needed} free pages, the pool has {free} "
                         "(free sequences or make a larger PagedKVCache)")
        self.needed, self.free = needed, free


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Seq:
    lens: list[int]  # keys held per layer
    pages: list[int] = field(default_factory=list)
    _table: torch.Tensor | None = None  # int32 copy of pages for batch(); None when stale

    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = torch.tensor(self.pages, dtype=torch.int32)
        return self._table


def table_window(block_table: torch.Tensor, first: torch.Tensor, width: int) -> torch.Tensor:
    """Columns first[i] .. first[i] + width - 1 of each row of block_table [N, W] (past the last
    column: the last column's id, never read); on the device, no host read."""
    cols = first.long()[:, None] + torch.arange(width, device=block_table.device)
    return block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1))


def append_torch(k_pool, v_pool, k, v, pages, starts, ntok, cos=None, sin=None, *, neox=True, k_scale=None,
                 v_scale=None):
    """The append kernel's spec in PyTorch (same arguments as triton's append_kv): write k, v
    [N, T, Hkv, D] rows t < ntok[i] at position starts[i] + t of sequence i, whose pages from the
    one holding starts[i] on are pages[i]; K rotated by the cos/sin tables at that position.
    fp8 pools: k_scale, v_scale float32 [Hkv]; the pools get K / k_scale and V / v_scale."""
    N, T = k.shape[:2]
    if N * T == 0:
        return
    ps = k_pool.shape[1]
    t = torch.arange(T, device=k.device)
    pos = starts.long()[:, None] + t  # [N, T]
    valid = t[None, :] < ntok.long()[:, None]
    col = (pos // ps - (starts.long() // ps)[:, None]).clamp(0, pages.shape[1] - 1)
    page = torch.gather(pages.long(), 1, col)[valid]
    pos = pos[valid]
    rows = k[valid]
    if cos is not None:  # in fp32, rounded once to the pool's dtype below (as the Triton kernel does)
        rows = rotate(rows.float(), cos[pos], sin[pos], neox)
    k_pool[page, pos % ps] = quantize(rows.float() if k_scale is not None else rows, k_scale, k_pool.dtype)
    v_pool[page, pos % ps] = quantize(v[valid].float() if v_scale is not None else v[valid], v_scale, v_pool.dtype)


class PagedKVCache:
    """KV cache of many sequences in fixed-size pages, for splitkv.decode(..., block_table=...).

        cache = PagedKVCache(num_pages, page_size, num_kv_heads, head_dim, num_layers=L)
        sid = cache.add_sequence()
        cache.append([sid], k, v, layer=l, rope=RopeConfig())   # k, v [1, T, Hkv, D]
        block_table, cache_seqlens = cache.batch([sid], layer=l)
        o = splitkv.decode(q, cache.k_pages(l), cache.v_pages(l), cache_seqlens, block_table=block_table)

    Layers. Every layer has its own K/V pool, but all layers share one page table: page p of a
    sequence is page p of every layer's pool. Each (sequence, layer) keeps its own length:
    append(..., layer=l) writes at positions seq_len(sid, l) onward and advances only layer l.
    A sequence holds ceil(max over layers of its length / page_size) pages, allocated by the first
    layer that reaches them. So in a model step (every layer appends the same tokens, layer 0
    first) pages are allocated once, in layer 0's append, each layer's length advances once per
    token, and after the step all layers agree. batch(ids, layer=l) reports layer l's lengths; the
    block table is the same for every layer, so the (block_table, cache_seqlens) of layer 0's
    batch() after its append serve every layer of the step (and one splitkv.plan for all of them).

    Fork = lazy copy-on-write. fork(sid) shares every page of sid (reference count + 1) and
    allocates nothing, so it never raises CacheFullError. A page held by more than one sequence is
    never written in place: the first append that would write into one (the shared, partly filled
    last page; full pages are never written again) first copies it, all layers, into a fresh page
    for the writer. Such copies count towards the append's need of free pages.

    CacheFullError: append raises it, before changing anything, when fresh pages + copies exceed
    the free pages. free(sid) returns to the pool the pages no other sequence holds.

    Continuous batching: sequences join (add_sequence, fork) and leave (free) between steps;
    batch(seq_ids) builds int32 tables for whichever set is active, in that order, on the cache's
    device. It rebuilds them only when the set, the lengths or a page list changed since the last
    call (one host->device copy), so calling it for every layer of a step costs a comparison.
    Block-table entries past a sequence's last page are 0 (a valid id; decode never reads them).

    backend (append): decode's rule; "triton" = the Triton kernel (CUDA, or CPU under
    TRITON_INTERPRET=1), "torch" = append_torch. Not thread-safe. append is not CUDA-graph
    capturable (page bookkeeping on the host); a captured step counts its tokens with extend()
    before the replay and writes them inside the graph with write().

    FP8 (dtype=torch.float8_e4m3fn or float8_e5m2): pages hold K / k_scale and V / v_scale,
    quantised in the append kernel (after RoPE, saturating), half the bytes of bf16 for decode
    to read; pass `k_scale=cache.k_scale(l), v_scale=cache.v_scale(l)` to splitkv.decode. Scales
    are fixed at construction: a float per tensor (default 1.0: e4m3 keeps ~2 significant digits
    from 2^-9 to 448 whatever the scale, so unit scales suit K/V of typical magnitude, as vLLM's
    default does), or float32 [num_layers, Hkv] per layer and KV head (calibrated scales, for
    heads whose values pass 448 or sit near 2^-9).
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 num_layers: int = 1, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 backend: str = "auto", k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> None:
        for name, val in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim), ("num_layers", num_layers)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        if dtype not in DTYPES:
            raise TypeError(f"dtype: expected one of {DTYPES}, got {dtype}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.num_pages, self.page_size, self.num_layers = num_pages, page_size, num_layers
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self._k = torch.empty(shape, dtype=dtype, device=self.device)
        self._v = torch.empty(shape, dtype=dtype, device=self.device)
        self.device = self._k.device  # "cuda" -> "cuda:0": k/v device checks compare equal
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pages 0, 1, 2, ... go out first
        self._ref = [0] * num_pages
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._version = 0  # bumped whenever a page list or refcount changes: keys the reuse below
        self._write_key = self._write_meta = None  # the last append's plan (see append)
        self._batch_key = self._batch_val = None
        self._tables: dict = {}  # (base, rotary_dim) -> (cos, sin) on device, grown on demand
        self._append = self._pick_append(backend)
        self._scales = None  # fp8: (k, v) float32 [num_layers, Hkv] on device, and the user's form
        if dtype in FP8_DTYPES:
            self._scales = (self._scale_arg("k_scale", k_scale), self._scale_arg("v_scale", v_scale),
                            k_scale, v_scale)
        else:
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if isinstance(s, torch.Tensor) or s != 1.0:
                    raise ValueError(f"{name}: scales are for float8 caches only; this cache's dtype is {dtype}")

    def _scale_arg(self, name: str, s) -> torch.Tensor:
        shape = (self.num_layers, self.num_kv_heads)
        if isinstance(s, torch.Tensor):
            if s.is_meta:
                raise ValueError(f"{name}: a meta tensor holds no values; pass the scales on a real device")
            if s.dtype != torch.float32 or tuple(s.shape) != shape or not bool(torch.isfinite(s).all()) \
                    or not bool((s > 0).all()):
                raise ValueError(f"{name}: expected a float or a float32 tensor {list(shape)} of finite values > 0, "
                                 f"got {s.dtype} {list(s.shape)}")
            return s.to(self.device).contiguous()
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0 or s == float("inf"):
            raise ValueError(f"{name}: expected a finite float > 0 or a float32 tensor {list(shape)}, got {s!r}")
        return torch.full(shape, float(s), dtype=torch.float32, device=self.device)

    def k_scale(self, layer: int = 0) -> float | torch.Tensor:
        """Layer `layer`'s K scale for splitkv.decode(k_scale=...) on an fp8 cache: the float given
        at construction, or float32 [Hkv] (per KV head). Raises on a cache that is not fp8."""
        return self._scale_of(0, layer)

    def v_scale(self, layer: int = 0) -> float | torch.Tensor:
        return self._scale_of(1, layer)

    def _scale_of(self, i: int, layer: int):
        if self._scales is None:
            raise ValueError(f"dtype: the cache is {self.dtype}; scales exist for float8 caches only")
        given = self._scales[2 + i]
        layer = self._check_layer(layer)
        return float(given) if not isinstance(given, torch.Tensor) else self._scales[i][layer]

    def _pick_append(self, backend: str):
        # decode's rule (SPLITKV_BACKEND included); the Triton append serves every GPU backend
        if backends.resolve(backend, self.device) == "torch":
            return append_torch
        from .backends.triton.append_kernel import append_kv

        return append_kv

    # ---- read-only views -------------------------------------------------------------------
    def k_pages(self, layer: int = 0) -> torch.Tensor:
        """Layer `layer`'s K pool [num_pages, page_size, Hkv, D] (a view)."""
        return self._k[self._check_layer(layer)]

    def v_pages(self, layer: int = 0) -> torch.Tensor:
        return self._v[self._check_layer(layer)]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, sid) -> bool:
        return sid in self._seqs

    def seq_len(self, sid: int, layer: int = 0) -> int:
        return self._seq(sid, "sid").lens[self._check_layer(layer)]

    def pages(self, sid: int) -> list[int]:
        """Page ids of sequence sid, in position order (a copy)."""
        return list(self._seq(sid, "sid").pages)

    def refcount(self, page: int) -> int:
        """How many sequences hold `page` (0 = free); any integer (a Python, NumPy or 0-d tensor one)."""
        idx = validate.as_int(page)
        if idx is None or not 0 <= idx < self.num_pages:
            raise ValueError(f"page: expected an int in [0, {self.num_pages}), got {page!r}")
        return self._ref[idx]

    def positions(self, seq_ids: Sequence[int], num_tokens: int, layer: int = 0) -> torch.Tensor:
        """int64 [N, num_tokens] positions the next num_tokens of each sequence will take in layer
        `layer` (rotate q with splitkv.apply_rope at these before appending its K)."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        seqs = self._lookup(self._ids(seq_ids))
        start = torch.tensor([s.lens[self._check_layer(layer)] for s in seqs], dtype=torch.int64)
        return (start[:, None] + torch.arange(num_tokens)).to(self.device)

    # ---- sequences ---------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id (ids are never reused)."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq(lens=[0] * self.num_layers)
        return sid

    def fork(self, sid: int) -> int:
        """A new sequence with sid's contents, sharing all its pages (lazy copy-on-write)."""
        src = self._seq(sid, "sid")
        for p in src.pages:
            self._ref[p] += 1
        nid = self._next_id
        self._next_id += 1
        self._seqs[nid] = _Seq(lens=list(src.lens), pages=list(src.pages), _table=src._table)
        self._version += 1
        return nid

    def free(self, sid: int) -> None:
        """Drop sequence sid; its pages that no other sequence holds return to the pool."""
        seq = self._seq(sid, "sid")
        for p in seq.pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
        del self._seqs[sid]
        self._version += 1

    # ---- append ------------------------------------------------------------------------------
    def append(self, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, layer: int = 0, *,
               rope: RopeConfig | None = None, lengths: Sequence[int] | None = None) -> None:
        """Append k, v [len(seq_ids), T, Hkv, D] after each sequence's end in layer `layer`.

        lengths: optional per-sequence count (<= T) of rows to take (ragged prefill); default T.
        rope: rotate K at each token's position (its sequence's layer length + t) on the way in.
        Raises CacheFullError, changing nothing, when the pool cannot hold the new tokens.
        """
        ids = self._ids(seq_ids, unique=True)
        layer = self._check_layer(layer)
        seqs = self._lookup(ids)
        counts = self._check_kv(k, v, len(ids), lengths)
        if rope is not None and not isinstance(rope, RopeConfig):
            raise TypeError(f"rope: expected None or a splitkv.RopeConfig, got {type(rope).__name__}")
        if not any(counts):
            return
        starts = [s.lens[layer] for s in seqs]
        cos = sin = None
        if rope is not None:  # before any change: a too-short caller table raises here
            cos, sin = self._rope_tables(rope, max(a + n for a, n in zip(starts, counts, strict=True)))
        key = (tuple(ids), tuple(counts), tuple(starts))
        if self._write_key != key + (self._version,):
            # Not the previous append's positions (layer 0 of a step, or after a fork/free):
            # plan it. Otherwise (layers 1.. of a step) it needs no page and touches the same
            # pages, all now held by their writer alone, so its device table is reused as is.
            grow, copies = self._plan_writes(seqs, counts, layer)
            self._commit(seqs, grow, copies)
            self._write_meta = self._write_table(seqs, starts, counts)
            self._write_key = key + (self._version,)
        pages_t, starts_t, ntok_t = self._write_meta
        scales = {} if self._scales is None else dict(k_scale=self._scales[0][layer], v_scale=self._scales[1][layer])
        self._append(self._k[layer], self._v[layer], k, v, pages_t, starts_t, ntok_t, cos, sin,
                     neox=rope.neox if rope is not None else True, **scales)
        for seq, n in zip(seqs, counts, strict=True):
            seq.lens[layer] += n

    def extend(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        """Count num_tokens more tokens of each sequence in every layer, and give them their pages
        (fresh ones, or a private copy of a shared last page), without writing their rows: the
        caller writes them with `write` — a CUDA graph replaying a whole model step does, since the
        graph can replay device work but not this bookkeeping. Every layer of a sequence must hold
        the same length (between steps). Raises CacheFullError, changing nothing, when the pool
        cannot hold the tokens."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        ids = self._ids(seq_ids, unique=True)
        seqs = self._lookup(ids)
        for sid, seq in zip(ids, seqs, strict=True):
            if min(seq.lens) != max(seq.lens):
                raise ValueError(f"seq_ids: sequence {sid}'s layers hold different lengths {seq.lens} "
                                 "(extend works between steps, when every layer has appended)")
        if not num_tokens or not ids:
            return
        grow, copies = self._plan_writes(seqs, [num_tokens] * len(ids), 0)
        self._commit(seqs, grow, copies)
        for seq in seqs:
            seq.lens = [n + num_tokens for n in seq.lens]
        self._version += 1  # the lengths changed under append's reuse key

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
              starts: torch.Tensor, ntok: torch.Tensor) -> None:
        """Write k, v [N, T, Hkv, D] rows t < ntok[i] at positions starts[i] + t of the sequence
        whose pages are block_table[i] (int32 [N, W], as batch() returns), in layer `layer`; fp8
        caches quantise with their scales. Device tensors only and no host bookkeeping: capturable
        in a CUDA graph. The positions must already be counted (`extend`); rows with ntok = 0
        write nothing (a graph's padding rows)."""
        layer = self._check_layer(layer)
        N, T = k.shape[:2]
        ps = self.page_size
        span = _cdiv(T, ps) + 1  # pages a run of T tokens from any offset can touch
        pages = table_window(block_table, starts.long() // ps, span).to(torch.int32)
        scales = {} if self._scales is None else dict(k_scale=self._scales[0][layer], v_scale=self._scales[1][layer])
        self._append(self._k[layer], self._v[layer], k, v, pages, starts.to(torch.int32).contiguous(),
                     ntok.to(torch.int32).contiguous(), **scales)

    def _write_table(self, seqs, starts, counts):
        """Device (pages [N, W], starts [N], ntok [N]) int32 for the kernel; one host->device copy."""
        ps, N = self.page_size, len(seqs)
        lo = [a // ps for a in starts]
        hi = [_cdiv(a + n, ps) if n else a // ps for a, n in zip(starts, counts, strict=True)]
        width = max(max(h - l for l, h in zip(lo, hi, strict=True)), 1)
        flat = []
        for seq, l, h in zip(seqs, lo, hi, strict=True):
            flat += seq.pages[l:h] + [0] * (width - (h - l))
        meta = torch.tensor(flat + starts + counts, dtype=torch.int32).to(self.device)
        return meta[:N * width].view(N, width), meta[N * width:N * width + N], meta[N * width + N:]

    def _plan_writes(self, seqs, counts, layer):
        """Fresh pages per sequence, and the (sequence, page index) pairs to copy before writing;
        raises CacheFullError if the pool cannot supply them. Changes nothing."""
        ps = self.page_size
        leaving: dict[int, int] = {}  # page -> holders in this call that copy it away
        grow, copies = [], []
        for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            start, end, have = seq.lens[layer], seq.lens[layer] + n, len(seq.pages)
            grow.append(max(0, _cdiv(end, ps) - have))
            for j in range(start // ps, min(_cdiv(end, ps), have)) if n else ():
                p = seq.pages[j]
                if self._ref[p] - leaving.get(p, 0) > 1:  # the last holder may write in place
                    leaving[p] = leaving.get(p, 0) + 1
                    copies.append((i, j))
        need = sum(grow) + len(copies)
        if need > len(self._free):
            raise CacheFullError(need, len(self._free))
        return grow, copies

    def _take(self, n: int) -> list[int]:
        if n == 0:
            return []
        out = self._free[-n:][::-1]
        del self._free[-n:]
        for p in out:
            self._ref[p] = 1
        return out

    def _commit(self, seqs, grow, copies) -> None:
        if copies:
            fresh = self._take(len(copies))
            old = []
            for (i, j), p in zip(copies, fresh, strict=True):
                old.append(seqs[i].pages[j])
                self._ref[old[-1]] -= 1
                seqs[i].pages[j] = p
                seqs[i]._table = None
            src, dst = torch.tensor(old, device=self.device), torch.tensor(fresh, device=self.device)
            self._k[:, dst] = self._k[:, src]  # every layer: page p addresses all of them
            self._v[:, dst] = self._v[:, src]
        for seq, g in zip(seqs, grow, strict=True):
            if g:
                seq.pages += self._take(g)
                seq._table = None
        if copies or any(grow):
            self._version += 1

    def _rope_tables(self, rope: RopeConfig, num_positions: int):
        if rope.cos is not None:
            if rope.cos.shape[0] < num_positions:
                raise ValueError(f"rope.cos: has {rope.cos.shape[0]} positions, this append reaches "
                                 f"position {num_positions - 1}")
            rope.resolve_dim(self.head_dim)
            return (rope.cos.to(self.device, torch.float32).contiguous(),
                    rope.sin.to(self.device, torch.float32).contiguous())
        key = (float(rope.base), rope.resolve_dim(self.head_dim))
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < num_positions:
            # grow by doubling: a decode loop rebuilds the table O(log length) times, not per token
            n = 1 << max(10, (num_positions - 1).bit_length())
            have = self._tables[key] = rope_tables(rope, n, self.head_dim, self.device)
        return have

    # ---- batch -------------------------------------------------------------------------------
    def batch(self, seq_ids: Sequence[int], layer: int = 0, *,
              max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table int32 [B, W], cache_seqlens int32 [B]) on the cache's device, for
        splitkv.decode over k_pages(layer), v_pages(layer). W = the most pages any of the sequences
        holds (at least 1), or max_pages when given (a fixed shape for CUDA graphs). Read-only:
        the same tensors are returned again while nothing changed."""
        ids = tuple(self._ids(seq_ids))
        layer = self._check_layer(layer)
        seqs = self._lookup(ids)
        lens = [s.lens[layer] for s in seqs]
        key = (ids, tuple(lens), self._version, max_pages)
        if key == self._batch_key:
            return self._batch_val
        width = max([len(s.pages) for s in seqs] + [1])
        if max_pages is not None:
            if not isinstance(max_pages, int) or max_pages < width:
                raise ValueError(f"max_pages: expected an int >= {width} (pages of the longest sequence), "
                                 f"got {max_pages!r}")
            width = max_pages
        B = len(ids)
        buf = torch.zeros(B * width + B, dtype=torch.int32)
        table = buf[:B * width].view(B, width)
        for b, s in enumerate(seqs):
            if s.pages:
                table[b, :len(s.pages)] = s.table()
        buf[B * width:] = torch.tensor(lens, dtype=torch.int32)
        buf = buf.to(self.device)
        self._batch_key = key
        self._batch_val = (buf[:B * width].view(B, width), buf[B * width:])
        return self._batch_val

    # ---- checks ------------------------------------------------------------------------------
    def _check_layer(self, layer) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def _seq(self, sid, name: str) -> _Seq:
        seq = self._seqs.get(sid) if isinstance(sid, int) and not isinstance(sid, bool) else None
        if seq is None:
            raise ValueError(f"{name}: {sid!r} is not a sequence of this cache (never added, or freed)")
        return seq

    def _lookup(self, ids) -> list[_Seq]:
        if all(type(s) is int and s in self._seqs for s in ids):  # not bool: True == 1
            return [self._seqs[s] for s in ids]
        return [self._seq(s, "seq_ids") for s in ids]  # raises, naming the bad id

    @staticmethod
    def _ids(seq_ids, unique: bool = False) -> list:
        if isinstance(seq_ids, torch.Tensor) or hasattr(seq_ids, "tolist"):  # a tensor or a NumPy array
            seq_ids = seq_ids.tolist()
        elif isinstance(seq_ids, range):
            seq_ids = list(seq_ids)
        if not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"seq_ids: expected a list of sequence ids, got {type(seq_ids).__name__}")
        if unique and len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: a sequence appears twice in one append: {list(seq_ids)}")
        return list(seq_ids)

    def _check_kv(self, k, v, n: int, lengths) -> list[int]:
        want = f"[{n}, T, {self.num_kv_heads}, {self.head_dim}]"
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{name}: expected a float tensor {want}")
            if t.dim() != 4 or t.shape[0] != n or tuple(t.shape[2:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name}: on {t.device} but the cache is on {self.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: head dim (last) must have unit stride, got {tuple(t.stride())}")
        if v.shape != k.shape:
            raise ValueError(f"v: shape {tuple(v.shape)} does not match k's {tuple(k.shape)}")
        T = k.shape[1]
        if lengths is None:
            return [T] * n
        counts = lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)  # tensor / NumPy -> ints
        if len(counts) != n or any(not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= T for c in counts):
            raise ValueError(f"lengths: expected {n} ints in [0, T={T}], got {counts}")
        return counts
