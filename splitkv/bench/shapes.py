"""Benchmark suites: named decode problems and the byte model. No tensors here (inputs.py builds them).

Suites
  peers  the benchmarks/PEERS.md grid: B 1/4/16/64 x L 4K/32K/128K x Hq/Hkv 32/32, 32/8, 64/8, D 128,
         minus the combinations whose K+V exceed KV_CAP_BYTES (the same cut PEERS.md made).
  full   (default) peers + paged page_size 16 (the FlashInfer rows of PEERS.md), Sq=4 causal
         (speculative verify), ragged batches (lengths spread geometrically 1K-128K, contiguous and
         paged; evenly spaced 1K-128K, paged; B=32 geometric, paged) and head-dim 64 / 256 spot checks.
  headline  every shape PEERS.md gives a number for (its SDPA table: 14 contiguous shapes; its
         FlashInfer table: 8 paged page_size 16 shapes; its graph-replay table is a subset of the
         first) + the ragged batches B=16, lengths 1K-128K spread geometrically and evenly, and B=32
         spread geometrically, paged 16. The suite of
         `bash benchmarks/gpu_run.sh bench` (eager no-plan / plan / graph vs the peers).
  variants  attention variants next to plain decode on the same shape (B=1 GQA 32/8): a 4K sliding
         window over a 128K cache (and plain 4K / 128K), softcap 30, attention sinks, ALiBi at 32K;
         padded head dims 80 / 96 (B=16 32K) and 192 (B=1 32K); contiguous and paged 16.
  fp8    the fp8 KV issue's shapes (B=1 GQA 128K, B=16 GQA 32K, B=1 MHA 32K; contiguous and paged
         16), each with a bf16 cache and an e4m3 cache (bf16 q). Their fp8 rows are in full and
         headline too.
  quick  tiny shapes that run on a CPU in seconds (tests, smoke runs); same kinds of rows.

Names are stable (rows are reproduced with `--shapes NAME`):
  b{B}-l{L}-h{Hq}x{Hkv}-d{D}[-sq{Sq}][-paged{page_size}][-fp8e4m3][-win{left}][-softcap{c}][-sinks][-alibi],
  ragged: b{B}-ragged{Lmin}-{Lmax}-...
  (geometric spread), b{B}-ragged{Lmin}-{Lmax}-lin-... (evenly spaced lengths)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

# PEERS.md stops at 8 GiB of bf16 K+V (B=16 x 128K x 8 heads): a bigger cache plus the SDPA layout
# copy and the fp64 reference would not fit comfortably in 141 GB, and each such row costs ~10 ms
# per call, which the default ~4-minute budget cannot afford across every provider.
KV_CAP_BYTES = 8 * 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    seqlens: tuple[int, ...]  # valid keys per request, the q_len new ones included
    q_len: int = 1
    causal: bool = True
    page_size: int | None = None  # None: contiguous cache [B, Lmax, Hkv, D]
    tags: tuple[str, ...] = ()  # "grid" rows feed the bandwidth plot
    kv_dtype: str = ""  # "": K/V in q's dtype; "fp8_e4m3": float8_e4m3fn K/V (per-tensor scales)
    # attention variant, as decode takes it: window_left (-1: none; the window is (left, -1)),
    # softcap (0: none), sinks / alibi (per-head tensors made by inputs.build_case)
    window_left: int = -1
    softcap: float = 0.0
    sinks: bool = False
    alibi: bool = False

    @property
    def plain(self) -> bool:
        return self.window_left < 0 and self.softcap == 0 and not self.sinks and not self.alibi

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    @property
    def uniform(self) -> bool:
        return len(set(self.seqlens)) == 1

    @property
    def visible(self) -> tuple[int, ...]:
        """Keys each request's queries can see: all of them, or the last Sq + left with a window."""
        if self.window_left < 0:
            return self.seqlens
        return tuple(min(L, self.q_len + self.window_left) for L in self.seqlens)

    def kv_elem_bytes(self, elem_bytes: int) -> int:
        """Bytes of one K or V value when q's are elem_bytes: 1 for an fp8 cache."""
        return 1 if self.kv_dtype else elem_bytes

    def bytes(self, elem_bytes: int) -> int:
        """byte_model at q's element size (an fp8 row's K/V count one byte each; a window's rows
        count the keys it shows)."""
        return byte_model(self.visible, self.num_q_heads, self.num_kv_heads, self.head_dim, self.q_len,
                          elem_bytes, self.kv_elem_bytes(elem_bytes))

    def kv_bytes(self, elem_bytes: int) -> int:
        return 2 * sum(self.visible) * self.num_kv_heads * self.head_dim * self.kv_elem_bytes(elem_bytes)


def byte_model(seqlens, num_q_heads: int, num_kv_heads: int, head_dim: int, q_len: int,
               elem_bytes: int, kv_elem_bytes: int | None = None) -> int:
    """Bytes a decode step must move at least: the useful traffic that effective TB/s divides.

        K + V of the valid positions: 2 * sum(seqlens) * Hkv * D * kv_elem_bytes  (read once each;
                                      kv_elem_bytes = elem_bytes unless the cache is fp8)
        q and o:                      2 * B * Sq * Hq * D * elem_bytes          (read q, write o)

    Not counted: split partials and their merge (our overhead, not work), lse, block tables and
    lengths (a few bytes per page), positions a provider reads past the valid length, and for
    Sq > 1 the causal mask (every valid key is still read once). The same model is used for every
    provider, so TB/s compares time for the same work.
    """
    batch = len(seqlens)
    kv = 2 * sum(int(L) for L in seqlens) * num_kv_heads * head_dim * (kv_elem_bytes or elem_bytes)
    qo = 2 * batch * q_len * num_q_heads * head_dim * elem_bytes
    return kv + qo


def fmt_len(L: int) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def make_shape(B: int, L, Hq: int, Hkv: int, D: int = 128, *, q_len: int = 1, page_size=None,
               tags=(), spacing: str = "", kv_dtype: str = "", window_left: int = -1, softcap: float = 0.0,
               sinks: bool = False, alibi: bool = False) -> Shape:
    """One shape; L is an int (uniform batch) or a sequence of per-request lengths (ragged).
    spacing: a suffix of the ragged length token ("lin" for evenly spaced lengths), keeping
    names of batches with the same range distinct."""
    if isinstance(L, int):
        seqlens, length = (L,) * B, f"l{fmt_len(L)}"
    else:
        seqlens = tuple(int(x) for x in L)
        if len(seqlens) != B:
            raise ValueError(f"L: expected {B} lengths, got {len(seqlens)}")
        length = f"ragged{fmt_len(min(seqlens))}-{fmt_len(max(seqlens))}" + (f"-{spacing}" if spacing else "")
    name = f"b{B}-{length}-h{Hq}x{Hkv}-d{D}"
    if q_len > 1:
        name += f"-sq{q_len}"
    if page_size is not None:
        name += f"-paged{page_size}"
    if kv_dtype:
        name += "-" + kv_dtype.replace("_", "")
    if window_left >= 0:
        name += f"-win{window_left}"
    if softcap:
        name += f"-softcap{softcap:g}"
    name += "-sinks" * sinks + "-alibi" * alibi
    return Shape(name, B, Hq, Hkv, D, seqlens, q_len, True, page_size, tuple(tags), kv_dtype, window_left,
                 float(softcap), sinks, alibi)


def spread_lengths(batch: int, lo: int, hi: int) -> tuple[int, ...]:
    """`batch` lengths spaced geometrically from lo to hi (odd values on purpose: partial pages),
    interleaved long/short so neighbouring requests differ."""
    if batch == 1:
        return (hi,)
    geo = [round(lo * (hi / lo) ** (i / (batch - 1))) for i in range(batch)]
    out = []
    for i in range(batch):  # 0, -1, 1, -2, ...: long and short requests alternate
        out.append(geo[i // 2] if i % 2 == 0 else geo[-(i // 2) - 1])
    return tuple(out)


def linear_lengths(batch: int, lo: int, hi: int) -> tuple[int, ...]:
    """`batch` lengths evenly spaced from lo to hi, truncated to ints: the same values as
    torch.linspace(lo, hi, batch).int() (mostly partial last pages), in increasing order."""
    if batch == 1:
        return (hi,)
    return tuple(lo + (hi - lo) * i // (batch - 1) for i in range(batch))


GRID_HEADS = ((32, 32), (32, 8), (64, 8))
GRID_BATCH = (1, 4, 16, 64)
GRID_LEN = (4096, 32768, 131072)


def peers_suite() -> list[Shape]:
    out = []
    for Hq, Hkv in GRID_HEADS:
        for B in GRID_BATCH:
            for L in GRID_LEN:
                s = make_shape(B, L, Hq, Hkv, tags=("grid",))
                if s.kv_bytes(2) <= KV_CAP_BYTES:
                    out.append(s)
    return out


# (B, L, Hq, Hkv) of PEERS.md's tables: SDPA flash / cuDNN (contiguous; the graph-replay table's
# shapes are among them) and FlashInfer (paged, page_size 16)
PEERS_MD_SDPA = ((1, 4096, 32, 32), (1, 32768, 32, 32), (1, 131072, 32, 32), (4, 32768, 32, 32),
                 (16, 4096, 32, 32), (16, 32768, 32, 32), (64, 4096, 32, 32), (1, 4096, 32, 8),
                 (1, 32768, 32, 8), (1, 131072, 32, 8), (4, 4096, 32, 8), (16, 131072, 32, 8),
                 (64, 32768, 32, 8), (1, 4096, 64, 8))
PEERS_MD_PAGED = ((1, 4096, 32, 8), (1, 32768, 32, 8), (1, 131072, 32, 8), (4, 32768, 32, 8),
                  (16, 131072, 32, 8), (1, 4096, 32, 32), (1, 131072, 32, 32), (16, 32768, 32, 32))


def ragged_linear_shape() -> Shape:
    """B=16, lengths evenly spaced 1K..128K (torch.linspace(1024, 131072, 16).int()), GQA 32/8,
    D 128, paged page_size 16: a serving batch of mixed lengths."""
    return make_shape(16, linear_lengths(16, 1024, 131072), 32, 8, page_size=16, tags=("ragged", "paged"),
                      spacing="lin")


def paged_peer_shapes() -> list[Shape]:
    # the FlashInfer rows of PEERS.md, so the paged peer is compared where it was measured
    return [make_shape(B, L, Hq, Hkv, page_size=16, tags=("paged",)) for B, L, Hq, Hkv in PEERS_MD_PAGED]


# (B, L, Hq, Hkv) of the fp8 KV rows: >= 256 MB of bf16 K+V each
FP8_SHAPES = ((1, 131072, 32, 8), (16, 32768, 32, 8), (1, 32768, 32, 32))


def fp8_shapes(with_bf16: bool = False) -> list[Shape]:
    out = []
    for (B, L, Hq, Hkv), ps in ((s, p) for s in FP8_SHAPES for p in (None, 16)):
        for kv in (("", "fp8_e4m3") if with_bf16 else ("fp8_e4m3",)):
            out.append(make_shape(B, L, Hq, Hkv, page_size=ps, kv_dtype=kv, tags=("fp8",) if kv else ()))
    return out


def fp8_suite() -> list[Shape]:
    return fp8_shapes(with_bf16=True)


def variants_suite() -> list[Shape]:
    out = []
    for ps in (None, 16):
        for L, kw in ((4096, {}), (131072, dict(window_left=4095)), (131072, {}), (32768, {}),
                      (32768, dict(softcap=30.0)), (32768, dict(sinks=True)), (32768, dict(alibi=True))):
            out.append(make_shape(1, L, 32, 8, page_size=ps, tags=("variant",), **kw))
        for B, D in ((16, 80), (16, 96), (16, 128), (1, 192), (1, 256)):
            out.append(make_shape(B, 32768, 32, 8, D, page_size=ps, tags=("headdim",)))
    return out


def headline_suite() -> list[Shape]:
    out = [make_shape(B, L, Hq, Hkv, tags=("grid",)) for B, L, Hq, Hkv in PEERS_MD_SDPA]
    ragged = make_shape(16, spread_lengths(16, 1024, 131072), 32, 8, page_size=16, tags=("ragged", "paged"))
    return out + paged_peer_shapes() + [ragged, ragged_linear_shape(), full_gpu_ragged_shape()] + fp8_shapes()


def full_gpu_ragged_shape() -> Shape:
    """B=32, lengths 1K..128K spread geometrically, GQA 32/8, paged 16: a ragged batch whose
    B x KV heads (256) already fills the GPU's SMs (heuristics: the work-list rule, `listed`)."""
    return make_shape(32, spread_lengths(32, 1024, 131072), 32, 8, page_size=16, tags=("ragged", "paged"))


def full_suite() -> list[Shape]:
    out = peers_suite() + paged_peer_shapes()
    for B, L, Hq, Hkv in ((1, 32768, 32, 8), (16, 4096, 32, 8), (1, 131072, 64, 8)):
        out.append(make_shape(B, L, Hq, Hkv, q_len=4, tags=("spec",)))
    ragged = spread_lengths(16, 1024, 131072)
    out.append(make_shape(16, ragged, 32, 8, tags=("ragged",)))
    out.append(make_shape(16, ragged, 32, 8, page_size=16, tags=("ragged", "paged")))
    out.append(ragged_linear_shape())
    out.append(full_gpu_ragged_shape())
    for B, L, Hq, Hkv, D in ((1, 32768, 32, 8, 64), (16, 4096, 32, 32, 64), (1, 32768, 32, 8, 256),
                             (16, 4096, 32, 32, 256)):
        out.append(make_shape(B, L, Hq, Hkv, D, tags=("headdim",)))
    return out + fp8_shapes()


def quick_suite() -> list[Shape]:
    out = [make_shape(B, L, 4, 2, 64, tags=("grid",)) for B in (1, 2) for L in (256, 1024)]
    out.append(make_shape(2, 300, 4, 1, 64, page_size=16, tags=("paged",)))
    out.append(make_shape(2, 200, 8, 2, 64, q_len=4, tags=("spec",)))
    out.append(make_shape(3, (17, 401, 130), 4, 1, 64, tags=("ragged",)))
    out.append(make_shape(3, linear_lengths(3, 17, 401), 4, 1, 64, page_size=16, tags=("ragged", "paged"),
                          spacing="lin"))
    out.append(make_shape(2, 333, 4, 2, 64, page_size=16, kv_dtype="fp8_e4m3", tags=("fp8",)))
    out.append(make_shape(2, 700, 4, 2, 64, window_left=200, softcap=20.0, sinks=True, tags=("variant",)))
    return out


def cpu_suite() -> list[Shape]:
    """The CPU demo's decode shapes (splitkv/demo.py): where the torch backend is compared with SDPA
    on a CPU (`--device cpu --providers splitkv-torch-noplan,sdpa-flash`)."""
    return [make_shape(1, 4096, 32, 8, 128, tags=("cpu",)), make_shape(1, 16384, 32, 8, 128, tags=("cpu",)),
            make_shape(1, 16384, 32, 8, 128, page_size=16, tags=("cpu", "paged"))]


SUITES = {"full": full_suite, "peers": peers_suite, "headline": headline_suite, "fp8": fp8_suite,
          "variants": variants_suite, "quick": quick_suite, "cpu": cpu_suite}

# --num-splits sweep runs on these (globs): where the planner decides something (B x Hkv below the
# SM count) and a wrong split count costs the most — small batch, GQA, long context.
SWEEP_DEFAULT = {
    "full": ("b1-l4k-h32x8-d128", "b1-l32k-h32x8-d128", "b1-l128k-h32x8-d128", "b4-l32k-h32x8-d128",
             "b1-l128k-h32x32-d128", "b1-l32k-h64x8-d128"),
    "quick": ("b1-l1k-h4x2-d64",),
}
SWEEP_DEFAULT["peers"] = SWEEP_DEFAULT["headline"] = SWEEP_DEFAULT["full"]


def suite(name: str) -> list[Shape]:
    if name not in SUITES:
        raise ValueError(f"suite: expected one of {tuple(SUITES)}, got {name!r}")
    return SUITES[name]()


def select(shapes: list[Shape], patterns: str | None) -> list[Shape]:
    """Shapes whose name matches any comma-separated glob (an exact name is a glob too)."""
    if not patterns:
        return list(shapes)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [s for s in shapes if any(fnmatch.fnmatchcase(s.name, p) for p in pats)]
