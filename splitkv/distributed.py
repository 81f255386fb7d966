"""Context-parallel decode on torch.distributed: one sequence's KV sharded over ranks, merged exactly.

Split-KV's merge by log-sum-exp is what lets ranks that each hold a shard of a sequence attend to
it locally and merge the results exactly: each rank runs `splitkv.decode(..., return_lse=True)`
over its shard, the ranks all-gather their (o, lse) partials (B x Sq x Hq x D values and
B x Hq x Sq LSEs per rank) and every rank merges them with `merge_states_n`. The same code runs on
NCCL (GPUs) and gloo (CPUs); no transport of our own.

A decode step attends to the cache as it was before the step plus the step's own Sq new tokens,
which every rank has (q, k_new and v_new are computed replicated): the cached keys all precede the
new queries, so each rank attends its shard without a mask; the Sq x Sq causal block over the new
tokens runs once, on the group's first rank, folded into its state in one launch
(`splitkv.extend.attend_new_keys`). Then the new tokens are appended to the rank(s) that
own their positions. This is exact for any placement of tokens on ranks.

Placement (ShardedPagedKVCache, `policy`):
  * "contiguous": positions [r * shard_tokens, (r + 1) * shard_tokens) on rank r, the last rank
    taking the rest (ring attention's layout). Appends touch one rank at a time, a rank's shard is
    one run of keys, but a growing sequence loads the last rank only and short sequences leave the
    later ranks idle.
  * "round_robin": page-sized runs dealt in turn, position p on rank (p // page_size) % world.
    Every rank holds ~1/world of every sequence at every length (balanced decode time as the
    sequence grows), at the price of appends that move between ranks every page.

Cost model: `cost_model(...)` predicts a step's time from HBM bandwidth and the all-gather's bytes
(docs in its docstring; `python -m splitkv.distributed --plot cp.png` draws the prediction).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .api import decode
from .cache import PagedKVCache
from .cli_args import _positive_float
from .extend import attend_new_keys
from .merge import merge_states_n
from .pngs import save_png
from .rope import RopeConfig, apply_rope

POLICIES = ("contiguous", "round_robin")


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def decode_context_parallel(q: torch.Tensor, local_k: torch.Tensor, local_v: torch.Tensor,
                            local_lens: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                            block_table: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
                            new_v: torch.Tensor | None = None, causal: bool = True,
                            softmax_scale: float | None = None, backend: str = "auto",
                            return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a sequence whose keys are spread over the ranks of `group`.

    q [B, Sq, Hq, D]: the step's queries, the same on every rank. local_k / local_v / local_lens /
    block_table: this rank's shard of the cache, as for `splitkv.decode` (contiguous or paged); a
    request this rank holds no keys of has local length 0. new_k / new_v [B, Sq, Hkv, D]: the
    step's own keys and values, the same on every rank, not yet in any cache; with them the
    queries see the whole cache plus the new keys causally (bottom-right), which is what a model's
    decode step needs for any Sq. Without them the cache must already hold the step's keys, and
    then Sq must be 1 (a causal Sq > 1 mask needs to know where the newest keys live).
    Returns o [B, Sq, Hq, D] in q's dtype (and lse [B, Hq, Sq] fp32, natural log), equal on every
    rank to a single-process decode over the union of the shards (and the new keys) up to rounding.
    Without torch.distributed initialised it is the single-process decode."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected a tensor [B, Sq, Hq, D], got {getattr(q, 'shape', type(q).__name__)}")
    if (new_k is None) != (new_v is None):
        raise ValueError("new_k/new_v: pass both or neither")
    Sq = q.shape[1]
    if new_k is None and causal and Sq > 1:
        raise ValueError("new_k: a causal decode of Sq > 1 queries needs the step's keys passed as new_k / new_v "
                         "(the cache shards then hold only earlier tokens)")
    kv_heads = local_k.shape[2] if isinstance(local_k, torch.Tensor) and local_k.dim() == 4 else None
    if new_k is not None and (new_k.dim() != 4 or new_k.shape[:2] != q.shape[:2] or new_k.shape != new_v.shape
                              or new_k.shape[2:] != (kv_heads, q.shape[3])):
        raise ValueError(f"new_k/new_v: expected [B, Sq, Hkv, D] = {(*q.shape[:2], kv_heads, q.shape[3])} (the "
                         f"cache's KV heads), got {tuple(new_k.shape)} / {tuple(new_v.shape)}")
    world, rank = _world(group)
    o, lse = decode(q, local_k, local_v, local_lens, block_table=block_table, causal=causal and new_k is None,
                    softmax_scale=softmax_scale, return_lse=True, backend=backend)
    if new_k is not None and rank == 0:  # the Sq new keys: attended once, on the group's first rank
        o, lse = attend_new_keys(o, lse, q, new_k, new_v, causal=causal, softmax_scale=softmax_scale)
    if world > 1:
        os_ = [torch.empty_like(o) for _ in range(world)]
        lses = [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(os_, o.contiguous(), group=group)
        dist.all_gather(lses, lse.contiguous(), group=group)
        o, lse = merge_states_n(torch.stack(os_), torch.stack(lses))
    return (o, lse) if return_lse else o


def owner(position: int | torch.Tensor, policy: str, world: int, *, page_size: int,
          shard_tokens: int | None = None) -> int | torch.Tensor:
    """The rank that holds a sequence's key at `position` (an int, or a tensor of positions) under
    `policy` (module docstring)."""
    if policy == "contiguous":
        shard = position // shard_tokens
        return shard.clamp(max=world - 1) if isinstance(shard, torch.Tensor) else min(shard, world - 1)
    return (position // page_size) % world


class ShardedPagedKVCache:
    """This rank's shard of a KV cache spread over the ranks of `group` (module docstring).

    Every rank makes the same calls in the same order with the same (replicated) arguments; each
    keeps only the tokens it owns, in a PagedKVCache of its own (`local`), so sequence ids agree
    across ranks. RoPE is applied at the global position before the tokens are dealt out."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 policy: str = "round_robin", shard_tokens: int | None = None, num_layers: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 group: dist.ProcessGroup | None = None, backend: str = "auto") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        if policy == "contiguous" and (not isinstance(shard_tokens, int) or shard_tokens < 1):
            raise ValueError(f"shard_tokens: the contiguous policy needs a positive int, got {shard_tokens!r}")
        self.policy, self.shard_tokens, self.page_size, self.group = policy, shard_tokens, page_size, group
        self.world, self.rank = _world(group)
        self.local = PagedKVCache(num_pages, page_size, num_kv_heads, head_dim, num_layers=num_layers, dtype=dtype,
                                  device=device, backend=backend)
        self._global: dict[int, list[int]] = {}  # sequence id -> global length per layer

    def add_sequence(self) -> int:
        sid = self.local.add_sequence()
        self._global[sid] = [0] * self.local.num_layers
        return sid

    def free(self, sid: int) -> None:
        self.local.free(sid)
        del self._global[sid]

    def seq_len(self, sid: int, layer: int = 0) -> int:
        """The sequence's global length (keys over every rank)."""
        self.local._seq(sid, "sid")
        return self._global[sid][self.local._check_layer(layer)]

    def owner(self, position: int | torch.Tensor) -> int | torch.Tensor:
        return owner(position, self.policy, self.world, page_size=self.page_size, shard_tokens=self.shard_tokens)

    def append(self, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, layer: int = 0, *,
               rope: RopeConfig | None = None, lengths: Sequence[int] | None = None) -> None:
        """Append rows t < lengths[i] (default all T) of k, v [N, T, Hkv, D] to sequence i at its
        global positions; this rank stores the rows it owns. Every rank checks the arguments in full
        before anything changes (a rank that owns none of the rows raises as the others do); a
        CacheFullError is each rank's own pool, so size the pools for the shards the policy deals."""
        loc = self.local
        ids = loc._ids(seq_ids, unique=True)
        layer = loc._check_layer(layer)
        loc._lookup(ids)
        counts = loc._check_kv(k, v, len(ids), lengths)
        if rope is not None and not isinstance(rope, RopeConfig):
            raise TypeError(f"rope: expected None or a splitkv.RopeConfig, got {type(rope).__name__}")
        N, T = k.shape[:2]
        starts = [self._global[s][layer] for s in ids]
        if rope is not None:
            pos = torch.tensor(starts, device=k.device)[:, None] + torch.arange(T, device=k.device)
            k = apply_rope(k, pos, rope)
        # the rows this rank owns, moved to the front of each row's order (vectorised: a prompt may
        # hold a million tokens)
        t = torch.arange(T)
        pos = torch.tensor(starts)[:, None] + t
        mine = (self.owner(pos) == self.rank) & (t < torch.tensor(counts)[:, None])
        local_counts = mine.sum(1).tolist()
        width = max(local_counts, default=0)
        if width:
            order = torch.argsort(torch.where(mine, t, t + T), dim=1, stable=True)[:, :width].to(k.device)
            rows = torch.arange(N, device=k.device)[:, None]
            self.local.append(ids, k[rows, order], v[rows, order], layer, lengths=local_counts)
        for s, n in zip(ids, counts):
            self._global[s][layer] += n

    def batch(self, seq_ids: Sequence[int], layer: int = 0, *,
              max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table, local_lens) of this rank's shard, for decode_context_parallel with
        local.k_pages(layer), local.v_pages(layer)."""
        return self.local.batch(seq_ids, layer, max_pages=max_pages)


@dataclass(frozen=True)
class CostModel:
    local_us: float  # one rank streaming its shard of K + V
    comm_us: float  # the all-gather of the partials
    total_us: float
    speedup: float  # single-GPU decode time / total_us


def cost_model(context: int, world: int, *, batch: int = 1, num_q_heads: int = 32, num_kv_heads: int = 8,
               head_dim: int = 128, q_len: int = 1, kv_bytes: int = 2, hbm_tbps: float = 4.8,
               link_gbps: float = 450.0, latency_us: float = 20.0, overhead_us: float = 10.0) -> CostModel:
    """Predicted time of one context-parallel decode step (one layer), in microseconds.

    local = K + V bytes of a 1/world shard / HBM bandwidth (hbm_tbps, TB/s; H200 4.8) + the fixed
    per-call overhead of a decode (overhead_us); comm = all-gather of world partials of
    batch x q_len x num_q_heads x (head_dim + 1) fp32 values, ring-style (world - 1) / world of
    the gathered bytes over the link (link_gbps, GB/s: NVLink ~450 on an H200 node, InfiniBand
    ~50 per GPU) + a per-collective latency (latency_us, twice: o and lse). Speedup is against the
    same model at world 1 with no communication. It ignores overlap of the merge with the next
    layer and assumes an even shard (round_robin, or a contiguous shard at full length)."""
    for name, val in (("context", context), ("world", world), ("batch", batch), ("num_q_heads", num_q_heads),
                      ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("q_len", q_len), ("kv_bytes", kv_bytes)):
        if not isinstance(val, int) or isinstance(val, bool) or val < (0 if name == "context" else 1):
            raise ValueError(f"{name}: expected a {'non-negative' if name == 'context' else 'positive'} int, got {val!r}")
    for name, val in (("hbm_tbps", hbm_tbps), ("link_gbps", link_gbps)):
        if not isinstance(val, (int, float)) or not 0 < val < float("inf"):
            raise ValueError(f"{name}: expected a finite positive number, got {val!r}")
    kv = 2 * batch * context * num_kv_heads * head_dim * kv_bytes
    local = kv / world / (hbm_tbps * 1e12) * 1e6 + overhead_us
    part = batch * q_len * num_q_heads * (head_dim + 1) * 4
    comm = 0.0 if world == 1 else (world - 1) * part / (link_gbps * 1e9) * 1e6 + 2 * latency_us
    single = kv / (hbm_tbps * 1e12) * 1e6 + overhead_us
    total = local + comm
    return CostModel(local, comm, total, single / total)


def plot_cost_model(path: str, *, worlds: Sequence[int] = (2, 4, 8, 16, 32, 64), **kw: float) -> None:
    """Predicted speedup vs context length per world size (cost_model's keywords pass through)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [2 ** p for p in range(12, 21)]  # 4K .. 1M
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in worlds:
        ax.plot(contexts, [cost_model(c, w, **kw).speedup for c in contexts], marker="o", label=f"{w} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("predicted speedup vs 1 GPU")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("context-parallel decode, cost model\nB=1, GQA 32/8, D 128, bf16, H200 HBM, one link bandwidth "
                 "for every world size", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def overhead(contexts: Sequence[int] = (131072, 524288), device: str = "cuda") -> list[dict]:
    """The context-parallel path's own cost at world size 1 on one GPU (B=1, GQA 32/8, D 128, bf16,
    contiguous cache, eager, L2 flushed): plain decode over L + 1 keys (the step's key already
    cached) vs decode_context_parallel over L cached keys + the step's key passed as new_k / new_v."""
    from triton.testing import do_bench

    rows = []
    for L in contexts:
        g = torch.Generator(device).manual_seed(0)
        k, v = (torch.randn(1, L + 1, 8, 128, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(1, 1, 32, 128, generator=g, device=device, dtype=torch.bfloat16)
        full, cached = (torch.tensor([n], dtype=torch.int32, device=device) for n in (L + 1, L))
        nk, nv = k[:, L:L + 1], v[:, L:L + 1]
        plain = do_bench(lambda: decode(q, k, v, full), return_mode="median")  # noqa: B023 - timed now
        cp = do_bench(lambda: decode_context_parallel(q, k, v, cached, new_k=nk, new_v=nv),  # noqa: B023
                      return_mode="median")
        rows.append({"context": L, "plain_us": plain * 1e3, "cp_world1_us": cp * 1e3, "overhead": cp / plain - 1})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitkv.distributed",
                                 description="Print (and plot) the context-parallel cost model.")
    ap.add_argument("--plot", help="PNG path for the predicted speedup curves")
    ap.add_argument("--link-gbps", type=_positive_float, default=450.0, help="all-gather bandwidth per GPU, GB/s")
    ap.add_argument("--overhead", action="store_true", help="measure the world-size-1 overhead on this GPU")
    a = ap.parse_args(argv)
    if a.overhead and not torch.cuda.is_available():
        ap.error("--overhead: measures on a CUDA GPU; none is available here")
    if a.overhead:
        for r in overhead():
            print(f"context {r['context']}: plain decode {r['plain_us']:.1f} us, context-parallel at world 1 "
                  f"{r['cp_world1_us']:.1f} us ({100 * r['overhead']:+.1f} %)")
    print(f"{'context':>9} " + " ".join(f"{w:>7}" for w in (2, 4, 8, 16)))
    for p in range(12, 21):
        c = 2 ** p
        print(f"{c:>9} " + " ".join(f"{cost_model(c, w, link_gbps=a.link_gbps).speedup:7.2f}" for w in (2, 4, 8, 16)))
    if a.plot:
        plot_cost_model(a.plot, link_gbps=a.link_gbps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["decode_context_parallel", "ShardedPagedKVCache", "owner", "cost_model", "plot_cost_model", "POLICIES",
           "CostModel"]
