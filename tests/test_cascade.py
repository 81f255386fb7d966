"""cascade_decode (shared prefix attended once + per-request suffix, merged) against the fp64
reference over each request's concatenated [prefix | suffix] keys."""

from __future__ import annotations

import pytest
import torch

from splitkv.cache import PagedKVCache
from splitkv.cascade import cascade_decode
from splitkv.reference import decode_reference

BF16 = torch.bfloat16


def _problem(B, Sq, Hq, Hkv, D, prefix_len, suffix_lens, dtype, seed=0, device="cpu"):
    """q, prefix [Lp + 3, Hkv, D] (NaN past prefix_len), suffixes [B, Ls, Hkv, D] (NaN past each
    length), and the dense concatenation [B, prefix_len + Ls, Hkv, D] the reference reads."""
    g = torch.Generator().manual_seed(seed)
    Ls = max(suffix_lens) + 2
    q = torch.randn(B, Sq, Hq, D, generator=g)
    pk, pv = (torch.randn(prefix_len + 3, Hkv, D, generator=g) for _ in range(2))
    sk, sv = (torch.randn(B, Ls, Hkv, D, generator=g) for _ in range(2))
    full_k = torch.cat((pk[:prefix_len].expand(B, -1, -1, -1), sk), 1)
    full_v = torch.cat((pv[:prefix_len].expand(B, -1, -1, -1), sv), 1)
    pk[prefix_len:] = pv[prefix_len:] = float("nan")
    for b, L in enumerate(suffix_lens):
        sk[b, L:] = sv[b, L:] = float("nan")
    sl = torch.tensor(suffix_lens, dtype=torch.int32)
    to = lambda t: t.to(device=device, dtype=dtype)
    return to(q), to(pk), to(pv), to(sk), to(sv), sl.to(device), full_k.to(dtype), full_v.to(dtype)


def _check(o, lse, q, full_k, full_v, total, atol):
    ro, rl = decode_reference(q.cpu(), full_k, full_v, total)
    assert not torch.isnan(o).any()
    assert (o.cpu().double() - ro).abs().max() <= atol
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu().double()[fin] - rl[fin]).abs().max() <= 1e-3


# (B, Sq, Hq, Hkv, prefix_len, suffix_lens, num_splits): GQA 1/4/7, Sq 1 and 3 (causal inside
# the suffix), an empty prefix, a one-key suffix, forced splits
CASES = [
    (3, 1, 8, 2, 300, [1, 17, 113], None),
    (2, 3, 8, 2, 77, [3, 40], 3),
    (4, 1, 7, 1, 0, [5, 1, 9, 2], None),
    (1, 2, 4, 4, 513, [2], 2),
    (2, 1, 8, 2, 64, [0, 10], None),  # Sq = 1: an empty suffix leaves the prefix alone
]


@pytest.mark.parametrize("case", CASES)
def test_cascade_equals_decode_over_concatenation(case):
    B, Sq, Hq, Hkv, P, lens, ns = case
    q, pk, pv, sk, sv, sl, fk, fv = _problem(B, Sq, Hq, Hkv, 64, P, lens, torch.float32)
    o, lse = cascade_decode(q, pk, pv, P, sk, sv, sl, num_splits=ns, return_lse=True, backend="torch")
    assert o.shape == q.shape and lse.shape == (B, Hq, Sq)
    _check(o, lse, q, fk, fv, sl + P, 1e-5)


def test_cascade_paged_prefix_and_suffixes_share_one_pool():
    B, Sq, Hq, Hkv, D, P, ps = 3, 2, 8, 2, 64, 150, 16
    lens = [2, 31, 70]
    q, pk, pv, sk, sv, sl, fk, fv = _problem(B, Sq, Hq, Hkv, D, P, lens, torch.float32, seed=4)
    cache = PagedKVCache(64, ps, Hkv, D, dtype=torch.float32, device="cpu")
    pid = cache.add_sequence()
    cache.append([pid], pk[None, :P], pv[None, :P])
    sids = [cache.add_sequence() for _ in range(B)]
    cache.append(sids, sk[:, :max(lens)].contiguous(), sv[:, :max(lens)].contiguous(), lengths=lens)
    p_table, p_len = cache.batch([pid])
    s_table, s_lens = cache.batch(sids)
    kp, vp = cache.k_pages(), cache.v_pages()
    o, lse = cascade_decode(q, kp, vp, p_len, kp, vp, s_lens, prefix_block_table=p_table[0],
                            suffix_block_table=s_table, return_lse=True, backend="torch")
    _check(o, lse, q, fk, fv, sl + P, 1e-5)


def test_cascade_triton_interpreted_bf16():
    B, Sq, Hq, Hkv, P = 2, 1, 8, 2, 200
    lens = [9, 130]
    q, pk, pv, sk, sv, sl, fk, fv = _problem(B, Sq, Hq, Hkv, 64, P, lens, BF16, seed=5)
    o, lse = cascade_decode(q, pk, pv, P, sk, sv, sl, num_splits=2, return_lse=True, backend="triton")
    assert o.dtype == BF16
    _check(o, lse, q, fk, fv, sl + P, 2e-2)


def test_cascade_compiles_without_graph_break():
    torch._dynamo.reset()
    B, Sq, Hq, Hkv, P = 2, 1, 4, 2, 90
    q, pk, pv, sk, sv, sl, fk, fv = _problem(B, Sq, Hq, Hkv, 64, P, [4, 33], torch.float32, seed=6)
    plen = torch.tensor([P], dtype=torch.int32)
    f = lambda *a: cascade_decode(*a, return_lse=True, backend="torch")
    o, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, pk, pv, plen, sk, sv, sl)
    _check(o, lse, q, fk, fv, sl + P, 1e-5)


def test_cascade_validates_inputs():
    q, pk, pv, sk, sv, sl, _, _ = _problem(2, 2, 8, 2, 64, 10, [1, 5], torch.float32)
    with pytest.raises(ValueError, match="suffix_seqlens"):  # causal Sq = 2 needs both new tokens
        cascade_decode(q, pk, pv, 10, sk, sv, sl, backend="torch")
    sl = torch.tensor([2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="prefix_len"):
        cascade_decode(q, pk, pv, -1, sk, sv, sl, backend="torch")
    with pytest.raises(ValueError, match="prefix_k"):
        cascade_decode(q, pk[None], pv[None], 10, sk, sv, sl, backend="torch")
    with pytest.raises(ValueError, match="prefix_v"):
        cascade_decode(q, pk, pv[:3], 10, sk, sv, sl, backend="torch")
    with pytest.raises(ValueError, match="prefix_k"):
        cascade_decode(q, pk[..., :32], pv, 10, sk, sv, sl, backend="torch")
    with pytest.raises(ValueError, match="prefix_len: expected an int in \\[0, 13\\]"):  # past the prefix
        cascade_decode(q, pk, pv, 14, sk, sv, sl, backend="torch")
    with pytest.raises(TypeError, match="prefix_len: expected an integer tensor"):
        cascade_decode(q, pk, pv, torch.tensor([3.7]), sk, sv, sl, backend="torch")
    with pytest.raises(TypeError, match="prefix_k: dtype"):
        cascade_decode(q, pk.double(), pv.double(), 10, sk, sv, sl, backend="torch")
    with pytest.raises(ValueError, match="suffix_k: 1 KV heads do not match prefix_k's 2"):
        cascade_decode(q, pk, pv, 10, sk[:, :, :1], sv[:, :, :1], sl, backend="torch")
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        cascade_decode(None, pk, pv, 10, sk, sv, sl, backend="torch")
    with pytest.raises(ValueError, match="prefix_len: expected a length in \\[0, 13\\]"):  # a tensor past it
        cascade_decode(q, pk, pv, torch.tensor(14), sk, sv, sl, backend="torch")
    with pytest.raises(TypeError, match="prefix_v: dtype"):
        cascade_decode(q, pk, pv.double(), 10, sk, sv, sl, backend="torch")
    pool = torch.randn(4, 4, 2, 64)
    with pytest.raises(TypeError, match="prefix_block_table: expected dtype int32"):
        cascade_decode(q, pool, pool, 8, sk, sv, sl, prefix_block_table=torch.tensor([0, 1]), backend="torch")


def test_cascade_of_no_request_is_empty():
    q, pk, pv, sk, sv, sl, _, _ = _problem(2, 1, 8, 2, 64, 10, [1, 5], torch.float32)
    o, lse = cascade_decode(q[:0], pk, pv, 10, sk[:0], sv[:0], sl[:0], return_lse=True, backend="torch")
    assert o.shape == (0, 1, 8, 64) and lse.shape == (0, 8, 1)


@pytest.mark.gpu
def test_gpu_cascade_bf16_many_requests():
    B, Sq, Hq, Hkv, P = 16, 1, 32, 8, 8000
    lens = [1 + 97 * b for b in range(B)]
    q, pk, pv, sk, sv, sl, fk, fv = _problem(B, Sq, Hq, Hkv, 128, P, lens, BF16, seed=7, device="cuda")
    o, lse = cascade_decode(q, pk, pv, P, sk, sv, sl, return_lse=True)
    _check(o, lse, q, fk, fv, sl.cpu() + P, 2e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_group_prefix_decode_merged_with_the_suffix_equals_plain_decode(backend):
    """Two groups of forks (3 samples of a 40-token prompt, 2 of a 23-token one) and a request in no
    group, in one paged batch: the grouped prefix state merged with each row's suffix state equals
    decode over each row's whole table (and the fp64 reference)."""
    from splitkv import decode, group_prefix_decode, merge_states

    ps, Hq, Hkv, D = 8, 8, 2, 32
    g = torch.Generator().manual_seed(4)
    cache = PagedKVCache(64, ps, Hkv, D, dtype=torch.float32 if backend == "torch" else BF16, device="cpu",
                         backend="torch")
    rows = []
    for n, L in ((3, 40), (2, 23), (1, 17)):
        lead = cache.add_sequence()
        kv = torch.randn(2, 1, L, Hkv, D, generator=g)
        cache.append([lead], kv[0], kv[1])
        rows += [lead] + [cache.fork(lead) for _ in range(n - 1)]
    for _ in range(5):  # every request appends its own tokens (copy on write of the shared partial page)
        kv = torch.randn(2, len(rows), 1, Hkv, D, generator=g)
        cache.append(rows, kv[0], kv[1])
    table, lens = cache.batch(rows)
    B = len(rows)
    q = torch.randn(B, 1, Hq, D, generator=g).to(cache.dtype)
    members = torch.tensor([[0, 1, 2], [3, 4, B], [B, B, B]])  # slot 2: empty
    group_pages = torch.tensor([40 // ps, 23 // ps, 0], dtype=torch.int32)
    row_pages = torch.tensor([5, 5, 5, 2, 2, 0], dtype=torch.int32)
    o_p, lse_p = group_prefix_decode(q, cache.k_pages(), cache.v_pages(), table, members, group_pages * ps,
                                     backend=backend)
    cols = (row_pages.long()[:, None] + torch.arange(table.shape[1])).clamp(max=table.shape[1] - 1)
    o_s, lse_s = decode(q, cache.k_pages(), cache.v_pages(), lens - row_pages * ps, block_table=table.gather(1, cols),
                        return_lse=True, backend=backend)
    o, lse = merge_states(o_s, lse_s, o_p, lse_p)
    ref_o, ref_lse = decode(q, cache.k_pages(), cache.v_pages(), lens, block_table=table, return_lse=True,
                            backend=backend)
    tol = 1e-5 if backend == "torch" else 2e-2
    assert (o.float() - ref_o.float()).abs().max() < tol
    assert (lse - ref_lse).abs().max() < 1e-3
    assert torch.isinf(lse_p[5]).all() and not o_p[5].any()  # the row in no group: the empty state


def test_group_prefix_decode_folds_each_member_into_its_own_heads():
    """Sq 3, GQA 3, a strided q (as a model's transposed query is): each member's state equals decode
    of that member alone over its group's prefix; a row in no group gets (0, -inf), even when its
    query is NaN; a gather made once (prefix_gather) gives the same bits as one made per call."""
    from splitkv import decode, group_prefix_decode, prefix_gather

    B, Sq, Hq, Hkv, D, ps = 5, 3, 6, 2, 32, 4
    g = torch.Generator().manual_seed(11)
    kp, vp = (torch.randn(12, ps, Hkv, D, generator=g) for _ in range(2))
    table = torch.randperm(12, generator=g).int().view(3, 4).repeat(2, 1)[:B]
    q = torch.randn(B, Hq, Sq, D, generator=g).transpose(1, 2)  # [B, Sq, Hq, D], not contiguous
    q[4] = float("nan")
    members = torch.tensor([[2, 0, B], [3, B, B], [B, B, B]])  # row 1 shares row 0's table but is in no group
    table[2] = table[0]
    prefix_lens = torch.tensor([8, 12, 0], dtype=torch.int32)
    o, lse = group_prefix_decode(q, kp, vp, table, members, prefix_lens, backend="torch")
    for grp, rows in ((0, (2, 0)), (1, (3,))):
        for r in rows:
            ref_o, ref_lse = decode(q[r:r + 1], kp, vp, prefix_lens[grp:grp + 1], block_table=table[r:r + 1],
                                    causal=False, return_lse=True, backend="torch")
            assert (o[r] - ref_o[0]).abs().max() < 1e-5 and (lse[r] - ref_lse[0]).abs().max() < 1e-5
    for r in (1, 4):
        assert not o[r].any() and torch.isneginf(lse[r]).all()
    o2, lse2 = group_prefix_decode(q, kp, vp, table, members, prefix_lens, backend="torch",
                                   gather=prefix_gather(members, B, Sq, Hq, Hkv))
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
