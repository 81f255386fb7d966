"""backend='auto': which backend a plan runs (CPU: the device facts are stubbed, so the rule itself is
what is tested; the kernels run in the GPU tests). The plan decides once; decode only launches."""

import pytest
import torch
from helpers import make_inputs, to_paged

import splitkv
from splitkv import backends, execute, heuristics, validate
from splitkv.plan import build


@pytest.fixture
def sm90(monkeypatch):
    """A CUDA sm90 device with the CuTe DSL, as far as the plan's questions go."""
    monkeypatch.setattr(heuristics, "AUTO_CUTLASS", True)
    monkeypatch.setattr(backends, "cutlass_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("SPLITKV_BACKEND", raising=False)
    real = backends.resolve
    monkeypatch.setattr(backends, "resolve", lambda b, d: real(b, torch.device("cuda", 0)) if b == "auto" else b)
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    real_here = backends.auto_cutlass_here
    monkeypatch.setattr(backends, "auto_cutlass_here", lambda d: real_here(torch.device("cuda", 0)))


def _prob(B=2, L=900, hkv=2, paged=False):
    return validate.Problem(B, 1, 8, hkv, 64, L, 16 if paged else None, torch.float16)


def _build(backend="auto", num_splits=None, layout_ok=True, **kw):
    return build(_prob(**kw), "cpu", backend=backend, num_splits=num_splits, layout_ok=layout_ok, num_sms=132)


def test_auto_takes_cutlass_for_split_plans_on_sm90(sm90):
    assert heuristics.auto_prefers_cutlass(2) and not heuristics.auto_prefers_cutlass(1)
    assert _build(num_splits=3).backend == "cutlass" and _build(num_splits=3).auto
    assert _build(num_splits=1).backend == "triton"  # unsplit plans: Triton measured faster
    assert _build(L=300).backend == "triton"  # a bound too short to split


def test_auto_takes_triton_for_split_plans_of_more_than_32_rows_per_kv_head(sm90):
    """GQA 4 x Sq 16 (64 rows: the m64 tile) splits on Triton, measured ahead there; Sq 8 (m32) stays on cutlass."""
    def built(sq):
        return build(validate.Problem(1, sq, 32, 8, 128, 32768, None, torch.bfloat16), "cpu", num_sms=132)
    assert built(16).tile.block_m == 64 and built(16).backend == "triton" and built(16).max_splits > 1
    assert built(8).backend == "cutlass"
    assert not heuristics.auto_prefers_cutlass(16, 64) and heuristics.auto_prefers_cutlass(16, 32)


def test_explicit_backends_and_the_env_override_are_kept(sm90, monkeypatch):
    assert _build("triton", 3).backend == "triton" and not _build("triton", 3).auto
    monkeypatch.setenv("SPLITKV_BACKEND", "triton")
    assert _build(num_splits=3).backend == "triton"


def test_auto_stays_on_triton_without_the_dsl_off_sm90_or_for_a_layout_it_rejects(sm90, monkeypatch):
    assert _build(num_splits=3, layout_ok=False).backend == "triton"
    monkeypatch.setattr(backends, "cutlass_available", lambda: False)
    assert _build(num_splits=3).backend == "triton"
    monkeypatch.setattr(backends, "cutlass_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert _build(num_splits=3).backend == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(heuristics, "AUTO_CUTLASS", False)
    assert _build(num_splits=3).backend == "triton"


def test_cutlass_layout_check_for_auto():
    from splitkv.backends.cutlass import layout_ok

    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], torch.float16)
    k_odd = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # rows 2 bytes off 16-byte alignment
    assert layout_ok(q, k, v, q) and not layout_ok(q, k_odd, v, q)
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], torch.float16, transposed=True)
    assert layout_ok(q, k, v, q)  # [B, H, L, D] storage: strided, still aligned


@pytest.mark.skipif(not backends.cutlass_available(), reason="makes cutlass plans: needs nvidia-cutlass-dsl")
def test_plans_are_sized_for_the_backend_and_layout_that_run_them():
    """heuristics.blocks_per_sm: cutlass plans aim at one split CTA per SM, triton's and paged at two."""
    sl = torch.tensor([131072], dtype=torch.int32)
    cut = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="cutlass")
    tri = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="triton")
    assert (cut.backend, cut.rule.target, cut.num_splits.tolist()) == ("cutlass", 16, [16])  # 128 CTAs <= 132
    assert (tri.backend, tri.rule.target, tri.num_splits.tolist()) == ("triton", 33, [33])  # 264 = 2 x 132
    assert "DecodePlan[cutlass]" in cut.describe()
    paged = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="cutlass", paged=True)
    assert (paged.rule.target, paged.paged) == (33, True) and "paged" in paged.describe()
    # a paged D 256 tile fits once per SM: sized for two, the plan would run a second wave
    big = splitkv.plan(torch.tensor([32768], dtype=torch.int32), 32, 8, 256, num_sms=132, backend="cutlass",
                       paged=True)
    assert big.rule.target == 16 and big.num_splits.tolist() == [16]
    assert heuristics.blocks_per_sm("cutlass", True, 192) == 2 and heuristics.blocks_per_sm("triton", True, 256) == 2


def test_decode_without_a_plan_plans_once_per_signature(monkeypatch):
    seen = []
    monkeypatch.setattr(execute, "build", lambda prob, *a, **kw: seen.append(prob) or build(prob, *a, **kw))
    splitkv.clear_plans()
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], torch.float32)
    for lens in ([900, 40], [3, 7]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        splitkv.decode(q, k, v, sl)
    assert len(seen) == 1 and seen[0].page_size is None and seen[0].max_seqlen == k.shape[1]  # the capacity
    kp, vp, bt = to_paged(k, v, [3, 7], 16)
    splitkv.decode(q, kp, vp, sl, block_table=bt, backend="torch")
    assert len(seen) == 2 and seen[1].page_size == 16 and seen[1].max_seqlen == bt.shape[1] * 16


@pytest.mark.skipif(not backends.cutlass_available(), reason="makes cutlass plans: needs nvidia-cutlass-dsl")
def test_cutlass_takes_fp8_caches_at_its_head_dims():
    """fp8 caches run on the CuTe kernel at D 128 / 256 without softcap / ALiBi (fp8.py), with a
    1-byte-stage tile; elsewhere an explicit cutlass plan is refused, naming the head dims."""
    sl = torch.tensor([32768], dtype=torch.int32)
    f8 = torch.float8_e4m3fn
    p = splitkv.plan(sl, 32, 8, 128, kv_dtype=f8, k_scale=0.5, v_scale=0.5, num_sms=132, backend="cutlass")
    assert p.backend == "cutlass" and (p.tile.block_n, p.tile.num_stages) == heuristics.FP8_TILE == (128, 4)
    assert p.rule.target == 16  # one fp8 CTA per SM (133 KB: four 32 KB stages, converted in registers)
    p256 = splitkv.plan(sl, 32, 8, 256, kv_dtype=f8, k_scale=0.5, v_scale=0.5, num_sms=132, backend="cutlass")
    assert (p256.tile.block_n, p256.tile.num_stages, p256.rule.target) == (64, 3, 33)  # two per SM
    with pytest.raises(ValueError, match=r"fp8 caches: \(128, 256\)"):
        splitkv.plan(sl, 32, 8, 64, kv_dtype=f8, k_scale=0.5, v_scale=0.5, backend="cutlass")
    with pytest.raises(ValueError, match="got head dim 64 with an fp8 cache"):
        splitkv.plan(sl, 32, 8, 64, kv_dtype=f8, k_scale=0.5, v_scale=0.5, backend="cutlass")
    with pytest.raises(ValueError, match="got softcap"):
        splitkv.plan(sl, 32, 8, 128, kv_dtype=f8, k_scale=0.5, v_scale=0.5, softcap=30.0, backend="cutlass")
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)  # decode names the variant too (any machine)
    kv = torch.randn(1, 64, 8, 128).to(f8)
    with pytest.raises(ValueError, match="got alibi_slopes"):
        splitkv.decode(q, kv, kv, torch.tensor([64], dtype=torch.int32), k_scale=0.5, v_scale=0.5,
                       alibi_slopes=torch.ones(32), backend="cutlass")


def test_triton_fp8_plans_aim_at_two_ctas_per_sm_as_bf16_ones_do():
    """heuristics (the Triton fp8 note): fp8 plans split like bf16 ones, two CTAs per SM, at every
    GQA group and for paged caches: B=16 GQA 32/8 and 64/8 32K get 2 splits per request (264 // 8
    groups = 33 CTAs per group), B=1 128K 32 of 128 keys."""
    fp8 = dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0, num_sms=132, backend="triton")
    b16 = torch.full((16,), 32768, dtype=torch.int32)
    for hq in (32, 64):
        for paged in (False, True):
            p = splitkv.plan(b16, hq, 8, 128, paged=paged, **fp8)
            assert p.rule.target == 33 and p.num_splits.tolist() == [2] * 16, (hq, paged)
    one = splitkv.plan(torch.tensor([131072], dtype=torch.int32), 32, 8, 128, **fp8)
    assert one.rule.target == 33 and one.num_splits.tolist() == [32]  # 128-key tiles: 1024 = 32 x 32
    assert heuristics.blocks_per_sm("triton", True, 128, 16, True) == heuristics.BLOCKS_PER_SM


@pytest.mark.skipif(not backends.cutlass_available(), reason="makes cutlass plans: needs nvidia-cutlass-dsl")
def test_auto_takes_cutlass_for_contiguous_fp8_caches_with_one_query(sm90):
    """heuristics.auto_prefers_cutlass_fp8: contiguous fp8 caches with Sq 1 run on the CuTe kernel,
    split or not (D 128 / 256); paged caches, Sq > 1 and the head dims it lacks stay on Triton."""
    f8 = dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0, num_sms=132)

    def chosen(B=1, L=32768, D=128, q_len=1, paged=False):
        return splitkv.plan(torch.full((B,), L, dtype=torch.int32), 32, 8, D, q_len=q_len, paged=paged, **f8).backend

    assert chosen() == chosen(D=256) == chosen(B=64) == "cutlass"  # B=64: one split per request
    assert chosen(paged=True) == chosen(q_len=4) == chosen(D=64) == "triton"
    assert heuristics.auto_prefers_cutlass_fp8(False, 1) and not heuristics.auto_prefers_cutlass_fp8(True, 1)


@pytest.mark.skipif(not backends.cutlass_available(), reason="makes cutlass plans: needs nvidia-cutlass-dsl")
def test_auto_keeps_triton_for_fp8_at_d128_on_the_h200(sm90, monkeypatch):
    """On an H200 (heuristics.AUTO_TRITON_FP8_DEVICES) contiguous fp8 caches at D 128 run on Triton,
    D 256 still on cutlass; on another card (the H100) D 128 stays on cutlass."""
    import importlib

    plan_mod = importlib.import_module("splitkv.plan")  # the module (splitkv.plan is also the function)
    f8 = dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0, num_sms=132)

    def chosen(D=128, B=1):
        return splitkv.plan(torch.full((B,), 32768, dtype=torch.int32), 32, 8, D, **f8).backend

    assert plan_mod.device_name(torch.device("cpu")) == ""
    monkeypatch.setattr(plan_mod, "device_name", lambda device: "NVIDIA H200")
    assert chosen() == chosen(B=16) == "triton" and chosen(D=256) == "cutlass"
    monkeypatch.setattr(plan_mod, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert chosen() == chosen(B=16) == chosen(D=256) == "cutlass"
