"""Attention variants (sliding window, softcap, sinks, ALiBi) and head dims beyond 64/128/256.

The reference is checked first against a naive per-query loop written from FlashAttention's
convention (the sink as an extra softmax column); then every backend against the reference over
odd sizes, GQA, Sq 1..16 causal, paged caches with NaN-poisoned unused pages, and split counts
that put window edges inside splits and across page boundaries. GPU variants of the same checks
run at real lengths on the H200.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_within, make_inputs, to_paged, variant_bound

import splitkv
from splitkv import backends
from splitkv.constants import HEAD_DIMS as C_HEAD_DIMS
from splitkv.heuristics import SplitRule, schedule
from splitkv.reference import decode_reference

BF16 = torch.bfloat16
CPU_BACKENDS = ["torch"] + (["triton"] if backends.triton_available() else [])


def _naive(q, k, v, lens, *, causal=True, window=(-1, -1), softcap=0.0, sinks=None, alibi=None):
    """One query at a time, straight from the definition, in fp64 (contiguous caches)."""
    B, Sq, Hq, D = q.shape
    G = Hq // k.shape[2]
    o = torch.zeros(B, Sq, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        for i in range(Sq):
            p = L - Sq + i
            for h in range(Hq):
                logits, vals = [], []
                for j in range(L):
                    if (causal and j > p) or (window[0] >= 0 and j < p - window[0]) or \
                            (window[1] >= 0 and j > p + window[1]):
                        continue
                    s = float(q[b, i, h].double() @ k[b, j, h // G].double()) / math.sqrt(D)
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        s -= float(alibi[h]) * abs(j - p)
                    logits.append(s)
                    vals.append(v[b, j, h // G].double())
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    vals.append(torch.zeros(D, dtype=torch.float64))
                if not logits or max(logits) == -math.inf:
                    continue
                t = torch.tensor(logits, dtype=torch.float64)
                w = torch.softmax(t, 0)
                o[b, i, h] = (w[:, None] * torch.stack(vals)).sum(0)
                lse[b, h, i] = torch.logsumexp(t, 0)
    return o, lse


NAIVE_CASES = [
    dict(window=(5, -1)),
    dict(window=(0, -1)),
    dict(window=(3, 2), causal=False),
    dict(softcap=2.0),
    dict(alibi=True),
    dict(sinks=True),
    dict(window=(6, -1), softcap=3.0, sinks=True, alibi=True),
]


@pytest.mark.parametrize("case", NAIVE_CASES, ids=str)
def test_reference_matches_naive_definition(case):
    q, k, v, lens = make_inputs(2, 3, 4, 2, 8, [13, 2], torch.float64, nan_tail=False, seed=5)
    q = q * 3  # large logits: softcap and sinks matter
    sinks = torch.tensor([4.0, -1.0, -math.inf, 0.5], dtype=torch.float32) if case.get("sinks") else None
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32) if case.get("alibi") else None
    causal = case.get("causal", True)
    window, softcap = case.get("window", (-1, -1)), case.get("softcap", 0.0)
    ro, rl = decode_reference(q, k, v, lens, causal=causal, window_size=window, softcap=softcap, sinks=sinks,
                              alibi_slopes=alibi)
    no, nl = _naive(q, k, v, lens, causal=causal, window=window, softcap=softcap, sinks=sinks, alibi=alibi)
    assert torch.allclose(ro, no, atol=1e-12) and torch.allclose(rl, nl, atol=1e-12, equal_nan=False)


def _variant_kwargs(name, Hq, g):
    if name == "window":
        return dict(window_size=(int(torch.randint(0, 40, (1,), generator=g)), -1))
    if name == "window0":
        return dict(window_size=(0, -1))
    if name == "softcap":
        return dict(softcap=30.0)
    if name == "sinks":
        s = torch.randn(Hq, generator=g) * 4 + 6  # most of the probability mass
        s[0] = -math.inf
        return dict(sinks=s)
    if name == "alibi":
        return dict(alibi_slopes=torch.rand(Hq, generator=g) * 0.2)
    return dict(window_size=(17, -1), softcap=50.0, sinks=torch.randn(Hq, generator=g),
                alibi_slopes=torch.rand(Hq, generator=g) * 0.05)


def _check(o, lse, ro, rl, dtype):
    assert_within(o, lse, ro, rl, variant_bound(dtype))


# (B, Sq, Hq, Hkv, D, lens): odd sizes, GQA, Sq up to 16, an empty request
SHAPES = [
    (2, 1, 8, 2, 40, [300, 0]),
    (3, 4, 6, 3, 80, [97, 5, 256]),
    (1, 16, 4, 1, 48, [203]),
]
VARIANTS = ["window", "window0", "softcap", "sinks", "alibi", "all"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backends_match_reference(backend, paged, variant, shape):
    B, Sq, Hq, Hkv, D, lens = shape
    dtype = torch.float32 if backend == "torch" else BF16
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, dtype, seed=len(variant) + D)
    q = q * 4  # large-magnitude scores: softcap and the window edges matter
    g = torch.Generator().manual_seed(D + Sq)
    kw = _variant_kwargs(variant, Hq, g)
    bt = None
    if paged:
        k, v, bt = to_paged(k, v, lens, 16)
    ro, rl = decode_reference(q, k, v, sl, block_table=bt, **kw)
    for num_splits in (None, 3, 7):  # window edges inside splits and across page boundaries
        o, lse = splitkv.decode(q, k, v, sl, block_table=bt, return_lse=True, num_splits=num_splits,
                                backend=backend, **kw)
        _check(o, lse, ro, rl, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("D", [32, 56, 96, 112, 160, 192, 256])
def test_head_dims(backend, D):
    dtype = torch.float32 if backend == "torch" else BF16
    q, k, v, sl = make_inputs(2, 2, 4, 2, D, [77, 130], dtype, seed=D)
    ro, rl = decode_reference(q, k, v, sl)
    for num_splits in (None, 3):
        o, lse = splitkv.decode(q, k, v, sl, return_lse=True, num_splits=num_splits, backend=backend)
        _check(o, lse, ro, rl, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("softcap", [1e8, 1e4, 50.0, 0.3])
def test_softcap_keeps_its_scores_at_any_cap(backend, softcap):
    """A cap far above the scores leaves them (nearly) unchanged: tanh must not cancel to 0 there."""
    q, k, v, sl = make_inputs(1, 1, 2, 1, 64, [64], torch.float16, seed=3)
    ro = decode_reference(q, k, v, sl, softcap=softcap)[0]
    o = splitkv.decode(q, k, v, sl, softcap=softcap, backend=backend)
    assert (o.double() - ro).abs().max() < 2e-3


def test_window_is_split_aware():
    """The planner splits only the keys a window shows, and no split reads a key before it."""
    rule = SplitRule("forced", 16, 4, splits=4, span_cap=1 + 64)
    n, chunk = schedule(torch.tensor([100_000, 40, 0], dtype=torch.int32), rule)
    assert chunk[0].item() * n[0].item() <= 4 * 32  # 65 keys (block_n-aligned chunks) in 4 splits, not 100K
    # poison every key before the window: a kernel that reads one returns NaN
    q, k, v, sl = make_inputs(1, 1, 4, 1, 64, [5000], torch.float32, seed=3)
    k[0, :5000 - 1 - 64] = float("nan")
    v[0, :5000 - 1 - 64] = float("nan")
    o, lse = splitkv.decode(q, k, v, sl, window_size=(64, -1), return_lse=True, num_splits=3, backend="torch")
    ro, rl = decode_reference(q, k, v, sl, window_size=(64, -1))
    _check(o, lse, ro, rl, torch.float32)
    p = splitkv.plan(sl, 4, 1, 64, window_size=(64, -1), backend="torch")
    assert p.rule.span_cap == 65 and p.max_splits == 1  # 65 keys: nothing worth splitting


def test_sink_enters_once_per_row():
    """With sinks, a row that sees no key is o = 0, lse = sink; any split count gives one result."""
    q, k, v, sl = make_inputs(2, 1, 4, 2, 64, [0, 900], torch.float32, seed=1)
    sinks = torch.tensor([1.0, 2.0, -math.inf, 0.0])
    outs = [splitkv.decode(q, k, v, sl, sinks=sinks, return_lse=True, num_splits=n, backend="torch")
            for n in (1, 2, 9)]
    for o, lse in outs:
        assert torch.all(o[0] == 0)
        assert torch.equal(lse[0, :, 0], sinks)
        assert torch.allclose(o, outs[0][0], atol=1e-6) and torch.allclose(lse, outs[0][1], atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_infinite_sink_takes_the_whole_row(backend, device="cpu", D=64):
    """sink = +inf: the row's softmax is all sink, o = 0 and lse = +inf (the reference's value), with
    or without keys and for any split count; the other heads are untouched."""
    dtype = torch.float32 if backend == "torch" else torch.float16
    q, k, v, sl = (t.to(device) for t in make_inputs(2, 1, 4, 2, D, [50, 0], dtype, seed=2))
    sinks = torch.tensor([math.inf, 0.3, -1.0, 2.0], device=device)
    ro, rl = decode_reference(q.cpu(), k.cpu(), v.cpu(), sl.cpu(), sinks=sinks.cpu())
    for n in (1, 2, 9):
        o, lse = splitkv.decode(q, k, v, sl, sinks=sinks, return_lse=True, num_splits=n, backend=backend)
        o, lse = o.cpu(), lse.cpu()
        assert torch.all(o[:, :, 0] == 0) and torch.all(lse[:, 0] == math.inf), n
        assert (o.double() - ro).abs().max() < 5e-3 and (lse[:, 1:].double() - rl[:, 1:]).abs().max() < 5e-3


def test_plan_carries_the_variant():
    q, k, v, sl = make_inputs(1, 1, 4, 2, 64, [300], BF16 if "triton" in CPU_BACKENDS else torch.float32)
    p = splitkv.plan(sl, 4, 2, 64, window_size=(32, -1), softcap=20.0, backend=CPU_BACKENDS[-1])
    splitkv.decode(q, k, v, sl, plan=p, window_size=(32, -1), softcap=20.0)
    with pytest.raises(ValueError, match="plan: made for the variant"):
        splitkv.decode(q, k, v, sl, plan=p)
    with pytest.raises(ValueError, match="plan: made for the variant"):
        splitkv.decode(q, k, v, sl, plan=p, window_size=(32, -1), softcap=20.0, sinks=torch.zeros(4))


@pytest.mark.parametrize("kw, match", [
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=5), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks"),
    (dict(alibi_slopes=[0.1] * 4), "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(2, 4)), "alibi_slopes"),
])
def test_bad_variant_arguments_are_named(kw, match):
    q, k, v, sl = make_inputs(1, 1, 4, 2, 64, [10], torch.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        splitkv.decode(q, k, v, sl, **kw)


def test_scalar_variants_are_checked_once_and_bad_values_every_time():
    """A call whose options are Python scalars reuses the Variant its options made (same object, same
    result); a value make() rejects raises on every call, also after a valid value of equal hash
    (True == 1, a list window) or the same scales on another cache dtype was remembered."""
    from splitkv import variants as V

    q, k, v, sl = make_inputs(1, 1, 4, 2, 64, [40], torch.float32)
    kw = dict(window_size=(8, -1), softcap=20.0)
    o1 = splitkv.decode(q, k, v, sl, **kw)
    hit = V._SCALAR_VARIANTS[V.scalar_key((8, -1), 20.0, None, None, k.dtype)]
    assert (hit.window_left, hit.softcap) == (8, 20.0)
    assert torch.equal(splitkv.decode(q, k, v, sl, **kw), o1)
    assert V._SCALAR_VARIANTS[V.scalar_key((8, -1), 20.0, None, None, k.dtype)] is hit
    splitkv.decode(q, k, v, sl, window_size=(1, -1), softcap=1)  # remembered: (True, -1) and True equal these
    for bad, match in ((dict(window_size=(True, -1), softcap=1), "window_size"),
                       (dict(window_size=(1, -1), softcap=True), "softcap"),
                       (dict(window_size=(8, -1), softcap=True), "softcap"),
                       (dict(window_size=(8, -1), softcap=float("nan")), "softcap"),
                       (dict(k_scale=0.5, v_scale=2.0), "k_scale")):  # scales on a float32 cache
        for _ in range(2):
            with pytest.raises((ValueError, TypeError), match=match):
                splitkv.decode(q, k, v, sl, **bad)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    qb = q.to(BF16)
    o8 = splitkv.decode(qb, k8, v8, sl, k_scale=0.5, v_scale=2.0)  # the same floats on an fp8 cache: fine
    assert torch.equal(splitkv.decode(qb, k8, v8, sl, k_scale=0.5, v_scale=2.0), o8)
    for _ in range(2):
        with pytest.raises(ValueError, match="k_scale"):
            splitkv.decode(qb, k8, v8, sl, k_scale=float("nan"), v_scale=2.0)
    with pytest.raises(ValueError, match="k_scale"):
        splitkv.decode(q, k, v, sl, k_scale=0.5, v_scale=2.0)
    ptrs = V._SCALAR_VARIANTS[V.scalar_key((-1, -1), 0.0, 0.5, 2.0, k8.dtype)].pointers()
    assert ptrs == (0, 0, 0, 0)  # per-tensor scales are folded into the launch, no tensor pointer


def test_bad_head_dims_are_named():
    for D in (24, 36, 264):
        q, k, v, sl = make_inputs(1, 1, 2, 1, D, [10], torch.float32)
        with pytest.raises(ValueError, match="head dim"):
            splitkv.decode(q, k, v, sl)


def test_cutlass_refuses_what_it_cannot_run():
    from splitkv.plan import build
    from splitkv.validate import Problem

    prob = Problem(1, 1, 4, 2, 72, 1024, None, BF16)  # 72: torch and triton only
    with pytest.raises(ValueError, match="backend: 'cutlass' runs head dims"):
        build(prob, "cpu", backend="cutlass")
    prob = Problem(1, 1, 4, 2, 64, 1024, 16, BF16, kv_fp8=True)  # fp8 caches: D 128 / 256 only
    with pytest.raises(ValueError, match=r"fp8 caches: \(128, 256\)"):
        build(prob, "cpu", backend="cutlass")


def test_compiled_decode_takes_variants():
    q, k, v, sl = make_inputs(2, 1, 4, 2, 64, [50, 7], torch.float32)
    sinks = torch.randn(4)

    def step(q, k, v, sl):
        return splitkv.decode(q, k, v, sl, window_size=(8, -1), softcap=10.0, sinks=sinks)

    got = torch.compile(step, fullgraph=True, backend="eager")(q, k, v, sl)
    want = decode_reference(q, k, v, sl, window_size=(8, -1), softcap=10.0, sinks=sinks)[0]
    assert (got.double() - want).abs().max().item() < 1e-5


# --- H200 -----------------------------------------------------------------------------------------

GPU_BACKENDS = ["triton", "auto"] + (["cutlass"] if backends.cutlass_available() else [])


@pytest.mark.gpu
@pytest.mark.skipif(not backends.cutlass_available(), reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES + [(2, 1, 8, 2, 96, [300, 0]), (3, 2, 4, 4, 192, [97, 5, 256])], ids=str)
def test_gpu_cutlass_variants_match_reference(paged, variant, shape):
    """The CuTe kernels on the odd-size matrix: window edges inside splits and across pages, sinks
    with most of the mass and -inf, softcap with large scores, ALiBi with GQA; one split (the sink
    in the split kernel's store), 3 (fused merge) and 40 (the merge kernel)."""
    B, Sq, Hq, Hkv, D, lens = shape
    if D not in C_HEAD_DIMS:
        D = 64
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, BF16, "cuda", seed=len(variant) + D)
    q = q * 4
    g = torch.Generator().manual_seed(D + Sq)
    kw = {key: (val.cuda() if isinstance(val, torch.Tensor) else val)
          for key, val in _variant_kwargs(variant, Hq, g).items()}
    bt = None
    ro, rl = decode_reference(q, k, v, sl, **kw)
    if paged:
        k, v, bt = to_paged(k, v, lens, 16)  # unused pages and page tails hold NaN
    elif "window_size" in kw:  # NaN in every key before the first one a window shows: never read
        first = (sl - Sq - kw["window_size"][0]).clamp(min=0)
        for b in range(B):
            k[b, : int(first[b])] = float("nan")
            v[b, : int(first[b])] = float("nan")
    for num_splits in (1, 3, 40):
        o, lse = splitkv.decode(q, k, v, sl, block_table=bt, return_lse=True, num_splits=num_splits,
                                backend="cutlass", **kw)
        _check(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", [
    (1, 1, 32, 8, 128, [131072], dict(window_size=(4096, -1))),
    (4, 1, 32, 8, 128, [4097, 0, 65537, 3], dict(window_size=(1000, -1), sinks=True)),
    (2, 4, 32, 8, 128, [32768, 113], dict(softcap=30.0, alibi=True)),
    (1, 1, 64, 8, 64, [40000], dict(sinks=True, softcap=50.0)),
    (3, 2, 16, 2, 80, [9000, 70000, 17], dict()),
    (1, 1, 32, 8, 96, [65536], dict(window_size=(4095, -1))),
    (2, 1, 16, 16, 192, [30000, 1], dict(alibi=True)),
], ids=str)
def test_gpu_variants_real_sizes(backend, case):
    B, Sq, Hq, Hkv, D, lens, opts = case
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, BF16, "cuda", seed=7)
    g = torch.Generator().manual_seed(1)
    kw = {key: val for key, val in opts.items() if key not in ("sinks", "alibi")}
    if opts.get("sinks"):
        kw["sinks"] = (torch.randn(Hq, generator=g) * 3).cuda()
    if opts.get("alibi"):
        kw["alibi_slopes"] = (torch.rand(Hq, generator=g) * 0.05).cuda()
    ro, rl = decode_reference(q, k, v, sl, **kw)
    for paged in (False, True):
        kk, vv, bt = (k, v, None) if not paged else to_paged(k, v, lens, 16)
        o, lse = splitkv.decode(q, kk, vv, sl, block_table=bt, return_lse=True, backend=backend, **kw)
        _check(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_an_infinite_sink_takes_the_whole_row(backend):
    test_an_infinite_sink_takes_the_whole_row(backend, device="cuda", D=128)
