"""DecodePlan: the one object that decides what a decode call runs.

A plan is built once from the problem's shapes (validate.Problem, or plan()'s arguments) and a bound
on the lengths, and then only launches. It fixes: the backend (`auto` fully resolved), the kernel
tile of that backend (heuristics), the split rule and the grid's split dimension (`max_splits`),
fuse/no-fuse of the merge, the workspace and the merge counters. It holds one device tensor per
step, `sched` (int32 [2, B]: num_splits and chunk_lens per request; for a Triton plan whose grid
is a work list, also `work`, the (request, split) of each CTA), written by `refresh` from the
actual lengths ON THE DEVICE (backends/triton/schedule_kernel.py; heuristics.schedule on the CPU):
no host read of cache_seqlens, so every plan is CUDA-graph safe and balances a ragged batch from its
actual lengths, eager or replayed.

Split s of request b covers keys [s * chunk_lens[b], min((s+1) * chunk_lens[b], L_b)); the last
split (s = num_splits[b] - 1) runs on to L_b, so a stale table (lengths changed, refresh not called)
costs balance, never correctness. Kernels read these tensors; they decide nothing about splitting.

A plan, its workspace and its counters belong to one stream at a time (decode() without a plan keeps
one plan per input signature and stream, or per thread on the CPU).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from . import backends, capture, validate
from . import heuristics as H
from . import workspace as W
from .constants import FP8_HEAD_DIMS as CUTLASS_FP8_HEAD_DIMS
from .constants import HEAD_DIMS as CUTLASS_HEAD_DIMS
from .variants import FP8_DTYPES, PLAIN, PLAIN_KEY, Variant
from .variants import make as make_variant


def _bound():
    from .backends.triton.fastlaunch import Bound  # no triton import: plain Python

    return Bound()


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device) -> str:
    """The CUDA device's name ("" for any other device): the few device-specific rules read it."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())
    return ""


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return H.CPU_NUM_SMS


@dataclass(frozen=True, eq=False)
class DecodePlan:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_len: int
    dtype: torch.dtype | None  # None: fp16 or bf16 (plan() without dtype=)
    paged: bool
    max_seqlen: int  # the length bound the grid is sized for
    device: torch.device
    backend: str  # "torch" | "triton" | "cutlass", resolved
    auto: bool  # the backend was chosen by backend="auto"
    tile: H.TileConfig  # of that backend; num_stages as launched (paged extra stages included)
    m_tiles: int
    rule: H.SplitRule
    fuse: bool  # the split kernel merges the splits itself (no merge launch)
    batch_invariant: bool
    sched: torch.Tensor  # int32 [2, >= B] on device: num_splits, chunk_lens
    counters: torch.Tensor | None  # int32 arrival counters of the fused merge, zero between launches
    o_part: torch.Tensor | None  # fp32 [S, B, Hq, Sq, D], None when no request can split
    lse_part: torch.Tensor | None  # fp32 [S, B, Hq, Sq]
    lse_scratch: torch.Tensor  # fp32 [B, Hq, Sq]: the lse of calls that do not return it
    variant_key: tuple = PLAIN_KEY  # the attention variant it was made for (splitkv.variants)
    # int32 [2, items] (rows 16-byte aligned): the split kernel's work list (Triton and CuTe),
    # (request, split) per CTA column, written with sched (heuristics.work_items / work_list); None: a (split, request) grid
    work: torch.Tensor | None = None
    work_items: int = 0
    # the Triton split kernel may find pages by tile (heuristics.aligned_page_lookup; its launch also
    # checks the call's page size against the rule's block_n)
    aligned_pages: bool = False
    # (weakref, _version, capture.token) of the lengths tensor the table was last computed from, and
    # where that schedule went (None: eagerly; else the CUDA-graph capture it was recorded into)
    last_lengths: list = field(default_factory=lambda: [None], repr=False)
    launches: object = field(default_factory=lambda: _bound(), repr=False)  # the Triton launch cache
    checked: list = field(default_factory=lambda: [None], repr=False)  # the last Problem check_call passed
    # held from a call's schedule through its last launch: threads on one stream share a plan (its
    # split table, partials and bound argument slots), so their launch sequences must not interleave
    lock: object = field(default_factory=threading.Lock, repr=False)
    # [True] once a call ran it under CUDA-graph capture: a graph may replay into its workspace, so
    # decode()'s own plan cache never evicts it (execute.MAX_PLANS)
    captured: list = field(default_factory=lambda: [False], repr=False)
    num_splits: torch.Tensor = field(init=False, repr=False)  # int32 [B] views of sched, made once
    chunk_lens: torch.Tensor = field(init=False, repr=False)
    module: object = field(init=False, repr=False)  # the backend module that runs it

    def __post_init__(self):
        object.__setattr__(self, "num_splits", self.sched[0, : self.batch])
        object.__setattr__(self, "chunk_lens", self.sched[1, : self.batch])
        object.__setattr__(self, "module", backends.get(self.backend))

    @property
    def max_splits(self) -> int:
        return self.rule.max_splits

    @property
    def forced(self) -> int | None:
        return self.rule.splits if self.rule.mode == "forced" else None

    @property
    def graph_safe(self) -> bool:
        """Every plan is: its split table is computed on the device."""
        return True

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def partials(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(o_part, lse_part) workspace views, or (None, None) when no request can split."""
        return self.o_part, self.lse_part

    def refresh(self, cache_seqlens: torch.Tensor) -> None:
        """Recompute the split table from these lengths, on their device (capturable, no sync).

        decode() without a plan does this at every call; with a plan, call it once per step (the
        plan() call did it for the lengths it was given). Results never depend on it: a stale table
        only costs balance."""
        if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
            raise ValueError("cache_seqlens: expected a 1-D int32 tensor [B]")
        if cache_seqlens.shape[0] != self.batch or cache_seqlens.dtype != torch.int32:
            raise ValueError(f"cache_seqlens: the plan is for int32 [{self.batch}], got "
                             f"{cache_seqlens.dtype} {list(cache_seqlens.shape)}")
        if cache_seqlens.device != self.device:
            raise ValueError(f"cache_seqlens: on {cache_seqlens.device}, the plan is for {self.device}")
        self.schedule(cache_seqlens)

    def schedule_if_new(self, cache_seqlens: torch.Tensor) -> None:
        """schedule(), skipped when these are the very lengths of the last schedule, unmodified since
        (the same tensor object, alive all along, with the same version counter) and that schedule
        ran where this call runs: eagerly, or recorded earlier in the same CUDA-graph capture
        (splitkv.capture). So the layers of one step share one launch, eager or captured. A write
        the counter misses (a raw kernel writing the lengths) leaves a stale table, which costs
        balance only."""
        last = self.last_lengths[0]
        where = capture.token(self.device)  # a fresh token (capture id unreadable) equals nothing
        if where is not None:
            self.captured[0] = True
        if last is not None and last[0]() is cache_seqlens and last[1] == cache_seqlens._version and where == last[2]:
            return
        self.schedule(cache_seqlens)
        self.last_lengths[0] = (weakref.ref(cache_seqlens), cache_seqlens._version, where)

    def schedule(self, cache_seqlens: torch.Tensor) -> None:
        """refresh() without the checks (decode has validated the lengths)."""
        self.last_lengths[0] = None
        if self.rule.max_splits == 1:
            return  # sched was filled once: one split per request, whatever the lengths
        if self.device.type == "cuda" and backends.triton_available():
            from .backends.triton.launch import schedule

            schedule(cache_seqlens, self.sched, self.rule, self.launches, self.work)
        else:
            n, chunk = H.schedule(cache_seqlens, self.rule)
            self.num_splits.copy_(n)
            self.chunk_lens.copy_(chunk)
            if self.work is not None:
                self.work.copy_(H.work_list(n, self.work_items))

    def check_call(self, prob: validate.Problem, backend: str, device: torch.device) -> None:
        """The call must be the problem the plan was made for; each mismatch is named."""
        self._check_shape((prob.batch, prob.num_q_heads, prob.num_kv_heads, prob.head_dim, prob.q_len), device,
                          prob.dtype)
        if self.backend != "torch" and prob.dtype not in validate.LOW_DTYPES:
            raise ValueError(f"plan: runs backend {self.backend!r}, which takes float16 or bfloat16, got {prob.dtype}")
        self._check_route(prob.page_size is not None, backend)

    def check_traced(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None, backend: str,
                     variant: Variant) -> None:
        """check_call for a call traced by torch.compile, from the shapes alone (the compiled call
        runs the custom op, which validates the rest when it runs)."""
        if q.dim() != 4 or k_cache.dim() != 4:
            raise ValueError(f"q / k_cache: expected 4-D tensors, got {q.dim()}-D / {k_cache.dim()}-D")
        self._check_shape((q.shape[0], q.shape[2], k_cache.shape[2], q.shape[3], q.shape[1]), q.device, q.dtype)
        self._check_route(block_table is not None, backend)
        self.check_variant(variant)

    def _check_shape(self, got: tuple, device: torch.device, dtype: torch.dtype) -> None:
        want = (self.batch, self.num_q_heads, self.num_kv_heads, self.head_dim, self.q_len)
        if got != want:
            raise ValueError(f"plan: made for (B, Hq, Hkv, D, Sq) = {want}, but the inputs have {got}")
        if device != self.device:
            raise ValueError(f"plan: made for {self.device}, but the inputs are on {device}")
        if self.dtype is not None and dtype != self.dtype:
            raise ValueError(f"plan: made for {self.dtype}, but q is {dtype}")

    def _check_route(self, paged: bool, backend: str) -> None:
        if paged != self.paged:
            what = ("a paged cache (block_table)", "a contiguous cache (no block_table)")
            raise ValueError(f"plan: made for {what[not self.paged]}, but the call passes {what[self.paged]}; "
                             f"make it with splitkv.plan(..., paged={paged})")
        if backend not in ("auto", self.backend):
            raise ValueError(f"plan: made for backend {self.backend!r}, but the call asks for {backend!r}; "
                             f"make it with splitkv.plan(..., backend={backend!r})")

    def check_options(self, num_splits: int | None, batch_invariant: bool) -> None:
        """num_splits / batch_invariant passed to a call with this plan: the plan's own or none."""
        if num_splits is not None and num_splits != self.forced:
            runs = f"forces {self.forced} splits" if self.forced is not None else "chooses its split counts"
            raise ValueError(f"num_splits: the plan {runs} (a count past what the longest request can use is cut "
                             f"to it), so pass num_splits to splitkv.plan(...) only, not together with plan=")
        if not self.admits(batch_invariant):
            raise ValueError("batch_invariant: pass it to splitkv.plan(...), not together with plan=")

    def admits(self, batch_invariant: bool) -> bool:
        """Whether a call's batch_invariant flag fits this plan: a batch-invariant plan takes either, another only False
        (check_options raises where it does not; the lean path in execute.decode_eager falls back to it)."""
        return self.batch_invariant or not batch_invariant

    def check_variant(self, variant: Variant) -> None:
        if variant.key() != self.variant_key:
            names = ("window_left", "window_right", "softcap", "sinks given", "alibi_slopes given", "fp8 scales")
            want = dict(zip(names, self.variant_key))
            got = dict(zip(names, variant.key()))
            raise ValueError(f"plan: made for the variant {want}, but the call has {got}; pass the same "
                             f"window_size / softcap / sinks / alibi_slopes / kv_dtype, k_scale, v_scale to "
                             f"splitkv.plan(...)")

    def describe(self) -> str:
        r = self.rule
        how = {"auto": f"balanced on device, <= {r.target} CTAs/group (ragged {r.ragged_target})",
               "forced": f"forced {r.splits}", "fixed": f"batch-invariant chunk {r.chunk_tiles * r.block_n}"}[r.mode]
        return (f"DecodePlan[{self.backend}{'(auto)' if self.auto else ''}] B={self.batch} "
                f"Hq/Hkv={self.num_q_heads}/{self.num_kv_heads} D={self.head_dim} Sq={self.q_len} "
                f"{'paged' if self.paged else 'contiguous'} max_seqlen={self.max_seqlen} tile={self.tile} "
                f"m_tiles={self.m_tiles} max_splits={self.max_splits} ({how}) "
                f"grid={'work list of ' + str(self.work_items) + ' items' if self.work is not None else 'B x max_splits'} "
                f"fuse={self.fuse}")


def _rule(backend: str, prob: validate.Problem, *, num_splits, batch_invariant, num_sms, span_cap) -> tuple:
    """(tile, m_tiles, rule) of `backend` for this problem."""
    rows = prob.qhead_per_kvhead * prob.q_len
    tile = H.tile_config(prob.head_dim, rows, kv_fp8=prob.kv_fp8)  # the split tile: its block_n sizes the rule
    m_tiles = H.query_tiles(rows, tile.block_m)
    groups = prob.num_kv_heads * m_tiles
    bps = H.blocks_per_sm(backend, prob.page_size is not None, prob.head_dim, tile.block_m, prob.kv_fp8)
    rule = H.split_rule(batch=prob.batch, groups_per_request=groups, block_n=tile.block_n,
                        max_seqlen=prob.max_seqlen, num_sms=num_sms, blocks_per_sm=bps,
                        num_splits=num_splits, batch_invariant=batch_invariant, span_cap=span_cap)
    return tile, m_tiles, rule


def _choose_backend(backend: str, prob: validate.Problem, device, layout_ok, variant, **kw) -> tuple[str, bool]:
    """backend="auto": torch on the CPU; on CUDA, cutlass where heuristics.auto_prefers_cutlass
    takes the plan (sm90, the CuTe DSL installed, a layout, head dim and variant it takes), Triton
    otherwise."""
    fp8_ok = prob.head_dim in CUTLASS_FP8_HEAD_DIMS and variant.softcap == 0 and variant.alibi_slopes is None
    cutlass_ok = prob.head_dim in CUTLASS_HEAD_DIMS and (fp8_ok if prob.kv_fp8 else variant.fp8 is None)
    if backend == "cutlass" and not cutlass_ok:  # before resolve(): this error holds on any machine
        got = f"head dim {prob.head_dim}"
        if prob.head_dim in CUTLASS_HEAD_DIMS and prob.kv_fp8:  # the head dim is not what it lacks
            got = ("softcap" if variant.softcap else "alibi_slopes") if prob.head_dim in CUTLASS_FP8_HEAD_DIMS \
                else f"head dim {prob.head_dim} with an fp8 cache"
        raise ValueError(f"backend: 'cutlass' runs head dims {CUTLASS_HEAD_DIMS} (fp8 caches: {CUTLASS_FP8_HEAD_DIMS}, "
                         f"without softcap / ALiBi); got {got}: use backend='triton' or 'auto'")
    name = backends.resolve(backend, device)
    if name == "cutlass" and not cutlass_ok:  # SPLITKV_BACKEND=cutlass over 'auto': what it cannot run goes to triton
        name = "triton"
    if (backend != "auto" or name != "triton" or not backends.auto_cutlass_here(device) or not layout_ok
            or not cutlass_ok):
        return name, backend == "auto"
    if prob.kv_fp8:
        return ("cutlass" if H.auto_prefers_cutlass_fp8(prob.page_size is not None, prob.q_len, prob.head_dim,
                                                         device_name(device)) else "triton"), True
    tile, _, rule = _rule("cutlass", prob, **kw)
    return ("cutlass" if kw["batch_invariant"] or H.auto_prefers_cutlass(rule.max_splits, tile.block_m)
            else "triton"), True


def build(prob: validate.Problem, device, *, backend: str = "auto", num_splits: int | None = None,
          batch_invariant: bool = False, num_sms: int | None = None, layout_ok: bool = True,
          dtype_bound: bool = True, variant: Variant = PLAIN) -> DecodePlan:
    """A plan for this problem (prob.max_seqlen is the length bound). layout_ok: the inputs'
    layout is one the cutlass kernels take (auto only). dtype_bound: the plan checks prob.dtype.
    variant: the attention variant of the calls (a sliding window bounds the keys it splits)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    span_cap = variant.span_cap(prob.q_len)
    kw = dict(num_splits=num_splits, batch_invariant=batch_invariant,
              num_sms=num_sms if num_sms is not None else device_num_sms(device), span_cap=span_cap)
    name, auto = _choose_backend(backend, prob, device, layout_ok, variant, **kw)
    tile, m_tiles, rule = _rule(name, prob, **kw)
    paged = prob.page_size is not None
    splitting = rule.max_splits > 1 or batch_invariant  # batch-invariant: one tile whatever the grid
    items = (H.work_items(rule, prob.batch) or 0) if name != "torch" else 0
    whole = splitting and H.streams_whole_sequences(name, rule, prob.batch, prob.max_seqlen, batch_invariant,
                                                    prob.head_dim, items)
    if name == "cutlass":
        waves = H.streams_in_waves(rule, prob.batch, prob.max_seqlen, prob.num_kv_heads * m_tiles, kw["num_sms"],
                                   batch_invariant)
        block_n, stages = H.cutlass_tile(prob.head_dim, splitting and not whole, paged, prob.kv_fp8, waves)
        tile = H.TileConfig(tile.block_m, block_n, tile.num_warps, stages)
        fuse = H.cutlass_fuses_merge(rule, prob.qhead_per_kvhead * prob.q_len, tile.block_m, prob.batch,
                                     prob.max_seqlen)
    else:
        t = H.tile_config(prob.head_dim, prob.qhead_per_kvhead * prob.q_len, splitting=splitting and not whole,
                          kv_fp8=prob.kv_fp8)
        tile = H.TileConfig(t.block_m, t.block_n, t.num_warps, H.launch_stages(t, paged))
        fuse = name == "triton" and 1 < rule.max_splits <= H.FUSED_MERGE_MAX_SPLITS
    fuse = H.fused_merge(fuse) and name != "torch" and rule.max_splits > 1 and not batch_invariant  # one merge
    # path for a batch-invariant plan: the merge kernel
    B, S = prob.batch, rule.max_splits
    pad = -(-max(B, 1) // 4) * 4  # 16-byte aligned rows: Triton specialises pointers on alignment

    def tensors():
        sched = torch.ones(2, pad, dtype=torch.int32, device=device)
        sched[1].fill_(rule.block_n)
        o_part = lse_part = counters = None
        if S > 1:
            o_shape, lse_shape, nbytes = W.partial_sizes(S, B, prob.num_q_heads, prob.q_len, prob.head_dim)
            o_part, lse_part = W.carve(W.allocate(nbytes, device), o_shape, lse_shape)
            if fuse:
                counters = torch.zeros(B * prob.num_kv_heads * m_tiles, dtype=torch.int32, device=device)
        lse_scratch = torch.empty(B, prob.num_q_heads, prob.q_len, dtype=torch.float32, device=device)
        work = None
        if items:  # one split per request until the first schedule, as sched
            work = torch.full((2, -(-items // 4) * 4), -1, dtype=torch.int32, device=device)[:, :items]
            work[0, :B] = torch.arange(B, dtype=torch.int32, device=device)  # items >= B (work_items)
            work[1, :B] = 0
        return sched, counters, o_part, lse_part, lse_scratch, work

    sched, counters, o_part, lse_part, lse_scratch, work = W.outside_graph_pools(tensors, device)
    return DecodePlan(B, prob.num_q_heads, prob.num_kv_heads, prob.head_dim, prob.q_len,
                      prob.dtype if dtype_bound else None, paged, prob.max_seqlen, device, name, auto, tile,
                      m_tiles, rule, fuse, batch_invariant, sched, counters, o_part, lse_part, lse_scratch,
                      variant.key(), work, items,
                      aligned_pages=name == "triton" and paged and not variant.windowed)


def plan(cache_seqlens: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
         q_len: int = 1, num_splits: int | None = None, max_seqlen: int | None = None,
         num_sms: int | None = None, backend: str = "auto", paged: bool = False,
         dtype: torch.dtype | None = None, batch_invariant: bool = False, window_size: tuple[int, int] = (-1, -1),
         softcap: float = 0.0, sinks: torch.Tensor | None = None,
         alibi_slopes: torch.Tensor | None = None, kv_dtype: torch.dtype | None = None,
         k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None) -> DecodePlan:
    """Plan a decode step once; pass it to every layer's `decode(..., plan=p)`.

    The plan fixes the backend ('auto' resolved here), the cache layout (paged: the calls pass a
    block_table), the dtype when given, and the split table for these lengths (computed on their
    device). max_seqlen bounds the lengths the plan will see (grid and workspace are sized for it);
    None reads max(cache_seqlens) on the host once, here. For CUDA graphs: pass max_seqlen, capture
    `p.refresh(cache_seqlens)` once per step and the decode calls; replays follow new lengths.
    batch_invariant: a fixed chunk length per split, so a request's output does not depend on the
    rest of the batch (bitwise); see heuristics.BATCH_INVARIANT_CHUNK_KEYS for its cost. That holds
    for lengths up to max_seqlen: a longer one still decodes correctly, but in fewer, longer chunks.
    window_size / softcap / sinks / alibi_slopes: the attention variant the calls will pass (as
    decode takes them; sinks and alibi_slopes only need their presence and shape here): a sliding
    window makes the plan split only the keys the window shows. kv_dtype, k_scale, v_scale: for
    a float8 cache, its dtype and the scales the calls will pass (their granularity is what counts).
    """
    validate.check_plan_args(cache_seqlens, num_q_heads, num_kv_heads, head_dim, q_len, num_splits, max_seqlen,
                             backend, paged, dtype, batch_invariant, num_sms=num_sms, kv_dtype=kv_dtype)
    num_sms = None if num_sms is None else validate.as_int(num_sms)  # a NumPy int works too
    if max_seqlen is None:
        max_seqlen = max(int(cache_seqlens.max()) if cache_seqlens.numel() else 1, 1)
    prob = validate.Problem(cache_seqlens.shape[0], q_len, num_q_heads, num_kv_heads, head_dim, max_seqlen,
                            16 if paged else None, dtype, kv_dtype in FP8_DTYPES)
    variant = make_variant(window_size, softcap, sinks, alibi_slopes, num_q_heads=num_q_heads,
                           device=cache_seqlens.device, k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype,
                           num_kv_heads=num_kv_heads)
    p = build(prob, cache_seqlens.device, backend=backend, num_splits=num_splits, batch_invariant=batch_invariant,
              num_sms=num_sms, dtype_bound=dtype is not None, variant=variant)
    p.schedule(cache_seqlens)
    maybe_print(p)
    return p


def maybe_print(p: DecodePlan) -> None:
    if os.environ.get("SPLITKV_PRINT_PLAN", "") not in ("", "0"):
        print(p.describe(), flush=True)
