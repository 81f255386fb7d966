"""Cascade decode: a prompt prefix shared by every request of a batch is attended once, each
request's own suffix through ordinary decode, and the two states merged exactly (merge_states).

Request b's keys are prefix[0:prefix_len] followed by its suffix[0:suffix_seqlens[b]]. The prefix
pass folds the batch into the query heads, so the prefix KV is read once per KV head for the whole
batch instead of once per request: q [B, Sq, Hkv*G, D] is regrouped to one request with
Hkv*B*G query heads ordered (kv head, request, group), which the GQA mapping (query head h reads
KV head h // (B*G)) sends to the right KV head. The prefix lies wholly before the new tokens, so
that pass is non-causal; causality (bottom-right, Sq > 1) only matters inside the suffix, which
must therefore hold the Sq new tokens (suffix_seqlens >= Sq).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .api import decode
from .merge import merge_states

if TYPE_CHECKING:
    from .plan import DecodePlan


def _prefix_as_request(prefix_k, prefix_v, prefix_len, prefix_block_table, device):
    """The prefix as a one-request cache: (k [1, L, Hkv, D] or pool, v, seqlens [1], table [1, P])."""
    if prefix_block_table is None:
        if not isinstance(prefix_k, torch.Tensor) or prefix_k.dim() != 3:
            raise ValueError("prefix_k: expected a tensor [Lp, Hkv, D] (or a page pool "
                             "[num_pages, page_size, Hkv, D] with prefix_block_table)")
        if not isinstance(prefix_v, torch.Tensor) or prefix_v.shape != prefix_k.shape:
            raise ValueError(f"prefix_v: expected shape {tuple(prefix_k.shape)} like prefix_k")
        k, v, table = prefix_k.unsqueeze(0), prefix_v.unsqueeze(0), None
    else:
        if not isinstance(prefix_block_table, torch.Tensor) or prefix_block_table.dim() not in (1, 2) or (
                prefix_block_table.dim() == 2 and prefix_block_table.shape[0] != 1):
            raise ValueError("prefix_block_table: expected int32 page ids [max_pages] (or [1, max_pages])")
        if prefix_block_table.dtype != torch.int32:
            raise TypeError(f"prefix_block_table: expected dtype int32, got {prefix_block_table.dtype}")
        k, v, table = prefix_k, prefix_v, prefix_block_table.reshape(1, -1)
    if not isinstance(v, torch.Tensor) or v.dtype != k.dtype:
        raise TypeError(f"prefix_v: dtype {getattr(v, 'dtype', type(v).__name__)} does not match prefix_k's {k.dtype}")
    capacity = k.shape[1] if table is None else table.shape[1] * k.shape[1]
    if isinstance(prefix_len, torch.Tensor):
        if prefix_len.numel() != 1:
            raise ValueError(f"prefix_len: expected an int or a one-element tensor, got shape "
                             f"{tuple(prefix_len.shape)}")
        if prefix_len.dtype.is_floating_point or prefix_len.dtype.is_complex or prefix_len.dtype == torch.bool:
            raise TypeError(f"prefix_len: expected an integer tensor, got dtype {prefix_len.dtype}")
        if (prefix_len.device.type == "cpu" and not torch.compiler.is_compiling()  # free to read on the host
                and not 0 <= int(prefix_len) <= capacity):
            raise ValueError(f"prefix_len: expected a length in [0, {capacity}] (the prefix's capacity), "
                             f"got {int(prefix_len)}")
        seqlens = prefix_len.reshape(1).to(device=device, dtype=torch.int32)
    elif isinstance(prefix_len, int) and not isinstance(prefix_len, bool) and 0 <= prefix_len <= capacity:
        seqlens = torch.tensor([prefix_len], dtype=torch.int32, device=device)
    else:
        raise ValueError(f"prefix_len: expected an int in [0, {capacity}] (the prefix's capacity) or a one-element "
                         f"int tensor, got {prefix_len!r}")
    return k, v, seqlens, table


def cascade_decode(q: Tensor, prefix_k: Tensor, prefix_v: Tensor, prefix_len: int, suffix_k: Tensor, suffix_v: Tensor,
                   suffix_seqlens: Tensor, *, prefix_block_table: Tensor | None = None,
                   suffix_block_table: Tensor | None = None, causal: bool = True, softmax_scale: float | None = None,
                   num_splits: int | None = None, return_lse: bool = False,
                   backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Decode attention over [shared prefix | per-request suffix], the prefix read once.

    q [B, Sq, Hq, D]. prefix_k/prefix_v [Lp, Hkv, D] with prefix_len (int or int32 one-element
    tensor) valid keys, or a page pool [num_pages, page_size, Hkv, D] with prefix_block_table
    int32 [max_pages] (the pool may be the suffixes' pool: shared prefix pages). suffix_k/suffix_v
    and suffix_seqlens [B] are a decode cache (contiguous [B, Lmax, Hkv, D], or paged with
    suffix_block_table). Equal to decode over each request's concatenated keys; returns o
    [B, Sq, Hq, D] (and lse [B, Hq, Sq] fp32 when return_lse).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor [B, Sq, Hq, D], got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a tensor [B, Sq, Hq, D], got shape {tuple(q.shape)}")
    B, Sq, Hq, D = q.shape
    if not isinstance(prefix_k, torch.Tensor) or prefix_k.dim() < 3 or prefix_k.shape[-1] != D:
        raise ValueError(f"prefix_k: expected a tensor with head dim {D} (q's) last")
    if prefix_k.dtype != q.dtype:
        raise TypeError(f"prefix_k: dtype {prefix_k.dtype} does not match q's dtype {q.dtype}")
    Hkv = prefix_k.shape[-2]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"prefix_k: {Hkv} KV heads do not divide q's {Hq} query heads")
    if isinstance(suffix_k, torch.Tensor) and suffix_k.dim() == 4 and suffix_k.shape[-2] != Hkv:
        raise ValueError(f"suffix_k: {suffix_k.shape[-2]} KV heads do not match prefix_k's {Hkv}")
    G = Hq // Hkv
    # a host read: skipped where it would break a traced graph or a CUDA-graph capture
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    host_ok = not torch.compiler.is_compiling() and not capturing
    if causal and Sq > 1 and host_ok and isinstance(suffix_seqlens, torch.Tensor) and suffix_seqlens.numel():
        short = int(suffix_seqlens.min())
        if short < Sq:
            raise ValueError(f"suffix_seqlens: every suffix must hold the Sq = {Sq} new tokens (causal), "
                             f"got a length of {short}")
    pk, pv, p_lens, p_table = _prefix_as_request(prefix_k, prefix_v, prefix_len, prefix_block_table, q.device)
    if B == 0:  # no request: the suffix pass alone gives the empty result (and checks the suffix arguments)
        return decode(q, suffix_k, suffix_v, suffix_seqlens, block_table=suffix_block_table, causal=causal,
                      softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse, backend=backend)

    # [B, Sq, Hkv, G, D] -> [1, Sq, Hkv*B*G, D] with heads ordered (kv head, request, group)
    q_p = q.reshape(B, Sq, Hkv, G, D).permute(1, 2, 0, 3, 4).reshape(1, Sq, Hkv * B * G, D)
    o_p, lse_p = decode(q_p, pk, pv, p_lens, block_table=p_table, causal=False, softmax_scale=softmax_scale,
                        num_splits=num_splits, return_lse=True, backend=backend)
    o_p = o_p.reshape(Sq, Hkv, B, G, D).permute(2, 0, 1, 3, 4).reshape(B, Sq, Hq, D)
    lse_p = lse_p.reshape(Hkv, B, G, Sq).permute(1, 0, 2, 3).reshape(B, Hq, Sq)

    o_s, lse_s = decode(q, suffix_k, suffix_v, suffix_seqlens, block_table=suffix_block_table, causal=causal,
                        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True, backend=backend)
    o, lse = merge_states(o_s, lse_s, o_p, lse_p)
    return (o, lse) if return_lse else o


class PrefixGather(NamedTuple):
    """Row indices that fold a batch's groups into group_prefix_decode's query heads and back
    (prefix_gather): made once per step, they serve every layer with the same members. Each is a
    flat int64 index of D-vectors, so a fold is one row gather (advanced indexing with broadcast
    index tensors launched 13 elementwise kernels per call on an H100)."""

    q_rows: Tensor  # [Gn * Sq * Hkv * n * G]: the row of q [B * Sq * Hq, D] each folded query reads
    table_rows: Tensor  # [Gn]: each group's first member (its table holds the prefix)
    o_rows: Tensor  # [B * Sq * Hq]: the row of the folded output [Gn * Sq * Hkv * n * G, D] each query row takes
    lse_idx: Tensor  # [B * Hq * Sq]: the same in the folded lse [Gn, Hkv, n, G, Sq]
    in_group: Tensor  # bool [B, 1, 1]: rows in a group (others get the empty state)


# prefix_gather's shape constants, by (device, Gn, n, Sq, Hq, Hkv): made outside CUDA-graph capture
# (a tensor made inside one holds its values only once the graph replays), so a step's gather
# is 8 small kernels instead of ~30
_GATHER_CONSTANTS: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def _gather_constants(device, Gn, n, Sq, Hq, Hkv):
    key = (device, Gn, n, Sq, Hq, Hkv)
    hit = _GATHER_CONSTANTS.get(key)
    if hit is not None:
        return hit
    G = Hq // Hkv
    ar = functools.partial(torch.arange, device=device)
    g, j = ar(Gn).view(Gn, 1), ar(n).view(1, n)
    # folded (g, s, h, j, x) sits at (((g * Sq + s) * Hkv + h) * n + j) * G + x among the output's rows
    # and at (((g * Hkv + h) * n + j) * G + x) * Sq + s in the lse: per slot (g, j) a base, per
    # (s, h, x) an offset; a third column marks the slot's row as grouped
    slot = torch.stack(((g * (Sq * Hkv * n * G) + j * G).reshape(-1), (g * (Hkv * n * G * Sq) + j * (G * Sq)).reshape(-1),
                        torch.ones(Gn * n, dtype=torch.long, device=device)), 1)
    o_off = ((ar(Sq).view(Sq, 1, 1) * Hkv + ar(Hkv).view(1, Hkv, 1)) * (n * G) + ar(G).view(1, 1, G)).reshape(1, -1)
    lse_off = (ar(Hkv).view(Hkv, 1, 1) * (n * G * Sq) + ar(G * Sq).view(1, G, Sq)).reshape(1, -1)
    q_off = ar(Sq * Hq).view(1, Sq, Hkv, 1, G)
    out = (slot, o_off, lse_off, q_off)
    if torch.device(device).type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _GATHER_CONSTANTS[key] = out
    return out


def prefix_gather(members: Tensor, batch: int, q_len: int, num_q_heads: int, num_kv_heads: int) -> PrefixGather:
    """The gathers of group_prefix_decode for these members (int64 [Gn, n], `batch` = empty slot),
    for q of shape [batch, q_len, num_q_heads, D]. No host read: capturable."""
    Gn, n = members.shape
    Sq, Hq, Hkv = q_len, num_q_heads, num_kv_heads
    slot, o_off, lse_off, q_off = _gather_constants(members.device, Gn, n, Sq, Hq, Hkv)
    # folded query (g, s, h, j, x) is q[members[g, j], s, h * G + x]; an empty slot reads row 0 (dropped)
    q_rows = torch.add(q_off, members.clamp(max=batch - 1).view(Gn, 1, 1, n, 1), alpha=Sq * Hq)
    # each row takes its slot's bases (rows in no group: zeros); empty slots all write row `batch`, dropped
    base = torch.zeros(batch + 1, 3, dtype=torch.long, device=members.device)
    base = base.scatter_(0, members.reshape(-1, 1).expand(-1, 3), slot)[:batch]
    return PrefixGather(q_rows.reshape(-1), members[:, 0].clamp(max=batch - 1), (base[:, :1] + o_off).reshape(-1),
                        (base[:, 1:2] + lse_off).reshape(-1), base[:, 2].bool().view(batch, 1, 1))


def group_prefix_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, members: Tensor,
                        prefix_lens: Tensor, *, softmax_scale: float | None = None, plan: DecodePlan | None = None,
                        backend: str = "auto", gather: PrefixGather | None = None,
                        **variant: object) -> tuple[Tensor, Tensor]:
    """Each request's attention state over the prompt prefix it shares with its group, each group's
    prefix read once (cascade_decode for many groups at a time, e.g. the n samples of each of
    several prompts in one paged batch).

    q [B, Sq, Hq, D]; k_pages / v_pages a page pool [num_pages, page_size, Hkv, D] and block_table
    int32 [B, W] the requests' page tables. Group g's members are the rows members[g] (int64
    [Gn, n]; the value B marks an empty slot) and its prefix the first prefix_lens[g] keys (int32
    [Gn], a whole number of pages) of its first member's row, which every member holds (forks of
    one prompt). The members' queries are folded into the heads (cascade_decode's order: KV head,
    member, group), so one decode over Gn requests reads each prefix once. Returns (o [B, Sq, Hq, D],
    lse [B, Hq, Sq] fp32); a row in no group gets the empty state (0, -inf), so
    merge_states(suffix state, this) is exact for every row. gather: prefix_gather(members, ...)
    made once for calls with the same members (every layer of a step); made here when None. No host
    read: capturable."""
    B, Sq, Hq, D = q.shape
    Gn, n = members.shape
    Hkv = k_pages.shape[-2]
    G = Hq // Hkv
    if gather is None:
        gather = prefix_gather(members, B, Sq, Hq, Hkv)
    # one gather each way: q's rows straight into the folded order, each row's state straight out
    # x[rows] with one 1-D index: torch's vectorized row gather (~2 us for 2 MB on an H100, where
    # index_select took 6 us for a 16-row table)
    qf = q.reshape(B * Sq * Hq, D)[gather.q_rows].view(Gn, Sq, Hkv * n * G, D)
    table = block_table[gather.table_rows]
    o_f, lse_f = decode(qf, k_pages, v_pages, prefix_lens, block_table=table, causal=False,
                        softmax_scale=softmax_scale, return_lse=True, plan=plan, backend=backend, **variant)
    o = o_f.reshape(-1, D)[gather.o_rows].view(B, Sq, Hq, D)
    lse = lse_f.reshape(-1)[gather.lse_idx].view(B, Hq, Sq)
    inside = gather.in_group
    return torch.where(inside.view(B, 1, 1, 1), o, 0), torch.where(inside, lse, float("-inf"))
