"""Correctness column of the bench: every provider's output against splitkv.reference in fp64.

The reference runs on the case's device (the GPU for big shapes). Above FULL_CHECK_BYTES of K+V
it covers a subsample — the first and last request (for ragged batches the shortest and the
longest) and the first and last KV head with all their query heads — and the row's `err_scope`
says so. The subsample is gathered into a small dense cache first (through the block table when
paged), so the reference never touches the full cache in fp64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import decode_reference, gather_keys
from .inputs import Case

# Above this much K+V the fp64 reference covers a subsample (it would otherwise cost more than all
# the timed calls of a row together, and need 4x the cache in fp64 temporaries).
FULL_CHECK_BYTES = 256 * 2**20


@dataclass
class Reference:
    rows: list[int]
    q_heads: list[int]
    o: torch.Tensor  # [len(rows), Sq, len(q_heads), D] fp64
    scope: str

    def error(self, o: torch.Tensor) -> tuple[float, float]:
        """(max |o - ref|, that / max |ref|) over the covered rows and heads; NaN in o gives nan."""
        rows = torch.tensor(self.rows, device=o.device)
        heads = torch.tensor(self.q_heads, device=o.device)
        got = o.index_select(0, rows).index_select(2, heads).to(torch.float64)
        ref = self.o.to(got.device)
        diff = (got - ref).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if torch.isnan(diff).any():
            err = float("nan")
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        return err, (err / scale if scale > 0 else err)


def _pick(n: int, prefer: list[int] | None = None) -> list[int]:
    idx = prefer if prefer is not None else [0, n - 1]
    return sorted(set(i for i in idx if 0 <= i < n))


def build_reference(case: Case) -> Reference:
    s, ts = case.shape, case.base
    full = s.kv_bytes(case.elem_bytes) <= FULL_CHECK_BYTES
    if full:
        rows, kv_heads = list(range(s.batch)), list(range(s.num_kv_heads))
        scope = "all"
    else:
        lengths = list(s.seqlens)
        prefer = None if s.uniform else [lengths.index(min(lengths)), lengths.index(max(lengths))]
        rows, kv_heads = _pick(s.batch, prefer), _pick(s.num_kv_heads)
        scope = f"requests {rows} x kv heads {kv_heads} of B={s.batch}, Hkv={s.num_kv_heads}"
    group = s.num_q_heads // s.num_kv_heads
    q_heads = [h * group + g for h in kv_heads for g in range(group)]
    dev = ts.q.device
    kvh = torch.tensor(kv_heads, device=dev)
    lengths = [s.seqlens[b] for b in rows]
    cap = max(lengths)
    k = torch.zeros(len(rows), cap, len(kv_heads), s.head_dim, dtype=ts.k_cache.dtype, device=dev)
    v = torch.zeros_like(k)
    for i, (b, L) in enumerate(zip(rows, lengths, strict=True)):
        k[i, :L] = gather_keys(ts.k_cache, b, L, ts.block_table).index_select(1, kvh)
        v[i, :L] = gather_keys(ts.v_cache, b, L, ts.block_table).index_select(1, kvh)
    q = ts.q.index_select(0, torch.tensor(rows, device=dev))
    q = q.index_select(2, torch.tensor(q_heads, device=dev))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    kw = dict(case.call_kwargs)
    for name in ("sinks", "alibi_slopes"):  # per query head: the covered heads' values
        if name in kw:
            kw[name] = kw[name].index_select(0, torch.tensor(q_heads, device=kw[name].device))
    o, _ = decode_reference(q, k, v, seqlens, causal=s.causal, **kw)
    return Reference(rows, q_heads, o, scope)
