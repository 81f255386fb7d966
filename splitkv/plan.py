"""DecodePlan: the split table every backend executes.

A plan fixes, for one batch shape: the tile config, the grid's split dimension (`max_splits`) and
the workspace; and holds per-request device tensors `num_splits[B]` and `chunk_lens[B]` (keys per
split). Split s of request b covers keys [s * chunk_lens[b], min((s+1) * chunk_lens[b], L_b)),
except the last split (s = num_splits[b] - 1), which runs on to L_b: a graph-safe plan whose
lengths outgrow its bound stays correct (its last split just gets longer).
Kernels read these tensors; they decide nothing about splitting.

Two kinds of plan:
  * eager (`max_seqlen=None`): built from the actual lengths on the host (one device->host read
    of cache_seqlens), reused by every layer of the step;
  * graph-safe (`max_seqlen=N`): chunk length and grid fixed from the upper bound N; at each call
    `refresh(cache_seqlens)` recomputes num_splits on the device with in-place ops, so the launch
    can be captured in a CUDA graph and replayed after lengths change.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from . import heuristics as H
from . import workspace as W
from .backends import plan_target


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H.CPU_NUM_SMS


@dataclass
class DecodePlan:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_len: int
    device: torch.device
    tile: H.TileConfig
    m_tiles: int
    max_splits: int  # split dimension of the grid; workspace is sized to it
    max_chunk_len: int  # longest chunk (keys) of any split: bounds the torch backend's padding
    num_splits: torch.Tensor  # int32 [B] on device
    chunk_lens: torch.Tensor  # int32 [B] on device
    num_splits_host: list[int] | None = None  # None for graph-safe plans (lengths live on GPU)
    graph_safe: bool = False
    chunk_len: int | None = None  # the batch-wide chunk of auto plans (None when forced)
    forced: int | None = None
    target: str = "triton"  # the backend the split count was sized for (heuristics.blocks_per_sm)
    paged: bool = False  # ... and the cache layout
    _own_ws: torch.Tensor | None = field(default=None, repr=False)
    # int32 [B * Hkv * m_tiles] arrival counters of the fused combine, zero between launches;
    # allocated in __post_init__ whenever the plan splits
    counters: torch.Tensor | None = field(default=None, repr=False)
    _parts: tuple = field(default=(None, None, None), repr=False)  # (buffer, o_part, lse_part)

    def __post_init__(self):
        if self.max_splits > 1 and self.counters is None:
            self.counters = torch.zeros(self.batch * self.num_kv_heads * self.m_tiles, dtype=torch.int32,
                                        device=self.device)

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @functools.cached_property
    def workspace_layout(self):
        """(o_shape, lse_shape, nbytes) of this plan's partials."""
        return W.partial_sizes(self.max_splits, self.batch, self.num_q_heads, self.q_len, self.head_dim)

    def partials(self):
        """(o_part, lse_part) workspace views, or (None, None) when no request splits."""
        if self.max_splits == 1:
            return None, None
        o_shape, lse_shape, nbytes = self.workspace_layout
        buf = self._own_ws if self._own_ws is not None else W.shared_buffer(nbytes, self.device)
        if self._parts[0] is not buf:  # carve once per buffer: views cost host time on every call
            self._parts = (buf, *W.carve(buf, o_shape, lse_shape))
        return self._parts[1], self._parts[2]

    def refresh(self, cache_seqlens: torch.Tensor) -> None:
        """Graph-safe plans: recompute num_splits from device lengths, in place (capturable).

        Call once per decode step (not per layer). Results never depend on it: a split whose
        chunk starts past the request's length is empty (lse = -inf), and the last split always
        runs on to the length, so stale counts only cost balance, not correctness."""
        if not self.graph_safe:
            return
        n = self.num_splits
        torch.add(cache_seqlens, self.chunk_len - 1, out=n)
        n.div_(self.chunk_len, rounding_mode="floor").clamp_(1, self.max_splits)

    def check_matches(self, prob, device: torch.device) -> None:
        got = (prob.batch, prob.num_q_heads, prob.num_kv_heads, prob.head_dim, prob.q_len)
        want = (self.batch, self.num_q_heads, self.num_kv_heads, self.head_dim, self.q_len)
        if got != want:
            raise ValueError(f"plan: made for (B, Hq, Hkv, D, Sq) = {want}, but the inputs have {got}")
        same_index = device.index is None or self.device.index is None or device.index == self.device.index
        if device.type != self.device.type or not same_index:
            raise ValueError(f"plan: made for {self.device}, but the inputs are on {device}")

    def describe(self) -> str:
        splits = self.num_splits_host if self.num_splits_host is not None else "on device"
        mode = "graph-safe" if self.graph_safe else ("forced" if self.forced else "auto")
        return (f"DecodePlan[{mode}] B={self.batch} Hq/Hkv={self.num_q_heads}/{self.num_kv_heads} "
                f"D={self.head_dim} Sq={self.q_len} tile={self.tile} m_tiles={self.m_tiles} "
                f"chunk={self.chunk_len} max_splits={self.max_splits} num_splits={splits} "
                f"for={self.target}{'/paged' if self.paged else ''}")


def build_plan(lengths: list[int] | None, *, cache_seqlens: torch.Tensor | None = None, batch: int,
               num_q_heads: int, num_kv_heads: int,
               head_dim: int, q_len: int, device, num_splits: int | None = None,
               max_seqlen: int | None = None, num_sms: int | None = None, target: str = "triton",
               paged: bool = False) -> DecodePlan:
    """target / paged: the backend (backends.plan_target) and cache layout that will run the plan:
    they set the planner's block target (heuristics.blocks_per_sm)."""
    device = torch.device(device)
    bps = H.blocks_per_sm(target, paged)
    rows = (num_q_heads // num_kv_heads) * q_len
    tile = H.tile_config(head_dim, rows)
    m_tiles = H.query_tiles(rows, tile.block_m)
    sms = num_sms if num_sms is not None else device_num_sms(device)
    graph_safe = max_seqlen is not None
    if graph_safe:
        bound = [max_seqlen] * batch
        chunk = (max(H.cdiv(max_seqlen, num_splits), 1) if num_splits else
                 H.choose_chunk_len(bound, num_kv_heads=num_kv_heads, m_tiles=m_tiles,
                                    block_n=tile.block_n, num_sms=sms, blocks_per_sm=bps))
        max_splits = H.splits_for_lengths([max_seqlen], chunk)[0]
        tile = H.tile_config(head_dim, rows, splitting=max_splits > 1)
        plan = DecodePlan(batch, num_q_heads, num_kv_heads, head_dim, q_len, device, tile, m_tiles,
                          max_splits, chunk, torch.ones(batch, dtype=torch.int32, device=device),
                          torch.full((batch,), chunk, dtype=torch.int32, device=device),
                          graph_safe=True, chunk_len=chunk, forced=num_splits, target=target, paged=paged)
        if cache_seqlens is not None:
            plan.refresh(cache_seqlens)
        if max_splits > 1:
            plan._own_ws = W.allocate(plan.workspace_layout[2], device)
        return plan
    if num_splits is not None:
        chunks = H.forced_chunk_lens(lengths, num_splits, tile.block_n)
        splits, chunk = [num_splits] * batch, None
    else:
        chunk = H.choose_chunk_len(lengths, num_kv_heads=num_kv_heads, m_tiles=m_tiles,
                                   block_n=tile.block_n, num_sms=sms, blocks_per_sm=bps)
        splits, chunks = H.splits_for_lengths(lengths, chunk), [chunk] * batch
    tile = H.tile_config(head_dim, rows, splitting=max(splits, default=1) > 1)
    host = torch.tensor(splits + chunks, dtype=torch.int32)
    dev = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return DecodePlan(batch, num_q_heads, num_kv_heads, head_dim, q_len, device, tile, m_tiles,
                      max(splits, default=1), max(chunks, default=1), dev[:batch], dev[batch:],
                      num_splits_host=splits, chunk_len=chunk, forced=num_splits, target=target, paged=paged)


def plan(cache_seqlens: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
         q_len: int = 1, num_splits: int | None = None, max_seqlen: int | None = None,
         num_sms: int | None = None, backend: str = "auto", paged: bool = False) -> DecodePlan:
    """Plan a decode step once; pass it to every layer's `decode(..., plan=p)`.

    backend, paged: the backend the decode calls will use ('auto': what decode's 'auto' runs on
    this device) and whether they pass a block_table: the split count is sized for them (cutlass
    on a contiguous cache wants one block per SM, everything else two).

    max_seqlen=None: eager plan from the actual lengths (reads cache_seqlens on the host).
    max_seqlen=N: graph-safe plan for lengths <= N (never reads cache_seqlens on the host); the
    decode call may then be captured in a CUDA graph and replayed with new lengths/tables.
    """
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
        raise ValueError("cache_seqlens: expected a 1-D int32 tensor [B]")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits!r}")
    if max_seqlen is not None and max_seqlen < 1:
        raise ValueError(f"max_seqlen: expected a positive int, got {max_seqlen!r}")
    lengths = None if max_seqlen is not None else [int(x) for x in cache_seqlens.tolist()]
    p = build_plan(lengths, cache_seqlens=cache_seqlens, batch=cache_seqlens.shape[0], num_q_heads=num_q_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, q_len=q_len,
                   device=cache_seqlens.device, num_splits=num_splits, max_seqlen=max_seqlen,
                   num_sms=num_sms, target=plan_target(backend, cache_seqlens.device), paged=paged)
    maybe_print(p)
    return p


def maybe_print(p: DecodePlan) -> None:
    if os.environ.get("SPLITKV_PRINT_PLAN", "") not in ("", "0"):
        print(p.describe(), flush=True)
