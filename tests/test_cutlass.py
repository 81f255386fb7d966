"""CuTe DSL backend: pure-Python pieces (configs, variant list, cache keys, argument packing), the
import guard, sm_90a compilation on this CPU machine (PTX checked for the instructions the design
relies on), and — marked gpu — correctness of every split variant against splitkv.reference
(compute-sanitizer runs: tests/test_sanitizer.py).

CPU compile tests cover one variant per (head dim, layout) plus the merge (~1 min on 2 cores);
SPLITKV_TEST_COMPILE_ALL=1 compiles all of them (`python -m splitkv compile` does that in CI).
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import make_inputs, needs_dsl, to_paged

import splitkv
from splitkv import heuristics as H
from splitkv.backends import cutlass as backend
from splitkv.backends.cutlass import cache, config
from splitkv.reference import decode_lowp, decode_reference


# ---------------------------------------------------------------------------- pure Python (always)
def test_variant_lists_cover_every_launchable_config():
    split = config.split_variants()
    # dtype x D x block_m x paged, plus the other contiguous tile of D 80 / 96 / 128 / 192 (unsplit vs split:
    # heuristics.cutlass_tile) and D 128's third (whole sequences in several waves); fp8 caches: format x
    # dtype x D 128 / 256 x block_m x paged
    assert (len(split) == 2 * 6 * 3 * 2 + 2 * 4 * 3 + 2 * 3 + 2 * 2 * 2 * 3 * 2
            and len({c.name for c in split}) == len(split))
    assert not any(c.paged and c.block_n == 128 and c.head_dim == 128 and not c.kv_fp8 for c in split)
    assert {(c.block_n, c.num_stages) for c in split if c.head_dim == 128 and not c.kv_fp8} == {(64, 3), (128, 2),
                                                                                               (128, 3)}
    assert {(c.head_dim, c.kv_fp8) for c in split if c.kv_fp8} == {(d, f) for d in (128, 256) for f in ("e4m3", "e5m2")}
    assert {c.block_m for c in split} == set(config.BLOCK_MS)  # every planner query tile
    assert len(config.merge_variants()) == 3 * 2 * 6
    for c in split:
        assert c.smem_bytes <= config.SMEM_LIMIT
        assert c.warps_m * c.warps_n == config.NUM_THREADS // 32
        assert c.keys_per_warp % config.MMA_K == 0
        # the epilogue scratch overlays the K/V ring: it must fit there
        assert c.smem_bytes - c.block_m * c.padded_dim * 2 - 1024 >= c.reduce_bytes
    assert {c.padded_dim for c in split if c.head_dim in (80, 96)} == {128}


def test_two_blocks_per_sm_at_d128_and_below_when_splitting():
    """Split plans: two CTAs per SM (heuristics.cutlass_tile); unsplit D128 takes one big tile."""
    for dt in config.DTYPES:
        for d in (64, 128):
            for bm in config.BLOCK_MS:
                c = config.split_config(dt, d, bm, False)
                assert 2 * (c.smem_bytes + 1024) <= 228 * 1024, c
    assert config.split_config("bfloat16", 128, 16, False, splitting=False).block_n == 128
    assert config.split_config("bfloat16", 128, 16, True, splitting=False).block_n == 64  # paged


def test_the_planners_smem_formula_is_the_split_configs():
    """heuristics.cutlass_split_smem (what the planner sizes residency by) = SplitConfig.smem_bytes."""
    from splitkv import heuristics

    for dt in config.DTYPES:
        for d in config.HEAD_DIMS:
            for bm in config.BLOCK_MS:
                for paged in (False, True):
                    c = config.split_config(dt, d, bm, paged)
                    assert heuristics.cutlass_split_smem(d, bm, paged) == c.smem_bytes, c
                    if d in config.FP8_HEAD_DIMS:
                        c = config.split_config(dt, d, bm, paged, kv_fp8="e4m3")
                        assert heuristics.cutlass_split_smem(d, bm, paged, True) == c.smem_bytes, c


@pytest.mark.parametrize("bad", [dict(dtype="float32"), dict(head_dim=72), dict(block_m=8),
                                 dict(block_n=32), dict(num_stages=1), dict(block_n=256, num_stages=4)])
def test_bad_split_configs_are_rejected(bad):
    kw = dict(dtype="float16", head_dim=128, block_m=16, block_n=64, num_stages=3, paged=False) | bad
    with pytest.raises(ValueError):
        config.SplitConfig(**kw)


def test_cache_key_tracks_name_arch_and_source(monkeypatch):
    k = cache.cache_key("split_x", "sm_90a")
    assert k == cache.cache_key("split_x", "sm_90a")
    assert k != cache.cache_key("split_y", "sm_90a") and k != cache.cache_key("split_x", "sm_100a")
    monkeypatch.setattr(cache, "source_hash", lambda: "edited")
    assert cache.cache_key("split_x", "sm_90a") != k


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    assert cache.cache_dir() == tmp_path
    monkeypatch.setenv("SPLITKV_CACHE_DIR", "off")
    assert cache.cache_dir() is None


def test_import_does_not_load_the_dsl():
    code = "import splitkv, splitkv.backends.cutlass as c, sys; c.available(); print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_missing_dsl_gives_install_hint(monkeypatch):
    monkeypatch.setattr(backend, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install 'splitkv\[cutlass\]'"):
        backend.run(*([None] * 12))
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl"):
        backend.merge(None, None, None, None, None)


# ------------------------------------------------------------------------ with the DSL, no GPU
def _compile_rows(regex, tmp_path, extra=()):
    from splitkv import compile_cli

    out = tmp_path / "rows.json"
    rc = compile_cli.main(["--only", regex, "--jobs", "1", "--dump-dir", str(tmp_path / "ptx"),
                           "--json", str(out), *extra])
    rows = json.loads(out.read_text())["rows"]
    return rc, rows


@needs_dsl
def test_variants_compile_for_sm90a_without_spills(tmp_path):
    regex = "." if os.environ.get("SPLITKV_TEST_COMPILE_ALL") else \
        r"split_float16_d64_m16.*dense|split_bfloat16_d128_m16.*paged|split_float16_d256_m64.*dense|" \
        r"split_bfloat16_d128_m64.*paged|merge_float32_to_bfloat16_d128|split_float16_d80_m32.*dense|" \
        r"merge_float16_to_float16_d96|split_bfloat16_d256_m64.*paged_kve4m3"
    rc, rows = _compile_rows(regex, tmp_path)
    assert rc == 0 and all(r["ok"] for r in rows), rows
    assert len(rows) >= 5
    for r in rows:
        assert r.get("spill_stores") == 0 and r.get("spill_loads") == 0, r
        assert 0 < r["registers"] <= 255, r


@needs_dsl
def test_attention_variant_kernels_compile_for_sm90a(tmp_path):
    """Softcap, ALiBi and the window compiled in (sinks are a runtime pointer: no kernel of their
    own), at a padded head dim (96 on 128-column tiles) and at 128, without spills."""
    rc, rows = _compile_rows(r"split_bfloat16_d96_m16_n64_s3_paged|split_float16_d128_m32_n64_s3_dense", tmp_path,
                             ["--variants", "softcap,alibi,window"])
    assert rc == 0 and len(rows) == 2 and all(r["ok"] for r in rows), rows
    for r in rows:
        assert r["name"].endswith("_cap_alibi_win"), r
        assert r.get("spill_stores") == 0 and r.get("spill_loads") == 0 and r["registers"] <= 255, r


@needs_dsl
def test_split_ptx_has_the_designed_pipeline(tmp_path):
    """16-byte cp.async (L1 bypass), commit/wait groups, ldmatrix and mma.sync m16n8k16 in fp32."""
    rc, rows = _compile_rows(r"split_bfloat16_d128_m16_n64_s3_paged", tmp_path)
    assert rc == 0
    ptx_dir = tmp_path / "ptx" / rows[0]["name"]
    ptx = next(p for p in ptx_dir.iterdir() if p.name.endswith(".clean.ptx")).read_text()
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16", ptx)
    assert "cp.async.commit_group" in ptx and re.search(r"cp\.async\.wait_group \d", ptx)
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx  # V through ldmatrix.trans
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert ".local" not in ptx  # nothing spilled to local memory at the PTX level
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx  # PDL
    assert "atom.acq_rel.gpu.global.add.u32" in ptx and "fence.acq_rel.gpu" in ptx  # fused merge arrival


@needs_dsl
def test_packer_matches_the_dsl_argument_packing():
    import cutlass.cute as cute

    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.argpack import Packer

    kern, args = launch.build_merge(config.MergeConfig("float32", "float16", 64))
    compiled = cute.compile(kern, *args, options=cache.compile_options("sm_90a"))
    p = Packer(compiled)
    assert p.fast  # our ctypes slots hold what the DSL would pass, for a probe call
    assert p.kinds == ["i64"] * 6 + ["i32"] * 5 + ["i64"] * 14 + ["stream"]


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = [(dt, D, G, Sq, page) for dt in (torch.float16, torch.bfloat16) for D in (64, 80, 96, 128, 192, 256)
             for G, Sq in ((4, 1), (8, 4), (16, 16)) for page in (None, 16)]


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("fused", [True, False], ids=["fused-merge", "merge-kernel"])
@pytest.mark.parametrize("dtype,D,G,Sq,page", GPU_CASES)
def test_every_split_variant_matches_reference(dtype, D, G, Sq, page, fused, monkeypatch):
    """G x Sq = 4 / 32 / 256 packed rows -> block_m 16 / 32 / 64 (4 query tiles); lengths include
    0, 1 and rows that see no key (Sq > L); forced splits so the merge runs too, both in the split
    kernel (fused) and in the merge kernel."""
    from splitkv import heuristics

    monkeypatch.setattr(heuristics, "CUTLASS_FUSED_MERGE_MAX_SPLITS", heuristics.MAX_SPLITS if fused else 1)
    monkeypatch.setattr(heuristics, "CUTLASS_FUSED_MERGE_MAX_ROWS", heuristics.MAX_BLOCK_M)  # every tile may fuse
    monkeypatch.setattr(heuristics, "CUTLASS_FUSED_MERGE_MAX_PARTIALS", heuristics.MAX_BLOCK_M * heuristics.MAX_SPLITS)
    lens = [0, 1, 17, 113, 2049]
    q, k, v, sl = make_inputs(5, Sq, 2 * G, 2, D, lens, dtype, "cuda", seed=D + G)
    kd, vd, bt = k, v, None
    if page is not None:
        k, v, bt = to_paged(k, v, lens, page)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        o, lse = splitkv.decode(q, k, v, sl, block_table=bt, num_splits=splits, return_lse=True, out=out,
                                backend="cutlass")
        ro, rl = decode_reference(q, k, v, sl, block_table=bt)
        base = (decode_lowp(q, torch.nan_to_num(kd), torch.nan_to_num(vd), sl).double() - ro).abs().max().item()
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert (o.double() - ro).abs().max().item() <= 2 * base + 1e-3
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isinf(lse), ~fin)
        assert (lse.double()[fin] - rl[fin]).abs().max().item() < 2e-3
        assert (o.permute(0, 2, 1, 3)[~fin] == 0).all()
        o2, _ = splitkv.decode(q, k, v, sl, block_table=bt, num_splits=splits, return_lse=True, backend="cutlass")
        assert torch.equal(o, o2)  # bitwise run-to-run determinism


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G,Sq", [(4, 1), (8, 4)])
def test_plans_streaming_in_waves_match_reference(dtype, G, Sq):
    """The several-wave tile (heuristics.WAVES_TILE, n128 s3), from a plan made for a GPU of 4 SMs so
    that 5 requests x 2 KV heads stream in waves: a ragged batch (empty, 1 key, rows that see no key,
    a request the device splits) matches the fp64 reference, fused merge included."""
    lens = [0, 1, 17, 113, 2049]
    q, k, v, sl = make_inputs(5, Sq, 2 * G, 2, 128, lens, dtype, "cuda", seed=G + Sq)
    p = splitkv.plan(sl, 2 * G, 2, 128, q_len=Sq, backend="cutlass", num_sms=4, max_seqlen=2049)
    assert (p.tile.block_n, p.tile.num_stages) == (128, 3) and p.max_splits > 1
    o, lse = splitkv.decode(q, k, v, sl, plan=p, return_lse=True, backend="cutlass")
    assert int(p.num_splits[4]) > 1  # the long request is split on the device
    ro, rl = decode_reference(q, k, v, sl)
    base = (decode_lowp(q, k, v, sl).double() - ro).abs().max().item()
    assert (o.double() - ro).abs().max().item() <= 2 * base + 1e-3
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert (lse.double()[fin] - rl[fin]).abs().max().item() < 2e-3
    assert (o.permute(0, 2, 1, 3)[~fin] == 0).all()


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("splits", [37, 70])
def test_merge_kernel_merges_more_splits_than_a_warp_has_lanes(splits):
    """> 32 splits: each lane walks several splits' LSEs (the <= 32 path keeps one per lane);
    request 1 uses fewer splits than max_splits, its tail partials are garbage that must not leak."""
    from splitkv.backends.cutlass import launch

    S, B, H, T, D = splits, 2, 3, 2, 128
    g = torch.Generator(device="cuda").manual_seed(splits)
    op = torch.randn(S, B, H, T, D, device="cuda", generator=g)
    lp = torch.randn(S, B, H, T, device="cuda", generator=g) * 4
    lp[5, 0] = -math.inf  # a split that saw no key
    n = torch.tensor([S, S - 9], dtype=torch.int32, device="cuda")
    out, lse = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="cuda"), torch.empty(B, H, T, device="cuda")
    launch.merge(op, lp, n, out, lse)
    for b in range(B):
        w = torch.softmax(lp[: int(n[b]), b].double(), dim=0)  # [s, H, T]
        ref = torch.einsum("sht,shtd->thd", w, op[: int(n[b]), b].double())
        assert (out[b].double() - ref).abs().max().item() < 2e-2
        assert (lse[b].double() - torch.logsumexp(lp[: int(n[b]), b].double(), 0)).abs().max().item() < 1e-4


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", config.HEAD_DIMS)
def test_merge_kernel_takes_low_precision_partials(part_dtype, out_dtype, D):
    """Partials in fp16 / bf16 (merge_states users) as well as our fp32 ones: within one rounding of
    the output dtype of the fp64 merge; dead splits (lse -inf, o NaN) never leak; a row with no key
    gives o = 0, lse = -inf."""
    from splitkv.backends.cutlass import launch

    S, B, H, T = 37, 3, 4, 2
    g = torch.Generator(device="cuda").manual_seed(D)
    o_part = torch.randn(S, B, H, T, D, device="cuda", generator=g).to(part_dtype)
    lse_part = torch.randn(S, B, H, T, device="cuda", generator=g) * 3
    n = torch.tensor([37, 1, 5], dtype=torch.int32, device="cuda")
    lse_part[2:, 2] = -math.inf  # request 2: only splits 0, 1 live ...
    o_part[2:, 2] = float("nan")  # ... its dead partials hold NaN
    lse_part[:, 1, 0] = -math.inf  # request 1, head 0: no key at all
    out = torch.full((B, T, H, D), float("nan"), dtype=out_dtype, device="cuda")
    lse = torch.empty(B, H, T, device="cuda")
    launch.merge(o_part, lse_part, n, out, lse)
    live = torch.arange(S, device="cuda")[:, None] < n[None, :]
    lp = lse_part.double().masked_fill(~live[:, :, None, None], -math.inf)
    m = lp.amax(0)
    w = torch.exp(lp - torch.where(torch.isinf(m), 0.0, m))
    den = w.sum(0)
    num = torch.where(w[..., None] > 0, w[..., None] * o_part.double(), 0.0).sum(0)
    ref_o = torch.where(den[..., None] > 0, num / den.clamp_min(1e-300)[..., None], 0.0).permute(0, 2, 1, 3)
    ref_lse = torch.where(den > 0, torch.where(torch.isinf(m), 0.0, m) + torch.log(den), -math.inf)
    assert not torch.isnan(out).any()
    tol = 2.0 ** -7 * float(ref_o.abs().max()) + 1e-4  # one bf16 rounding of the output
    assert (out.double() - ref_o).abs().max().item() <= tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and torch.all(lse[~fin] == -math.inf)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-4
    assert torch.all(out[1, :, 0] == 0)


_FRESH_PROCESS = """
import torch, splitkv
from splitkv.backends.cutlass.cache import CACHE
q = torch.randn(2, 1, 32, 128, device='cuda', dtype=torch.bfloat16)
k = torch.randn(2, 5000, 8, 128, device='cuda', dtype=torch.bfloat16)
lens = torch.tensor([5000, 77], dtype=torch.int32, device='cuda')
o = splitkv.decode(q, k, k, lens, backend='cutlass', num_splits=3)
ref = splitkv.decode(q, k, k, lens, backend='torch')
torch.cuda.synchronize()
print('compiled', CACHE.stats['compiled'], 'err', float((o.float() - ref.float()).abs().max()))
"""


@pytest.mark.gpu
@needs_dsl
def test_a_fresh_process_loads_kernels_from_the_disk_cache(tmp_path):
    """Kernels compiled once are loaded from SPLITKV_CACHE_DIR by later processes: the second
    process compiles nothing and decodes correctly."""
    env = {**os.environ, "SPLITKV_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=600,
                           env=env) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    first, second = (r.stdout.split() for r in runs)
    assert int(first[first.index("compiled") + 1]) > 0  # the first process compiled into the empty cache
    assert int(second[second.index("compiled") + 1]) == 0, runs[1].stdout
    assert float(second[second.index("err") + 1]) < 2e-2


def _record_launches(monkeypatch, kernel_cls, launcher: str):
    """Replace launch.<launcher> by a recorder: (dict argument name -> value + 'key', the names)."""
    import inspect

    from splitkv.backends.cutlass import launch

    got = {}
    names = inspect.getfullargspec(kernel_cls.__call__.__wrapped__).args[1:]
    monkeypatch.setattr(launch, "_arch", lambda index: "sm_90a")
    monkeypatch.setattr(launch, "_device_index", lambda t: 0)
    monkeypatch.setattr(launch, "_stream", lambda device: "stream")
    monkeypatch.setattr(launch, launcher, lambda *key: lambda *a: got.update(zip(names, a), key=key))
    return got, names


def _split_case(paged):
    """CPU inputs of one split launch: GQA 6 x Sq 3 over [B, H, L, D] storage, 3 forced splits, the
    merge fused (forced: the rule leaves 18-row tiles to the merge kernel)."""
    lens = [300, 40]
    q, k, v, sl = make_inputs(2, 3, 12, 2, 64, lens, torch.float16, transposed=True)
    bt = None
    if paged:
        k, v, bt = to_paged(k, v, lens, 16)
    with H.tile_override(fused_merge=True):
        p = splitkv.plan(sl, 12, 2, 64, q_len=3, num_splits=3, backend="cutlass", paged=paged)
    o_part, lse_part = p.partials()
    return q, k, v, sl, bt, p, o_part, lse_part, torch.empty_like(q), torch.empty(2, 12, 3)


@needs_dsl
@pytest.mark.parametrize("paged", [False, True])
def test_split_arguments_land_on_the_right_kernel_parameters(monkeypatch, paged):
    """The launch glue's positional arguments, named by the kernel's own signature (CPU tensors,
    launcher replaced by a recorder): a swapped stride would be a silent wrong answer on the GPU."""

    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.split_kernel import SplitKernel

    got, names = _record_launches(monkeypatch, SplitKernel, "_split_launcher")
    q, k, v, sl, bt, p, o_part, lse_part, out, lse = _split_case(paged)
    launch.split_(q, k, v, sl, bt, p, o_part, lse_part, out, lse, 0.125, True)
    t = p.tile
    assert len(got) == len(names) + 1
    assert got["key"] == ("float16", 64, t.block_m, t.block_n, t.num_stages, paged, (False, False, False, ""),
                          "sm_90a")
    assert got["sinks"] == 0 and got["alibi"] == 0 and got["pre_mul"] == 1.0
    assert got["k_scales"] == 0 and got["v_scales"] == 0 and got["v_mul"] == 1.0
    assert (got["group"], got["q_len"], got["num_kv_heads"], got["m_tiles"], got["batch"]) == (6, 3, 2, p.m_tiles, 2)
    assert got["page_size"] == (16 if paged else 1) and got["causal"] == 1
    assert got["fuse"] == 1 and got["counters"] == p.counters.data_ptr()  # 3 splits: merged in the split kernel
    assert (got["s_qb"], got["s_qt"], got["s_qh"]) == q.stride()[:3]
    assert (got["s_kb"], got["s_kn"], got["s_kh"]) == k.stride()[:3]
    assert (got["s_vb"], got["s_vn"], got["s_vh"]) == v.stride()[:3]
    assert (got["s_ps"], got["s_pb"], got["s_ph"], got["s_pt"]) == o_part.stride()[:4]
    assert (got["s_ls"], got["s_lb"], got["s_lh"]) == lse_part.stride()[:3]
    assert (got["s_ob"], got["s_ot"], got["s_oh"], got["s_lob"], got["s_loh"]) == out.stride()[:3] + lse.stride()[:2]
    assert got["q"] == q.data_ptr() and got["o_part"] == o_part.data_ptr() and got["lse"] == lse.data_ptr()
    assert got["s_btb"] == (bt.stride(0) if paged else 0) and got["max_splits"] == p.max_splits
    assert got["scale_log2"] == pytest.approx(0.125 * 1.4426950408889634) and got["stream"] == "stream"
    assert got["work"] == 0 and got["s_work"] == 0  # a forced plan: the (request, split) grid


@needs_dsl
def test_a_work_list_plan_launches_one_grid_column_per_item(monkeypatch):
    """B=4 GQA 32/8 on 132 SMs (one split CTA per SM): the plan's work list holds its 16 splits,
    and the launch's grid is (KV heads x m-tiles, items) — passed as batch 1, max_splits = items —
    instead of 4 x 16 columns of which 48 would exit at once."""
    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.split_kernel import SplitKernel

    got, _ = _record_launches(monkeypatch, SplitKernel, "_split_launcher")
    q, k, v, sl = make_inputs(4, 1, 32, 8, 128, [4096] * 4, torch.bfloat16, pad=0)
    p = splitkv.plan(sl, 32, 8, 128, backend="cutlass", num_sms=132)
    assert p.work is not None and (p.work_items, p.max_splits) == (16, 16)
    assert "grid=work list of 16 items" in p.describe()
    o_part, lse_part = p.partials()
    launch.split_(q, k, v, sl, None, p, o_part, lse_part, torch.empty_like(q), torch.empty(4, 32, 1), 0.1, True)
    assert (got["batch"], got["max_splits"]) == (1, p.work_items)
    assert got["work"] == p.work.data_ptr() and got["s_work"] == p.work.stride(0)
    assert p.work[:, :16].tolist() == H.work_list(p.num_splits, 16).tolist()  # 4 splits each, request order


@needs_dsl
def test_variant_arguments_land_on_the_right_kernel_parameters(monkeypatch):
    """A variant call: its kernel flags, window bounds, softcap scales (the scale moves inside tanh)
    and the sinks / ALiBi pointers."""
    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.split_kernel import SplitKernel
    from splitkv.variants import make

    got, names = _record_launches(monkeypatch, SplitKernel, "_split_launcher")
    q, k, v, sl, bt, p, o_part, lse_part, out, lse = _split_case(False)
    sinks, slopes = torch.zeros(12), torch.ones(12)
    var = make((7, -1), 20.0, sinks, slopes, num_q_heads=12, device=q.device)
    launch.split_(q, k, v, sl, bt, p, o_part, lse_part, out, lse, 0.125, True, variant=var)
    assert got["key"][6] == (True, True, True, "")
    assert (got["win_left"], got["win_right"]) == (7, 1 << 30)
    assert got["pre_mul"] == pytest.approx(0.125 / 20.0)
    assert got["scale_log2"] == pytest.approx(20.0 * 1.4426950408889634)
    assert got["sinks"] == sinks.data_ptr() and got["alibi"] == slopes.data_ptr()


@needs_dsl
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_arguments_land_on_the_right_kernel_parameters(monkeypatch, per_head):
    """An fp8 cache: its format in the kernel key; a per-tensor k_scale folded into scale_log2 and
    v_scale in v_mul, or per-KV-head scales passed as pointers (fp8.py)."""
    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.split_kernel import SplitKernel
    from splitkv.variants import make

    got, names = _record_launches(monkeypatch, SplitKernel, "_split_launcher")
    q, k, v, sl = make_inputs(2, 1, 8, 2, 128, [300, 40], torch.bfloat16)
    k8, v8 = k.to(torch.float8_e5m2), v.to(torch.float8_e5m2)
    ks, vs = (torch.tensor([0.5, 0.25]), torch.tensor([2.0, 4.0])) if per_head else (0.5, 2.0)
    p = splitkv.plan(sl, 8, 2, 128, num_splits=3, kv_dtype=k8.dtype, k_scale=ks, v_scale=vs, backend="cutlass")
    var = make(num_q_heads=8, num_kv_heads=2, device=q.device, k_scale=ks, v_scale=vs, kv_dtype=k8.dtype)
    o_part, lse_part = p.partials()
    launch.split_(q, k8, v8, sl, None, p, o_part, lse_part, torch.empty_like(q), torch.empty(2, 8, 1), 0.125, True,
                  variant=var)
    assert got["key"][6] == (False, False, False, "e5m2") and len(got) == len(names) + 1
    if per_head:
        assert got["k_scales"] == var.k_scale.data_ptr() and got["v_scales"] == var.v_scale.data_ptr()
        assert got["scale_log2"] == pytest.approx(0.125 * 1.4426950408889634) and got["v_mul"] == 1.0
    else:
        assert got["k_scales"] == 0 and got["v_scales"] == 0
        assert got["scale_log2"] == pytest.approx(0.125 * 0.5 * 1.4426950408889634) and got["v_mul"] == 2.0
    assert (got["s_kb"], got["s_kn"], got["s_kh"]) == k8.stride()[:3]  # in fp8 elements: the kernel's byte unit


@needs_dsl
def test_merge_arguments_land_on_the_right_kernel_parameters(monkeypatch):

    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.merge_kernel import MergeKernel

    got, names = _record_launches(monkeypatch, MergeKernel, "_merge_launcher")
    o_part, lse_part = torch.zeros(5, 2, 4, 3, 128), torch.zeros(5, 2, 4, 3)
    out, lse = torch.empty(2, 3, 4, 128, dtype=torch.bfloat16), torch.empty(2, 4, 3)
    sinks = torch.zeros(4)
    launch.merge_(o_part, lse_part, torch.ones(2, dtype=torch.int32), out, lse, skip_single=True, sinks=sinks)
    assert got["key"] == ("float32", "bfloat16", 128, "sm_90a") and len(got) == len(names) + 1
    assert got["sinks"] == sinks.data_ptr()
    assert (got["max_splits"], got["batch"], got["num_heads"], got["q_len"], got["skip_single"]) == (5, 2, 4, 3, 1)
    assert (got["s_ps"], got["s_pb"], got["s_ph"], got["s_pt"]) == o_part.stride()[:4]
    assert (got["s_ls"], got["s_lb"], got["s_lh"], got["s_lt"]) == lse_part.stride()
    assert (got["s_ob"], got["s_ot"], got["s_oh"]) == out.stride()[:3]
    assert (got["s_lob"], got["s_loh"], got["s_lot"]) == lse.stride()


@needs_dsl
def test_fused_merge_is_chosen_by_the_heuristic_and_needs_counters(monkeypatch):
    from splitkv import heuristics

    sl = torch.tensor([5000, 300], dtype=torch.int32)
    p = splitkv.plan(sl, 8, 2, 128, num_splits=4, backend="cutlass")
    assert p.fuse and p.counters is not None and p.partials()[0] is not None
    one = splitkv.plan(sl, 8, 2, 128, num_splits=1, backend="cutlass")
    assert not one.fuse and one.partials() == (None, None)  # nothing split: nothing to merge
    monkeypatch.setattr(heuristics, "CUTLASS_FUSED_MERGE_MAX_SPLITS", 3)
    p = splitkv.plan(sl, 8, 2, 128, num_splits=4, backend="cutlass")
    assert not p.fuse and p.counters is None  # 4 splits > 3: the merge kernel merges
    bi = splitkv.plan(sl, 8, 2, 128, batch_invariant=True, backend="cutlass")
    assert not bi.fuse and bi.tile.block_n == 64  # one merge path and one tile for every batch
    monkeypatch.setattr(heuristics, "CUTLASS_FUSED_MERGE_MAX_SPLITS", heuristics.MAX_SPLITS)
    for Sq, fuses in ((1, True), (2, True), (3, False), (4, False), (16, False)):  # 4 .. 64 packed rows
        p = splitkv.plan(sl, 8, 2, 128, q_len=Sq, num_splits=4, backend="cutlass")
        assert p.fuse == fuses, (Sq, p.tile, p.fuse)  # the merging CTA walks at most 8 rows
    for Sq, splits, fuses in ((1, 16, True), (1, 17, False), (2, 8, True), (2, 9, False)):  # rows x splits <= 64
        p = splitkv.plan(sl, 8, 2, 128, q_len=Sq, num_splits=splits, backend="cutlass")
        assert p.fuse == fuses, (Sq, splits, p.fuse)
    # auto plans count the splits a request at the length bound gets, not the grid's: B=1 GQA 64/8
    # (8 rows) at 4K gets 16 splits on 132 SMs (the merge kernel), B=4 gets 4 (fused)
    for B, fuses in ((1, False), (4, True)):
        p = splitkv.plan(torch.full((B,), 4096, dtype=torch.int32), 64, 8, 128, backend="cutlass", num_sms=132)
        assert p.max_splits == 16 and p.fuse == fuses, (B, p.max_splits, p.fuse)


class _Recorder:
    """A compiled launcher's stand-in: calls and bound calls append (name, arguments) to a log."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __call__(self, *args):
        self.log.append((self.name, args))

    def bind(self, fixed, n_pointers):
        def launch(stream, *pointers):
            assert len(pointers) == n_pointers
            self.log.append((self.name, (*pointers, *fixed, stream)))

        return launch


@needs_dsl
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sinks", [False, True])
def test_bound_launch_of_an_unfused_plan_runs_split_then_merge_as_the_checked_path(monkeypatch, paged, sinks):
    """A plan whose merge is not fused binds both launches for the lean path (cutlass.bind), and the
    bound pair hands the kernels exactly what the checked path (split, then merge_) hands them."""
    from splitkv.backends.cutlass import launch

    log = []
    monkeypatch.setattr(launch, "_arch", lambda index: "sm_90a")
    monkeypatch.setattr(launch, "_device_index", lambda t: 0)
    monkeypatch.setattr(launch, "_stream", lambda index: 7)
    monkeypatch.setattr(launch, "_split_launcher", lambda *key: _Recorder(log, "split"))
    monkeypatch.setattr(launch, "_merge_launcher", lambda *key: _Recorder(log, "merge"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU tensors: device index None
    q, k, v, sl, bt, _, _, _, out, lse = _split_case(paged)
    with H.tile_override(fused_merge=False):
        p = splitkv.plan(sl, 12, 2, 64, q_len=3, num_splits=3, backend="cutlass", paged=paged)
    assert not p.fuse and p.counters is None
    o_part, lse_part = p.partials()
    var = None
    if sinks:
        from splitkv.variants import make

        var = make((-1, -1), 0.0, torch.randn(12), None, num_q_heads=12, device=q.device)
    launch._run(q, k, v, sl, bt, p, o_part, lse_part, out, lse, 0.125, True, var)
    checked = list(log)
    assert [name for name, _ in checked] == ["split", "merge"]
    assert checked[0][1][11] == 0 and checked[1][1][5] == (var.sinks.data_ptr() if sinks else 0)
    bound = launch.bind(q, k, v, sl, bt, p, out, lse, 0.125, True, variant=var)
    assert bound is not None, "an unfused plan fell off the lean path"
    log.clear()
    table = (bt if paged else sl).data_ptr()
    bound(7, q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), table, out.data_ptr(), lse.data_ptr(),
          var.pointers() if sinks else None)
    assert log == checked


@needs_dsl
@pytest.mark.parametrize("paged", [False, True])
def test_bound_launch_passes_what_the_checked_launch_passes(monkeypatch, paged):
    """The per-plan launch cache (second call: no checks, remembered scalars) hands the kernel the
    same arguments as the full path, with the second call's own pointers."""
    from splitkv.backends.cutlass import launch

    seen = []
    monkeypatch.setattr(launch, "_arch", lambda index: "sm_90a")
    monkeypatch.setattr(launch, "_device_index", lambda t: 0)
    monkeypatch.setattr(launch, "_stream", lambda index: "stream")
    monkeypatch.setattr(launch, "_split_launcher", lambda *key: lambda *a: seen.append(a))
    q, k, v, sl, bt, p, o_part, lse_part, out, lse = _split_case(paged)
    for _ in range(2):
        launch._run(q, k, v, sl, bt, p, o_part, lse_part, out, lse, 0.125, True)
    q2, out2 = q.clone(), torch.empty_like(out)
    launch._run(q2, k, v, sl, bt, p, o_part, lse_part, out2, lse, 0.125, True)
    launch.split_(q2, k, v, sl, bt, p, o_part, lse_part, out2, lse, 0.125, True)
    assert len(p.launches.entries) == 1 and seen[0] == seen[1] and seen[2] == seen[3]
    assert seen[2][0] == q2.data_ptr() and seen[2][9] == out2.data_ptr() and seen[2][1:9] == seen[0][1:9]
    from splitkv.variants import make  # a variant call: its own cache entry; the sinks / slopes pass per call

    var = make((9, -1), 0.0, torch.zeros(12), None, num_q_heads=12, device=q.device)
    for _ in range(2):
        launch._run(q, k, v, sl, bt, p, o_part, lse_part, out, lse, 0.125, True, var)
    launch.split_(q, k, v, sl, bt, p, o_part, lse_part, out, lse, 0.125, True, variant=var)
    assert len(p.launches.entries) == 2 and seen[4] == seen[5] == seen[6] and seen[4][12] == var.sinks.data_ptr()
