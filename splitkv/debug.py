"""Debug hook: see the split partials of real decode calls (no second code path).

    with splitkv.debug.capture_partials() as records:
        splitkv.decode(q, k, v, seqlens)
    rec = records[0]   # DecodeRecord: plan, lse_part [S, B, Hq, Sq], o_part [S, B, Hq, Sq, D] (cpu)

Only the first plan.num_splits[b] splits of request b are meaningful; a request of one split
holds its final state there (o in the output's dtype, lse with any sinks joined): the kernels
write such a request straight to the output, not to the partials. Capturing copies the
partials to the host after each call, so it synchronises: use it for diagnostics, not in serving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .plan import DecodePlan

_ACTIVE: list[list] = []


@dataclass
class DecodeRecord:
    plan: DecodePlan
    cache_seqlens: torch.Tensor
    num_splits: torch.Tensor  # [B]
    lse_part: torch.Tensor  # [S, B, Hq, Sq] fp32; S = 1 and equal to the final lse when nothing split
    o_part: torch.Tensor | None  # [S, B, Hq, Sq, D] fp32, None when nothing split


@contextlib.contextmanager
def capture_partials() -> Iterator[list[DecodeRecord]]:
    records: list[DecodeRecord] = []
    _ACTIVE.append(records)
    try:
        yield records
    finally:
        _ACTIVE.remove(records)


def active() -> bool:
    return bool(_ACTIVE)


def record(plan: DecodePlan, cache_seqlens: torch.Tensor, o_part: torch.Tensor | None, lse_part: torch.Tensor | None,
           lse: torch.Tensor, o: torch.Tensor) -> None:
    """o [B, Sq, Hq, D], lse [B, Hq, Sq]: the call's output (one-split requests' split 0, see above)."""
    lse_f = lse.detach().float().cpu()
    num_splits = plan.num_splits.detach().cpu().clone()
    if o_part is None:
        lse_p, o_p = lse_f[None].clone(), None
    else:
        lse_p, o_p = lse_part.detach().cpu().clone(), o_part.detach().cpu().clone()
        one = num_splits[: lse_f.shape[0]] == 1
        lse_p[0, one] = lse_f[one]
        o_p[0, one] = o.detach().float().cpu().transpose(1, 2)[one]
    rec = DecodeRecord(plan, cache_seqlens.detach().cpu().clone(), num_splits, lse_p, o_p)
    for records in _ACTIVE:
        records.append(rec)
