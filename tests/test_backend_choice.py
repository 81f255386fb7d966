"""backend='auto': which backend a decode runs on (CPU: the sm90 device query and the DSL check are
stubbed, so the rule itself is what is tested; the kernels run in the GPU tests)."""

import pytest
import torch
from helpers import make_inputs, to_paged

import splitkv
from splitkv import backends, heuristics


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(heuristics, "AUTO_CUTLASS", True)
    monkeypatch.setattr(backends, "cutlass_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("SPLITKV_BACKEND", raising=False)


def _choice(num_splits, backend="auto", transposed=False):
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], torch.float16, transposed=transposed)
    p = splitkv.plan(sl, 8, 2, 64, num_splits=num_splits)
    return backends.refine_auto(backend, "triton", p, q, k, v, torch.empty_like(q))


def test_auto_takes_cutlass_for_split_plans_on_sm90(sm90):
    assert heuristics.auto_prefers_cutlass(2) and not heuristics.auto_prefers_cutlass(1)
    assert _choice(3) == "cutlass"
    assert _choice(1) == "triton"  # unsplit plans: Triton measured faster


def test_explicit_backends_and_the_env_override_are_kept(sm90, monkeypatch):
    assert _choice(3, backend="triton") == "triton"
    monkeypatch.setenv("SPLITKV_BACKEND", "triton")
    assert _choice(3) == "triton"


def test_auto_stays_on_triton_without_the_dsl_or_off_sm90(monkeypatch):
    monkeypatch.setattr(heuristics, "AUTO_CUTLASS", True)
    monkeypatch.delenv("SPLITKV_BACKEND", raising=False)
    monkeypatch.setattr(backends, "cutlass_available", lambda: False)
    assert _choice(3) == "triton"
    monkeypatch.setattr(backends, "cutlass_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert _choice(3) == "triton"


def test_auto_avoids_cutlass_for_layouts_it_rejects(sm90):
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], torch.float16)
    p = splitkv.plan(sl, 8, 2, 64, num_splits=3)
    k_odd = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # rows 2 bytes off 16-byte alignment
    assert backends.refine_auto("auto", "triton", p, q, k_odd, v, torch.empty_like(q)) == "triton"
    assert backends.refine_auto("auto", "triton", p, q, k, v, torch.empty_like(q)) == "cutlass"
    assert _choice(3, transposed=True) == "cutlass"  # [B, H, L, D] storage: strided, still aligned


def test_auto_takes_cutlass_by_default_and_the_rule_switches_it_off(monkeypatch):
    """heuristics.AUTO_CUTLASS is on (the HF-demo divergence was a bf16 near-tie: see its comment)."""
    monkeypatch.delenv("SPLITKV_BACKEND", raising=False)
    monkeypatch.setattr(backends, "cutlass_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert _choice(3) == "cutlass"
    monkeypatch.setattr(heuristics, "AUTO_CUTLASS", False)
    assert _choice(3) == "triton"


def test_plans_are_sized_for_the_backend_that_runs_them():
    """heuristics.blocks_per_sm: cutlass plans aim at one split CTA per SM, triton's at two."""
    sl = torch.tensor([131072], dtype=torch.int32)
    cut = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="cutlass")
    tri = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="triton")
    assert (cut.target, cut.max_splits) == ("cutlass", 16)  # 8 heads x 16 = 128 CTAs <= 132
    assert (tri.target, tri.max_splits) == ("triton", 33)  # 264 = 2 x 132
    assert "for=cutlass" in cut.describe()
    g = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="cutlass", max_seqlen=131072)  # graph-safe
    assert g.max_splits == 16
    paged = splitkv.plan(sl, 32, 8, 128, num_sms=132, backend="cutlass", paged=True)
    assert (paged.max_splits, paged.paged) == (33, True) and "for=cutlass/paged" in paged.describe()


def test_auto_plans_for_cutlass_where_auto_runs_it(sm90, monkeypatch):
    cpu = torch.device("cpu")
    assert backends.plan_target("auto", cpu) == "torch"  # CPU tensors: the torch backend
    monkeypatch.setattr(backends, "resolve", lambda backend, device: "triton")  # as on a CUDA device
    assert backends.plan_target("auto", cpu) == "cutlass"
    assert backends.plan_target("triton", cpu) == "triton"
    monkeypatch.setenv("SPLITKV_BACKEND", "triton")
    assert backends.plan_target("auto", cpu) == "triton"
    monkeypatch.delenv("SPLITKV_BACKEND")
    monkeypatch.setattr(heuristics, "AUTO_CUTLASS", False)
    assert backends.plan_target("auto", cpu) == "triton"


def test_decode_without_a_plan_sizes_it_for_its_backend(monkeypatch):
    from splitkv import api

    seen = []
    real = api.build_plan
    monkeypatch.setattr(api, "build_plan", lambda *a, **kw: seen.append((kw["target"], kw["paged"])) or real(*a, **kw))
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], torch.float32)
    splitkv.decode(q, k, v, sl)
    assert seen == [("torch", False)]
    k, v, bt = to_paged(k, v, [900, 40], 16)
    splitkv.decode(q, k, v, sl, block_table=bt, backend="torch")
    assert seen[-1] == ("torch", True)
