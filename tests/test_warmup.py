"""splitkv.warmup and the compile CLI's filters (CPU; the GPU check is marked `gpu`)."""

import json

import pytest
import torch

from splitkv import compile_cli
from splitkv.backends import cutlass as cutlass_backend
from splitkv.backends.cutlass import config
from splitkv.warmup import warmup


def test_warmup_on_cpu_runs_one_entry_per_combination():
    res = warmup(head_dims=(64, 128), dtypes=(torch.bfloat16, "float16"), num_q_heads=(8, 16), num_kv_heads=(8, 4),
                 q_lens=(1, 3), paged=(False, True), page_size=16, backends=("auto", "triton"), device="cpu")
    rows = res["combinations"]
    assert res["device"] == "cpu"
    assert len(rows) == 2 * 2 * 2 * 2 * 2  # D x dtype x heads x Sq x layout; backends collapse to torch
    assert {r["backend"] for r in rows} == {"torch"}
    assert {(r["num_q_heads"], r["num_kv_heads"]) for r in rows} == {(8, 8), (16, 4)}
    assert {r["page_size"] for r in rows if r["paged"]} == {16}
    assert all(r["page_size"] is None for r in rows if not r["paged"])
    assert all(r["seconds"] >= 0 for r in rows) and res["total_s"] >= 0
    assert {r["dtype"] for r in rows} == {"bfloat16", "float16"}


def test_warmup_takes_the_models_variants(monkeypatch):
    """Each variant is one more combination, and its keywords reach decode (True sinks / slopes
    become per-head tensors); a key decode does not take is named."""
    import splitkv.api

    seen = []
    real = splitkv.api.decode
    monkeypatch.setattr(splitkv.api, "decode", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    res = warmup(head_dims=80, num_q_heads=8, num_kv_heads=2, device="cpu",
                 variants=({}, {"softcap": 50.0, "window_size": (63, -1), "sinks": True, "alibi_slopes": True}))
    assert [r["variant"] for r in res["combinations"]] == ["plain", "softcap=50.0,window_size=(63, -1),sinks=yes,"
                                                           "alibi_slopes=yes"]
    var_calls = [kw for kw in seen if "softcap" in kw]
    assert var_calls and all(kw["sinks"].shape == (8,) and kw["alibi_slopes"].shape == (8,) for kw in var_calls)
    with pytest.raises(ValueError, match="variants"):
        warmup(device="cpu", variants=({"softcapp": 1.0},))


def test_warmup_single_values_and_page_sizes():
    res = warmup(head_dims=256, dtypes=torch.float16, num_q_heads=4, num_kv_heads=1, q_lens=16, paged=True,
                 page_size=(1, 16), device="cpu", verbose=True)
    assert [(r["head_dim"], r["q_len"], r["page_size"]) for r in res["combinations"]] == [(256, 16, 1), (256, 16, 16)]


@pytest.mark.parametrize("kwargs, arg", [
    (dict(head_dims=(100,)), "head_dims"),
    (dict(head_dims=()), "head_dims"),
    (dict(head_dims="128"), "head_dims"),
    (dict(dtypes=(torch.int8,)), "dtypes"),
    (dict(dtypes=("float64",)), "dtypes"),
    (dict(num_q_heads=30, num_kv_heads=8), "num_q_heads"),
    (dict(num_q_heads=(32, 64, 16), num_kv_heads=(8, 8)), "num_kv_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(q_lens=(0,)), "q_lens"),
    (dict(q_lens=(17,)), "q_lens"),
    (dict(paged=("yes",)), "paged"),
    (dict(page_size=0), "page_size"),
    (dict(backends=("cuda",)), "backends"),
])
def test_warmup_bad_arguments_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=f"^{arg}"):
        warmup(device="cpu", **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the float32 rule applies to CUDA backends")
def test_warmup_float32_needs_torch_backend_on_cuda():
    with pytest.raises(ValueError, match="^dtypes"):
        warmup(dtypes=(torch.float32,), backends=("triton",))


# ------------------------------------------------------------------------ compile CLI filters
def _names(**kw):
    return {compile_cli._name(k, f) for k, f in compile_cli.variants(**kw)}


def test_compile_variants_default_is_every_variant():
    every = {c.name for c in config.split_variants()} | {c.name for c in config.merge_variants()}
    assert _names() == every


def test_compile_variant_filters_select_the_model_subset():
    names = _names(head_dims=(128,), dtypes=("bfloat16",), group_sizes=(4,), q_lens=(1, 4), kv_formats=("bf16",))
    # the fp8 caches' kernels of the same model: one tile for split and unsplit plans
    fp8 = _names(head_dims=(128,), dtypes=("bfloat16",), group_sizes=(4,), kv_formats=("e4m3",))
    assert fp8 == {"split_bfloat16_d128_m16_n128_s4_dense_kve4m3", "split_bfloat16_d128_m16_n128_s4_paged_kve4m3",
                   "merge_float32_to_bfloat16_d128", "merge_bfloat16_to_bfloat16_d128"}
    # GQA 4 x Sq 1 / 4 = 4 / 16 rows -> block_m 16; split (n64 s3), unsplit (n128 s2) and several-wave
    # (n128 s3) dense tiles, paged n64 s3
    assert names == {"split_bfloat16_d128_m16_n64_s3_dense", "split_bfloat16_d128_m16_n128_s2_dense",
                     "split_bfloat16_d128_m16_n128_s3_dense", "split_bfloat16_d128_m16_n64_s3_paged",
                     "merge_float32_to_bfloat16_d128", "merge_bfloat16_to_bfloat16_d128"}
    # the query tile follows group size x Sq: 8 x 4 = 32 rows, 8 x 16 = 128 rows (capped at 64)
    sel = compile_cli.variants(head_dims=(256,), group_sizes=(8,), q_lens=(4, 16), layouts=("paged",))
    cfgs = [config.SplitConfig(*f) for k, f in sel if k == "split"]
    assert {c.block_m for c in cfgs} == {32, 64}
    assert all(c.paged and c.head_dim == 256 for c in cfgs)
    assert {c.dtype for c in cfgs} == set(config.DTYPES)
    # group sizes alone mean Sq = 1
    assert {config.SplitConfig(*f).block_m for k, f in compile_cli.variants(group_sizes=(32,)) if k == "split"} == {32}
    with pytest.raises(ValueError, match="^q_lens"):
        compile_cli.variants(q_lens=(1,))
    # --only still applies on top
    assert _names(head_dims=(64,), only="merge_float32") == {f"merge_float32_to_{dt}_d64" for dt in config.DTYPES}


def test_compile_cli_argument_errors(capsys):
    for argv in (["--head-dims", "72"], ["--variants", "sinks"], ["--dtypes", "float32"], ["--q-lens", "2"],
                 ["--heads", "30/8"], ["--layouts", "ragged"], ["--warmup", "--group-sizes", "4"]):
        with pytest.raises(SystemExit) as e:
            compile_cli.main(argv)
        assert e.value.code == 2, argv
    assert compile_cli.main(["--backend", "triton"]) == 2  # nothing to compile ahead of time


def test_compile_cli_warmup_on_cpu(tmp_path, capsys):
    out = tmp_path / "warm.json"
    rc = compile_cli.main(["--warmup", "--device", "cpu", "--head-dims", "64,128", "--dtypes", "bfloat16",
                           "--heads", "32/8,8/8", "--q-lens", "1,2", "--layouts", "dense,paged", "--page-size", "8",
                           "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["combinations"]) == 2 * 2 * 2 * 2
    assert {r["page_size"] for r in res["combinations"] if r["paged"]} == {8}
    assert "16 combination(s) warmed on cpu" in capsys.readouterr().out


@pytest.mark.skipif(not cutlass_backend.available(), reason="nvidia-cutlass-dsl not installed")
def test_compile_cli_filtered_single_variant_for_sm90a(tmp_path):
    rows_path = tmp_path / "rows.json"
    rc = compile_cli.main(["--head-dims", "64", "--dtypes", "float16", "--group-sizes", "4", "--layouts", "dense",
                           "--only", "split_.*_n128_s3_dense", "--jobs", "1", "--dump-dir", str(tmp_path / "ptx"),
                           "--json", str(rows_path)])
    rows = json.loads(rows_path.read_text())["rows"]
    assert rc == 0 and [r["name"] for r in rows] == ["split_float16_d64_m16_n128_s3_dense"], rows


@pytest.mark.gpu
def test_warmup_on_gpu_compiles_what_decode_then_uses():
    """After warmup, the same shapes decode without compiling anything (CuTe compile cache)."""
    import time

    import splitkv

    kw = dict(head_dims=(128,), dtypes=(torch.bfloat16,), num_q_heads=32, num_kv_heads=8, q_lens=(1,),
              paged=(False, True))
    res = warmup(**kw)
    assert len(res["combinations"]) == 2 and res["device"].startswith("cuda")
    again = warmup(**kw)  # everything compiled: only launches
    assert again["total_s"] < 2.0, again
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8192, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([8192, 3000], dtype=torch.int32, device="cuda")
    t0 = time.perf_counter()
    splitkv.decode(q, k, k, lens)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 1.0
    # a batch that fills the GPU on its own streams whole sequences in waves (heuristics.WAVES_TILE)
    q = torch.randn(40, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(40, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((40,), 4096, dtype=torch.int32, device="cuda")
    p = splitkv.plan(lens, 32, 8, 128)
    assert p.backend == "cutlass" and (p.tile.block_n, p.tile.num_stages) == splitkv.heuristics.WAVES_TILE
    t0 = time.perf_counter()
    splitkv.decode(q, k, k, lens)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 1.0
    # 8 requests at 128K: chunks of 64K keys in a grid they fill in part (the 128-key x 2-stage tile)
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 131072, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((8,), 131072, dtype=torch.int32, device="cuda")
    p = splitkv.plan(lens, 32, 8, 128)
    assert p.backend == "cutlass" and (p.tile.block_n, p.tile.num_stages) == (128, 2)
    t0 = time.perf_counter()
    splitkv.decode(q, k, k, lens)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 1.0
