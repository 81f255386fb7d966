"""The merge (torch and interpreted Triton) against a direct softmax over the union of splits."""

import math

import pytest
import torch

from splitkv.backends import torch_backend
from splitkv.backends.triton import merge as triton_merge

MERGES = {"torch": torch_backend.merge, "triton": lambda *a: triton_merge(*a)}


def _partials(S, B, H, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(S, B, H, T, D, generator=g)
    lse = torch.randn(S, B, H, T, generator=g) * 3
    return o, lse


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_merge_exact_and_ignores_dead_splits(name):
    S, B, H, T, D = 5, 3, 2, 2, 64
    o, lse = _partials(S, B, H, T, D)
    n = torch.tensor([5, 2, 1], dtype=torch.int32)
    lse[1, 0] = -math.inf          # an empty split inside the live range
    o[1, 0] = float("nan")         # ... whose output must never be read
    o[2:, 1] = float("nan")        # splits past num_splits[1] = 2: garbage
    lse[2:, 1] = 1e6
    lse[:, 2] = -math.inf          # request 2: every split empty
    out = torch.empty(B, T, H, D)
    out_lse = torch.empty(B, H, T)
    MERGES[name](o, lse, n, out, out_lse)
    for b in range(B):
        k = int(n[b])
        ls = lse[:k, b].double()
        w = torch.softmax(ls, dim=0).nan_to_num(0.0)
        want = torch.einsum("sht,shtd->thd", w, torch.where(torch.isinf(ls)[..., None], 0.0, o[:k, b].double()))
        want_lse = torch.logsumexp(ls, dim=0)
        assert not torch.isnan(out[b]).any()
        assert torch.allclose(out[b].double(), want, atol=1e-5)
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(out_lse[b]), fin)
        assert torch.allclose(out_lse[b].double()[fin], want_lse[fin], atol=1e-5)
    assert torch.all(out[2] == 0) and torch.all(out_lse[2] == -math.inf)
