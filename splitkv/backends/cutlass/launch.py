"""Launch glue of the CuTe DSL backend: compile (cached), check what the kernels assume, pack the
arguments, launch. No decisions: the tile (block_m, block_n, stages), the split table and whether
the merge is fused all come from the plan (splitkv/plan.py, from heuristics.py).

Three levels, as everywhere in splitkv: compile_split / compile_merge (cached compile) ->
split_ / merge_ (out-parameter ops) -> run / merge (the backend contract).
"""

import functools

import torch

from splitkv.backends.cutlass import rows_aligned
from splitkv.backends.cutlass.argpack import Packer
from splitkv.backends.cutlass.cache import CACHE
from splitkv.backends.cutlass.config import HEAD_DIMS, MergeConfig, SplitConfig, merge_elems_per_lane
from splitkv.constants import LOG2E

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# the split kernel's leading pointer arguments: q, k, v, lens, num_splits, chunks, table, o_part,
# lse_part, out, lse, counters, sinks, alibi, k_scales, v_scales (what a bound launch passes per call)
N_POINTERS = 16
MERGE_POINTERS = 6  # o_part, lse_part, num_splits, out, lse, sinks: the merge launch's leading arguments
_KV_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}  # SplitConfig.kv_fp8 of a cache dtype
_PACKERS: dict[tuple[str, str], Packer] = {}


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if major >= 9 else ""  # sm_90a / sm_100a: the arch-specific targets
    return f"sm_{major}{minor}{suffix}"


def fake_split_args():
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    return ([Int64(0)] * N_POINTERS + [Int32(0)] * 11 + [Int64(0)] * 24 + [Float32(0.0)] * 3
            + [cute.runtime.make_fake_stream()])


def fake_merge_args():
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    return [Int64(0)] * MERGE_POINTERS + [Int32(0)] * 5 + [Int64(0)] * 14 + [cute.runtime.make_fake_stream()]


def build_split(cfg: SplitConfig):
    from splitkv.backends.cutlass.split_kernel import SplitKernel

    return SplitKernel(cfg), fake_split_args()


def build_merge(cfg: MergeConfig):
    from splitkv.backends.cutlass.merge_kernel import MergeKernel

    return MergeKernel(cfg), fake_merge_args()


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> str:
    return arch_of(torch.device("cuda", index))


@functools.lru_cache(maxsize=None)
def _split_launcher(dtype: str, head_dim: int, block_m: int, block_n: int, stages: int, paged: bool,
                    mods: tuple, arch: str) -> Packer:
    return compile_split(SplitConfig(dtype, head_dim, block_m, block_n, stages, paged, *mods), arch)


def variant_flags(variant, kv_dtype=None) -> tuple:
    """(softcap, alibi, window, kv_fp8): what of a call is compiled into its split kernel
    (SplitConfig): the variant's options and the fp8 format of a cache of kv_dtype."""
    fp8 = _KV_FP8.get(kv_dtype, "")
    if variant is None:
        return (False, False, False, fp8)
    return (variant.softcap > 0, variant.alibi_slopes is not None, variant.windowed, fp8)


def variant_pointers(variant) -> tuple[int, int, int, int]:
    """(sinks, ALiBi slopes, k_scales, v_scales) data pointers of a launch, 0 where the call has
    none (fp8 scales: per KV head only; per-tensor ones are scalars)."""
    if variant is None:
        return 0, 0, 0, 0
    return tuple(t.data_ptr() if t is not None else 0 for t in variant.tensors())


def variant_scalars(variant, scale: float) -> tuple:
    """(win_left, win_right, scale_log2, pre_mul, v_mul) of a launch (score_mod.py: softcap moves
    the scale inside tanh; an unbounded window side is a large number; a per-tensor fp8 k_scale
    folds into scale_log2, v_scale is v_mul)."""
    left, right = variant.window_bounds() if variant is not None else (0, 0)
    cap = variant.softcap if variant is not None else 0.0
    v_mul = 1.0
    if variant is not None and variant.fp8 == "tensor":
        scale, v_mul = float(scale) * variant.k_scale, float(variant.v_scale)
    if cap > 0:
        return left, right, cap * LOG2E, float(scale) / cap, v_mul
    return left, right, float(scale) * LOG2E, 1.0, v_mul


@functools.lru_cache(maxsize=None)
def _merge_launcher(part_dtype: str, out_dtype: str, head_dim: int, arch: str) -> Packer:
    return compile_merge(MergeConfig(part_dtype, out_dtype, head_dim), arch)


def _launcher(cfg, arch: str, build) -> Packer:
    key = (cfg.name, arch)
    p = _PACKERS.get(key)
    if p is None:
        p = _PACKERS[key] = Packer(CACHE.get(cfg.name, arch, lambda: build(cfg)))
    return p


def compile_split(cfg: SplitConfig, arch: str) -> Packer:
    return _launcher(cfg, arch, build_split)


def compile_merge(cfg: MergeConfig, arch: str) -> Packer:
    return _launcher(cfg, arch, build_merge)


_STREAMS: dict[int, object] = {}


def _stream(index: int):
    """The current torch stream as a cuda.CUstream (one object per raw handle, reused)."""
    handle = torch._C._cuda_getCurrentRawStream(index)
    s = _STREAMS.get(handle)
    if s is None:
        import cuda.bindings.driver as cuda

        s = _STREAMS[handle] = cuda.CUstream(handle)
    return s


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _check_rows(name: str, t: torch.Tensor, align: int) -> None:
    """The kernels move rows with 16-byte (8-byte for 4 x 16-bit outputs) vector accesses."""
    if not rows_aligned(t, align):
        raise ValueError(f"{name}: backend 'cutlass' needs unit stride on the last dim and {align}-byte aligned "
                         f"rows (pointer and strides); got strides {tuple(t.stride())}, data_ptr % {align} = "
                         f"{t.data_ptr() % align}. Use backend='triton' for this layout.")


def split_(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
           *, cfg: SplitConfig | None = None, fuse: bool | None = None, variant=None):
    """Out-parameter split op: writes out/lse for one-split requests, o_part/lse_part otherwise;
    with fuse (default: plan.fuse) the last split CTA of each tile also writes out/lse.
    cfg overrides the config (tile sweeps); its block_m must be the plan's. variant: a checked
    splitkv.variants.Variant (window, softcap, sinks, ALiBi), or None (plain)."""
    launch, args = _split_args(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse,
                               scale, causal, cfg=cfg, fuse=fuse, variant=variant)
    launch(*args)


def _split_args(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
                *, cfg: SplitConfig | None = None, fuse: bool | None = None, variant=None):
    """(launcher, its arguments) of split_, after the checks: N_POINTERS pointers, the scalars, the stream."""
    B, Sq, Hq, D = q.shape
    paged = block_table is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_rows(name, t, 16)
    _check_rows("out", out, 8)
    if o_part is not None:
        _check_rows("o_part", o_part, 16)
    if lse.stride(2) != 1 or (lse_part is not None and lse_part.stride(3) != 1):
        raise ValueError("lse/lse_part: backend 'cutlass' needs unit stride on the token (last) dim")
    index = _device_index(q)
    arch = _arch(index)
    tile = plan.tile
    mods = variant_flags(variant, k_cache.dtype)
    if cfg is None:
        launch = _split_launcher(_DTYPE_NAMES[q.dtype], D, tile.block_m, tile.block_n, tile.num_stages, paged, mods,
                                 arch)
    elif ((cfg.block_m, cfg.head_dim, cfg.paged, cfg.dtype, (cfg.softcap, cfg.alibi, cfg.window, cfg.kv_fp8))
          != (plan.tile.block_m, D, paged, _DTYPE_NAMES[q.dtype], mods)):
        raise ValueError(f"cfg: {cfg} does not match the plan / inputs")
    else:
        launch = compile_split(cfg, arch)
    parts = o_part is not None
    fuse = plan.fuse if fuse is None else fuse
    fuse = fuse and parts and plan.counters is not None
    op = o_part if parts else out  # never written when no request splits
    lp = lse_part if parts else lse
    p_strides = o_part.stride()[:4] if parts else (0, 0, 0, 0)
    l_strides = lse_part.stride()[:3] if parts else (0, 0, 0)
    bt = block_table if paged else cache_seqlens  # any int32 tensor: never read when not paged
    left, right, scale_log2, pre_mul, v_mul = variant_scalars(variant, scale)
    work = plan.work  # a work list (plan.build: only with work_items): the grid is one CTA per item
    grid_b, grid_s = (1, plan.work_items) if work is not None else (B, plan.max_splits)
    return launch, [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr(),
                     plan.num_splits.data_ptr(), plan.chunk_lens.data_ptr(), bt.data_ptr(), op.data_ptr(),
                     lp.data_ptr(), out.data_ptr(), lse.data_ptr(), plan.counters.data_ptr() if fuse else 0,
                     *variant_pointers(variant),
                     grid_s, grid_b, plan.num_kv_heads, plan.m_tiles, plan.qhead_per_kvhead, Sq,
                     k_cache.shape[1] if paged else 1, int(bool(causal and Sq > 1)), int(fuse), left, right,
                     *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], bt.stride(0) if paged else 0,
                     *p_strides, *l_strides, *out.stride()[:3], *lse.stride()[:2],
                     work.data_ptr() if work is not None else 0, work.stride(0) if work is not None else 0,
                     scale_log2, pre_mul, v_mul, _stream(index)]


def merge_(o_part, lse_part, num_splits, out, lse, *, skip_single=False, cfg: MergeConfig | None = None,
           sinks=None):
    """Out-parameter merge op: out [B, T, H, D], lse [B, H, T] <- merge of the partials (sinks:
    float32 [H] attention-sink logits joined to each row once, or None)."""
    S, B, H, T, D = o_part.shape
    if B * H * T == 0:
        return
    if o_part.dtype not in _DTYPE_NAMES or out.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"o_part/out: backend 'cutlass' merges fp32/fp16/bf16 partials into fp16/bf16, "
                        f"got {o_part.dtype} -> {out.dtype}")
    if lse_part.dtype != torch.float32 or lse.dtype != torch.float32:
        raise TypeError(f"lse_part/lse: expected float32, got {lse_part.dtype} / {lse.dtype}")
    if D not in HEAD_DIMS:
        raise ValueError(f"o_part: backend 'cutlass' merges head dims {HEAD_DIMS}, got {D}")
    per_lane = merge_elems_per_lane(D)  # contiguous elements per lane, moved in <= 16-byte vectors
    _check_rows("o_part", o_part, min(16, per_lane * o_part.element_size()))
    _check_rows("out", out, min(16, per_lane * out.element_size()))
    index = _device_index(out)
    arch = _arch(index)
    if cfg is None:
        launch = _merge_launcher(_DTYPE_NAMES[o_part.dtype], _DTYPE_NAMES[out.dtype], D, arch)
    elif (cfg.part_dtype, cfg.out_dtype, cfg.head_dim) != (_DTYPE_NAMES[o_part.dtype], _DTYPE_NAMES[out.dtype], D):
        raise ValueError(f"cfg: {cfg} does not match the inputs")
    else:
        launch = compile_merge(cfg, arch)
    launch(o_part.data_ptr(), lse_part.data_ptr(), num_splits.data_ptr(), out.data_ptr(), lse.data_ptr(),
           sinks.data_ptr() if sinks is not None else 0, *_merge_scalars(o_part, lse_part, out, lse, skip_single),
           _stream(index))


def _merge_scalars(o_part, lse_part, out, lse, skip_single) -> tuple:
    """The merge launch's arguments after its pointers, before the stream."""
    S, B, H, T, _ = o_part.shape
    return (S, B, H, T, int(skip_single), *o_part.stride()[:4], *lse_part.stride(), out.stride(0), out.stride(1),
            out.stride(2), *lse.stride())


def _bound_merge(plan, out, lse):
    """comb(stream, o_part, lse_part, num_splits, out, lse, sinks pointers): the plan's merge launch
    (skip_single) with its scalars bound for calls laid out as out / lse; None where only merge_ can
    launch (the DSL's own packing)."""
    o_part = plan.o_part
    launch = _merge_launcher(_DTYPE_NAMES[o_part.dtype], _DTYPE_NAMES[out.dtype], o_part.shape[-1],
                             _arch(out.device.index))
    return launch.bind(_merge_scalars(o_part, plan.lse_part, out, lse, True), MERGE_POINTERS)


def run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
        variant=None):
    """The backend contract (see splitkv.backends): split kernel, then merge for split requests."""
    if q.shape[0] == 0:
        return
    if q.device.type != "cuda":
        raise ValueError(f"q: backend 'cutlass' needs CUDA tensors, got {q.device}")
    args = (q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal, variant)
    if q.device.index == torch.cuda.current_device():  # the DSL launches on the current device
        return _run(*args)
    with torch.cuda.device(q.device):
        _run(*args)


def _call_key(q, k_cache, v_cache, block_table, out, scale, causal, qkv_bits: int, out_bits: int, variant) -> tuple:
    vkey = variant.kernel_key() if variant is not None else None
    return ("cutlass", q.stride(), k_cache.shape[1], k_cache.stride(), v_cache.stride(), out.stride(),
            block_table.stride(0) if block_table is not None else -1, causal, scale, q.dtype, k_cache.dtype, qkv_bits,
            out_bits, vkey)


def _run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
         variant=None):
    # per plan, call layout and variant (strides, alignment, scalars): checked and packed once, then a hit
    # passes the call's pointers and the remembered scalars (lse is always a contiguous [B, Hq, Sq])
    paged = block_table is not None
    bt = block_table if paged else cache_seqlens
    ptr_q, ptr_k, ptr_v, ptr_o = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
    key = _call_key(q, k_cache, v_cache, block_table, out, scale, causal, (ptr_q | ptr_k | ptr_v) & 15, ptr_o & 7,
                    variant)
    hit = plan.launches.entries.get(key)
    sinks = variant.sinks if variant is not None else None
    if hit is None:
        launch, args = _split_args(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out,
                                   lse, scale, causal, variant=variant)
        plan.launches.entries[key] = (launch, tuple(args[N_POINTERS:-1]))
        launch(*args)
    else:
        launch, mid = hit
        parts = o_part is not None
        launch(ptr_q, ptr_k, ptr_v, cache_seqlens.data_ptr(), plan.num_splits.data_ptr(), plan.chunk_lens.data_ptr(),
               bt.data_ptr(), o_part.data_ptr() if parts else ptr_o, lse_part.data_ptr() if parts else lse.data_ptr(),
               ptr_o, lse.data_ptr(), plan.counters.data_ptr() if plan.fuse and parts else 0,
               *variant_pointers(variant), *mid,
               _stream(q.device.index))
    if o_part is not None and not plan.fuse:
        merge_(o_part, lse_part, plan.num_splits, out, lse, skip_single=True, sinks=sinks)


def merge(o_part, lse_part, num_splits, out, lse, *, skip_single=False, sinks=None):
    if out.device.type != "cuda":
        raise ValueError(f"out: backend 'cutlass' needs CUDA tensors, got {out.device}")
    with torch.cuda.device(out.device):
        merge_(o_part, lse_part, num_splits, out, lse, skip_single=skip_single, sinks=sinks)


def bind(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal, variant=None):
    """launch(stream, q, k, v, lens, table, out, lse data pointers[, vptrs]; table = lens when not
    paged; vptrs: a variant call's Variant.pointers() — sinks, ALiBi slopes, per-head fp8 scales —
    passed per call)
    for calls laid out as this one, which run() has launched (checked, compiled) already, with
    16-byte aligned pointers (the caller checks each call's); None where only run() can launch
    (another current device, the DSL's own packing). Where the merge is not fused, the launch
    runs the split kernel, then the merge kernel, both bound."""
    if q.shape[0] == 0 or q.device.index != torch.cuda.current_device():
        return None
    hit = plan.launches.entries.get(_call_key(q, k_cache, v_cache, block_table, out, scale, causal, 0, 0, variant))
    if hit is None:
        return None
    split = hit[0].bind(hit[1], N_POINTERS)
    if split is None:
        return None
    ns, ch = plan.num_splits.data_ptr(), plan.chunk_lens.data_ptr()
    if plan.o_part is None:
        def launch(stream, qp, kp, vp, lens, bt, o, lse_p, vptrs=None):
            split(stream, qp, kp, vp, lens, ns, ch, bt, o, lse_p, o, lse_p, 0, *(vptrs or (0, 0, 0, 0)))

        return launch
    op, lp = plan.o_part.data_ptr(), plan.lse_part.data_ptr()
    if plan.fuse:
        cnt = plan.counters.data_ptr()

        def launch(stream, qp, kp, vp, lens, bt, o, lse_p, vptrs=None):
            split(stream, qp, kp, vp, lens, ns, ch, bt, op, lp, o, lse_p, cnt, *(vptrs or (0, 0, 0, 0)))

        return launch
    comb = _bound_merge(plan, out, lse)
    if comb is None:
        return None

    def launch(stream, qp, kp, vp, lens, bt, o, lse_p, vptrs=None):
        vt = vptrs or (0, 0, 0, 0)
        split(stream, qp, kp, vp, lens, ns, ch, bt, op, lp, o, lse_p, 0, *vt)
        comb(stream, op, lp, ns, o, lse_p, vt[0])  # vt[0]: the sinks, joined to each row by the merge

    return launch
