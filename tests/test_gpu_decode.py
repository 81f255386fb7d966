"""GPU correctness at real sizes (up to 128K keys), paged decode, and CUDA-graph capture/replay.

Marked `gpu`: skipped without CUDA; run on the H200 by benchmarks/gpu_run.sh (results recorded in
benchmarks/results/). Every check is against splitkv.reference, never another of our kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_to_reference, to_paged

import splitkv
from splitkv import backends
from splitkv.reference import decode_reference

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["triton"] + (["cutlass"] if backends.cutlass_available() else [])


def _inputs(B, Sq, Hq, Hkv, D, lens, dtype, seed=0, pad=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Lmax = max(lens) + pad
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Lmax, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Lmax, Hkv, D, device="cuda", dtype=dtype, generator=g)
    for b, L in enumerate(lens):
        k[b, L:] = float("nan")
        v[b, L:] = float("nan")
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device="cuda")


# (B, Sq, Hq, Hkv, D, lens, dtype): planner-chosen splits at real lengths; ragged with empty rows.
REAL = [
    (1, 1, 32, 8, 128, [131072], torch.bfloat16),
    (1, 1, 32, 32, 128, [32768], torch.float16),
    (4, 1, 32, 8, 128, [4097, 0, 65537, 1], torch.bfloat16),
    (2, 4, 32, 8, 128, [32768, 113], torch.bfloat16),
    (2, 16, 16, 1, 64, [4097, 17], torch.float16),
    (1, 1, 56, 8, 256, [32768], torch.bfloat16),
    (8, 2, 28, 4, 64, [1000, 2000, 5, 0, 4097, 17, 65537, 300], torch.float16),
]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", REAL)
def test_real_sizes(backend, case):
    B, Sq, Hq, Hkv, D, lens, dt = case
    q, k, v, sl = _inputs(B, Sq, Hq, Hkv, D, lens, dt)
    o, lse = splitkv.decode(q, k, v, sl, return_lse=True, backend=backend)
    assert_close_to_reference(o, lse, q, k, v, sl)
    again = splitkv.decode(q, k, v, sl, return_lse=True, backend=backend)
    assert torch.equal(o, again[0]) and torch.equal(lse, again[1]), "not bitwise deterministic"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 3, 17])
def test_forced_splits(backend, num_splits):
    q, k, v, sl = _inputs(3, 2, 32, 8, 128, [32768, 4097, 0], torch.bfloat16)
    o, lse = splitkv.decode(q, k, v, sl, num_splits=num_splits, return_lse=True, backend=backend)
    assert_close_to_reference(o, lse, q, k, v, sl)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_paged(backend, page_size):
    lens = [4097, 0, 32768, 17] if page_size > 1 else [300, 0, 1000, 17]
    q, k, v, sl = _inputs(4, 1, 32, 8, 128, lens, torch.bfloat16)
    kp, vp, bt = to_paged(k, v, lens, page_size)
    o, lse = splitkv.decode(q, kp, vp, sl, block_table=bt, return_lse=True, backend=backend)
    assert_close_to_reference(o, lse, q, kp, vp, sl, block_table=bt, lowp_k=k, lowp_v=v)
    oc = splitkv.decode(q, k, v, sl, backend=backend)
    assert (o.float() - oc.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replay_follows_new_lengths(backend, paged):
    B, Hq, Hkv, D, Lmax = 4, 32, 8, 128, 8192
    q, k, v, sl = _inputs(B, 1, Hq, Hkv, D, [Lmax] * B, torch.bfloat16, pad=0)
    bt = None
    if paged:
        k, v, bt = to_paged(k, v, [Lmax] * B, 16, extra_pages=0)
    p = splitkv.plan(sl, Hq, Hkv, D, max_seqlen=Lmax, backend=backend, paged=paged)
    out = torch.empty_like(q)
    def step():
        p.refresh(sl)  # once per step, captured with the decode
        splitkv.decode(q, k, v, sl, block_table=bt, plan=p, out=out, backend=backend)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([8192, 1, 0, 5000], [17, 4097, 8192, 3], [0, 0, 0, 0]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        if paged:  # move every page to a new physical slot, rewriting the table in place
            perm = torch.randperm(k.shape[0], device="cuda")
            k[perm] = k.clone()
            v[perm] = v.clone()
            bt[:, :-1] = perm[bt[:, :-1].long()].int()  # the last column holds garbage ids: keep it
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        eager = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend)
        assert torch.equal(out, eager) or (out.float() - eager.float()).abs().max() < 1e-2
        ro, _ = decode_reference(q, k, v, sl, block_table=bt)
        assert (out.double() - ro).abs().max().item() < 2e-2
        if lens == [0, 0, 0, 0]:
            assert torch.all(out == 0)


def test_empty_and_causal_nothing_visible():
    q, k, v, sl = _inputs(3, 4, 8, 2, 128, [0, 2, 70000], torch.float16)
    o, lse = splitkv.decode(q, k, v, sl, return_lse=True)
    assert torch.all(o[0] == 0) and torch.all(lse[0] == -math.inf)
    assert torch.all(o[1, :2] == 0) and torch.all(lse[1, :, :2] == -math.inf)
    assert not torch.isnan(o).any()
