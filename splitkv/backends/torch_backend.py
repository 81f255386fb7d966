"""The split/merge algorithm in PyTorch: the CPU backend and the readable spec.

Two paths, the same results to rounding (tests/test_torch_backend.py pins them together):

* `run_spec` — the specification. Every split of every request runs at once: keys are gathered
  into a padded [B, S, C] grid (S = plan.max_splits, C = longest split), masked, and reduced with
  an exact softmax per split in fp32. Partials go to the plan's workspace in the shared layout
  (o_part [S, B, Hq, Sq, D], lse_part [S, B, Hq, Sq]) and `merge` merges them exactly as the GPU
  merge kernel does. `run` takes it whenever the partials are observable: under
  splitkv.debug.capture_partials, and for plans with a forced num_splits > 1.
* `run_fast` — what a CPU call runs otherwise. On a CPU, splitting a request buys no parallelism
  (the attention op already spreads KV heads over the cores) and the padded grid, the gathers and
  the fp32 upcast of K and V cost 2-7x SDPA's time (`python -m splitkv bench --suite cpu --device cpu
  --providers splitkv-torch-noplan,sdpa-flash` times the two). So the
  plan's split table is not used (no partials are written) and each request's keys go, in one pass and in
  their own dtype, through ATen's CPU flash-attention kernel
  (aten._scaled_dot_product_flash_attention_for_cpu, which returns the logsumexp too), with the
  Hq/Hkv query heads of a KV head (x Sq tokens) packed as its rows (GQA packing: K/V read once per
  KV head). Contiguous caches and runs of consecutive pages are read in place (strided views);
  other paged requests gather their used pages once. Causal Sq > 1: the keys every query sees go
  through the kernel, the <= Sq - 1 newest keys (seen by some queries only) through the spec's
  masked softmax, and `merge` merges the two states (no additive mask: NaN + -inf would let a
  NaN in a key a query does not see reach it). One request per kernel call (requests of equal
  length in a contiguous cache share one unless the plan is batch-invariant), so a request's
  result is bitwise independent of the rest of the batch; the kernel is deterministic.

Deterministic: the same inputs give bitwise the same outputs.
NaN in q or in a used key / value propagates to o and lse (as in SDPA); only a row with no
visible key is o = 0, lse = -inf. The merge takes lse = -inf or +inf (FlashAttention's "no
key") as an empty partial (weight exactly 0, o never read) and propagates a NaN lse.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from .. import debug
from ..variants import PLAIN, first_key

NEG_INF = -math.inf


def split_bounds(plan, cache_seqlens: torch.Tensor, first: torch.Tensor | None = None):
    """[B, S] start/end key of every split; the last split of a request runs on to its length.
    first [B]: the request's first visible key (a sliding window's start; 0 without one)."""
    S = plan.max_splits
    L = cache_seqlens.long()[:, None]
    n = plan.num_splits.long()[:, None]
    c = plan.chunk_lens.long()[:, None]
    s = torch.arange(S, device=L.device)[None, :]
    start = s * c if first is None else first.long()[:, None] + s * c
    end = torch.where(s == n - 1, L, torch.minimum(start + c, L))
    end = torch.where(s < n, torch.maximum(end, start), start)  # splits past num_splits are empty
    return start, end


def _gather(cache, pos, block_table, valid):
    """cache rows at key positions pos [B, S, C] -> [B, S, C, Hkv, D], dense or through the block
    table. Block-table entries past a request's last page may be garbage: never index with them."""
    B = pos.shape[0]
    if cache.shape[0] == 0 or cache.shape[1] == 0:  # a cache with no slot (Lmax 0, or no page): no key is valid
        return cache.new_zeros(*pos.shape, *cache.shape[2:])
    if block_table is None:
        return cache[torch.arange(B, device=pos.device)[:, None, None], pos]
    ps = cache.shape[1]
    pages = torch.gather(block_table.long(), 1, (pos // ps).reshape(B, -1)).view_as(pos)
    return cache[torch.where(valid, pages, 0), pos % ps]


def _scaled(x: torch.Tensor, scale) -> torch.Tensor:
    """fp8 cache rows [..., Hkv, D] (as fp32) times their scale: a float or one per KV head."""
    if scale is None:
        return x
    return x * (scale[:, None] if isinstance(scale, torch.Tensor) else scale)


def run_split(q, k_cache, v_cache, cache_seqlens, block_table, plan, scale, causal, variant=PLAIN):
    """Partials for every split: (o [S, B, Hq, Sq, D] fp32 normalised, lse [S, B, Hq, Sq] fp32).
    The variant's window, softcap and ALiBi shape the scores here; its sinks enter after the merge."""
    B, Sq, Hq, D = q.shape
    Hkv, G = plan.num_kv_heads, plan.qhead_per_kvhead
    start, end = split_bounds(plan, cache_seqlens, first_key(cache_seqlens, Sq, variant.window_left))
    C = max(int((end - start).max()) if end.numel() else 0, 1)
    pos = start[..., None] + torch.arange(C, device=q.device)  # [B, S, C]
    valid = pos < end[..., None]
    limit = k_cache.shape[1] - 1 if block_table is None else block_table.shape[1] * k_cache.shape[1] - 1
    pos_safe = torch.where(valid, pos, 0).clamp_(max=max(limit, 0))
    k = _scaled(_gather(k_cache, pos_safe, block_table, valid).float(), variant.k_scale)
    v = _scaled(_gather(v_cache, pos_safe, block_table, valid).float(), variant.v_scale)
    v = torch.where(valid[..., None, None], v, 0.0)  # NaN in unused slots must not leak
    qf = q.float().reshape(B, Sq, Hkv, G, D)
    s = torch.einsum("bthgd,bschd->bshgtc", qf, k) * scale  # [B, S, Hkv, G, Sq, C]
    if variant.softcap > 0:
        s = variant.softcap * torch.tanh(s / variant.softcap)
    mask = valid[:, :, None, None, None, :]
    qpos = cache_seqlens.long()[:, None] - Sq + torch.arange(Sq, device=q.device)  # [B, Sq]
    dist = pos[:, :, None, None, None, :] - qpos[:, None, None, None, :, None]  # key - query position
    if variant.alibi_slopes is not None:
        s = s - variant.alibi_slopes.view(1, 1, Hkv, G, 1, 1) * dist.abs().float()
    if causal:
        mask = mask & (dist <= 0)
    if variant.windowed:
        left, right = variant.window_bounds()
        mask = mask & (dist >= -left) & (dist <= right)
    s = s.masked_fill(~mask, NEG_INF)
    # as the kernels do: p = exp(s - max), o = (p @ v) / sum(p), so equal scores give exactly v
    # (FlashInfer's extreme-logits case); a row with no key has max -inf and sum 0 -> o = 0,
    # lse = -inf; NaN scores stay NaN, and so does a +inf score (exp(inf - inf))
    m = s.amax(dim=-1)  # [B, S, Hkv, G, Sq]
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    p = torch.exp(s - m_safe[..., None])
    den = p.sum(dim=-1)
    lse = m_safe + torch.log(den)  # log(0) = -inf where the split saw no key
    o = torch.einsum("bshgtc,bschd->bshgtd", p, v) / torch.where(den == 0, 1.0, den)[..., None]
    S = plan.max_splits
    o = o.permute(1, 0, 2, 3, 4, 5).reshape(S, B, Hq, Sq, D)
    lse = lse.permute(1, 0, 2, 3, 4).reshape(S, B, Hq, Sq)
    return o, lse


def merge(o_part, lse_part, num_splits, out, lse_out, *, sinks=None):
    """Exact merge of split partials: out [B, Sq, Hq, D], lse_out [B, Hq, Sq]. sinks (float32 [Hq]
    or None): attention-sink logits, one more softmax term per row with no value (splitkv.variants).

    o_part [S, B, Hq, Sq, D], lse_part [S, B, Hq, Sq]; only the first num_splits[b] splits of a
    request are read; an empty partial (lse -inf, or +inf as FlashAttention returns for a row with
    no key) weighs exactly 0 and its o is never used; a row whose every split is empty gives
    0 / -inf; a NaN lse makes the row's o and lse NaN.
    """
    S = o_part.shape[0]
    in_range = torch.arange(S, device=o_part.device)[:, None] < num_splits.long()[None, :]  # [S, B]
    lse = lse_part.float()
    empty = ~in_range[:, :, None, None] | torch.isinf(lse)  # -inf and +inf: no key
    lse = lse.masked_fill(empty, NEG_INF)
    m = lse.amax(dim=0)  # NaN if any live partial is NaN
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    w = torch.exp(lse - m_safe).masked_fill_(empty, 0.0)  # [S, B, Hq, Sq]; exactly 0 when empty
    den = w.sum(dim=0)
    live = w != 0  # NaN != 0: a NaN partial is read (and poisons the row); an empty one never
    num = torch.where(live[..., None], w[..., None] * o_part.float(), 0.0).sum(dim=0)
    has = den != 0  # NaN passes: only a row with no live partial is 0 / -inf
    o = torch.where(has[..., None], num / torch.where(has, den, 1.0)[..., None], 0.0)  # [B, Hq, Sq, D]
    lse = torch.where(has, m_safe + torch.log(torch.where(has, den, 1.0)), NEG_INF)
    if sinks is not None:  # o shrinks by exp(lse - lse'); no key and no sink: o stays 0; NaN stays NaN
        full = torch.logaddexp(lse, sinks.float()[None, :, None])
        o = o * torch.where(full == NEG_INF, 1.0, torch.exp(lse - full))[..., None]
        lse = full
    out.copy_(o.permute(0, 2, 1, 3))
    lse_out.copy_(lse)


def _request_plan(max_splits, num_splits, chunk_lens, num_kv_heads, qhead_per_kvhead):
    """The plan fields run_split / run_spec read, for one request run on its own."""
    return SimpleNamespace(max_splits=max_splits, num_splits=num_splits, chunk_lens=chunk_lens,
                           num_kv_heads=num_kv_heads, qhead_per_kvhead=qhead_per_kvhead, batch_invariant=False)


def run_spec(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
             variant=PLAIN):
    """The spec path: every split of the plan, partials in the workspace when it has one, merge."""
    if plan.batch_invariant and (q.shape[0] > 1 or q.device.type == "cpu"):
        # one request at a time: the padded split grid (and so every reduction's shape and order)
        # is then the request's own, whatever else is in the batch
        # (on the CPU the grid's split count is the request's own too: reading it there is free; the
        # plan's max_splits depends on the batch, and a different padded shape rounds differently)
        cpu = q.device.type == "cpu"
        for b in range(q.shape[0]):
            S = max(1, int(plan.num_splits[b])) if cpu else plan.max_splits
            one = _request_plan(S, plan.num_splits[b:b + 1], plan.chunk_lens[b:b + 1],
                                plan.num_kv_heads, plan.qhead_per_kvhead)
            paged = block_table is not None
            run_spec(q[b:b + 1], k_cache if paged else k_cache[b:b + 1], v_cache if paged else v_cache[b:b + 1],
                     cache_seqlens[b:b + 1], block_table[b:b + 1] if paged else None, one,
                     None if o_part is None else o_part[:S, b:b + 1],
                     None if lse_part is None else lse_part[:S, b:b + 1], out[b:b + 1], lse[b:b + 1], scale, causal,
                     variant)
        return
    o_s, lse_s = run_split(q, k_cache, v_cache, cache_seqlens, block_table, plan, scale, causal, variant)
    if o_part is not None:  # keep partials in the shared workspace layout (debug hook reads them)
        o_part.copy_(o_s)
        lse_part.copy_(lse_s)
        o_s, lse_s = o_part, lse_part
    merge(o_s, lse_s, plan.num_splits, out, lse, sinks=variant.sinks)


# ---- the fast path -------------------------------------------------------------------------------

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (o, lse fp32) [B, H, M, *]


def _keys(cache, b, L, block_table):
    """[L, Hkv, D] keys (or values) of request b: a view of a contiguous cache or of a run of
    consecutive pages, else a copy of its used pages. Table entries past its last page are never read."""
    if block_table is None:
        return cache[b, :L]
    row = block_table[b, :-(-L // cache.shape[1])]
    ids = row.tolist()  # a CPU table: reading it is free
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return cache[ids[0]:ids[0] + len(ids)].flatten(0, 1)[:L]
    return cache.index_select(0, row).flatten(0, 1)[:L]


# Below 16 keys ATen's CPU flash kernel turns a NaN query into o = 0, lse = 0 (and a NaN key into the
# same at one key; torch 2.13, every dtype and row count): such short passes take the plain math.
_FLASH_MIN_KEYS = 16


def _attend_short(q, k, v, out, lse, scale, G):
    """_attend for fewer than _FLASH_MIN_KEYS keys: scores, softmax and P @ V in fp32 (NaN propagates)."""
    s = torch.einsum("nqhd,nkhd->nhqk", q.float(), k.float().repeat_interleave(G, dim=2)) * scale
    row = torch.logsumexp(s, dim=-1)  # [n, Hq, Sq]
    o = torch.einsum("nhqk,nkhd->nqhd", torch.exp(s - row[..., None]), v.float().repeat_interleave(G, dim=2))
    out.copy_(o)
    lse.copy_(row)


def _attend(q, k, v, out, lse, scale):
    """One pass of the CPU flash kernel: q [n, Sq, Hq, D], k/v [n, L, Hkv, D] (L >= 1, any strides
    with unit stride on D) -> out [n, Sq, Hq, D] (q's dtype), lse [n, Hq, Sq] (fp32)."""
    n, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    if k.shape[1] < _FLASH_MIN_KEYS:
        _attend_short(q, k, v, out, lse, scale, G)  # o is NaN there already
        lse.masked_fill_(lse == math.inf, math.nan)  # an overflowed score (see below)
        return
    qp = q.reshape(n, Hkv, G, D) if Sq == 1 else q.unflatten(2, (Hkv, G)).permute(0, 2, 3, 1, 4).reshape(
        n, Hkv, G * Sq, D)  # rows (g, t) of each KV head
    o, lse_p = _flash_cpu(qp, k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    # lse = +inf here is a score that overflowed fp32 (finite inputs), not FlashAttention's "no key"
    # (ATen gives o = 0 there): NaN, as SDPA gives, so no merge takes the row for an empty one
    overflow = lse_p == math.inf
    o, lse_p = o.masked_fill(overflow[..., None], math.nan), lse_p.masked_fill(overflow, math.nan)
    if Sq == 1 and out.is_contiguous():
        out.view(n, Hkv, G, D).copy_(o)
    else:
        out.unflatten(2, (Hkv, G)).copy_(o.unflatten(2, (G, Sq)).permute(0, 3, 1, 2, 4))
    lse.unflatten(1, (Hkv, G)).copy_(lse_p.unflatten(2, (G, Sq)))


def _causal_one(q, k, v, out, lse, scale):
    """Causal Sq > 1 for one request (q [1, Sq, Hq, D], k/v [1, L, Hkv, D]): query t sees keys
    0 .. L - Sq + t. The keys every query sees (0 .. L - Sq) take one kernel pass, the Sq - 1 newest
    the spec's masked softmax; `merge` takes both states (an empty part weighs nothing)."""
    Sq, Hq, D = q.shape[1:]
    L = k.shape[1]
    shared = L - Sq + 1
    o_p = torch.empty(2, 1, Hq, Sq, D)
    lse_p = torch.empty(2, 1, Hq, Sq)
    if shared > 0:
        _attend(q, k[:, :shared], v[:, :shared], o_p[0].transpose(1, 2), lse_p[0], scale)
    else:
        lse_p[0].fill_(NEG_INF)  # o_p[0] is never read
    lo = max(shared, 0)
    tail = _request_plan(1, torch.ones(1, dtype=torch.int32), torch.full((1,), L - lo, dtype=torch.int32),
                         k.shape[2], Hq // k.shape[2])
    # the tail as a request of its own (keys lo .. L-1, the same bottom-right alignment)
    o1, lse1 = run_split(q, k[:, lo:], v[:, lo:], torch.tensor([L - lo], dtype=torch.int32), None, tail,
                         scale, True)
    o_p[1].copy_(o1[0])
    lse_p[1].copy_(lse1[0])
    merge(o_p, lse_p, torch.full((1,), 2, dtype=torch.int32), out, lse)


def run_fast(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal):
    """The whole of each request in one pass of ATen's CPU flash kernel (see the module docstring);
    the split table is not used: no partials are written."""
    B, Sq = q.shape[:2]
    lengths = cache_seqlens.tolist()  # a CPU tensor: reading it is free
    causal = causal and Sq > 1
    if (B > 1 and block_table is None and not causal and not plan.batch_invariant and lengths[0] > 0
            and lengths.count(lengths[0]) == B):  # a uniform contiguous batch: one call
        _attend(q, k_cache[:, :lengths[0]], v_cache[:, :lengths[0]], out, lse, scale)
        return
    for b, L in enumerate(lengths):
        if L == 0:  # no key (and the kernel takes none): o = 0, lse = -inf
            out[b].zero_()
            lse[b].fill_(NEG_INF)
            continue
        k = _keys(k_cache, b, L, block_table)[None]
        v = _keys(v_cache, b, L, block_table)[None]
        qb, ob, lb = (q, out, lse) if B == 1 else (q[b:b + 1], out[b:b + 1], lse[b:b + 1])
        (_causal_one if causal else _attend)(qb, k, v, ob, lb, scale)


def spec_wanted(plan) -> bool:
    """The spec path runs where its partials can be observed: under debug.capture_partials, and
    for a forced num_splits > 1 (the caller asked for split/merge)."""
    return debug.active() or (getattr(plan, "forced", None) or 1) > 1


def run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
        variant=PLAIN):
    if q.device.type != "cpu" or spec_wanted(plan) or not variant.plain:  # ATen's kernel has no variants
        run_spec(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
                 variant)
    else:
        run_fast(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal)
