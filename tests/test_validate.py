"""Every bad input gives a clear error that names the argument."""

import pytest
import torch

import splitkv
from splitkv import execute, validate


def _ok(B=2, Sq=1, Hq=8, Hkv=2, D=64, L=32, dtype=torch.float16):
    q = torch.randn(B, Sq, Hq, D, dtype=dtype)
    k = torch.randn(B, L, Hkv, D, dtype=dtype)
    v = torch.randn(B, L, Hkv, D, dtype=dtype)
    return q, k, v, torch.full((B,), L, dtype=torch.int32)


def _check(exc, match, **over):
    q, k, v, sl = _ok()
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=sl)
    kw = {}
    for name, val in over.items():
        (args if name in args else kw)[name] = val
    with pytest.raises(exc, match=match):
        splitkv.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], **kw)


def test_dtype_mismatch():
    _check(TypeError, "k_cache", k_cache=torch.randn(2, 32, 2, 64, dtype=torch.bfloat16))


def test_wrong_ranks():
    _check(ValueError, "q", q=torch.randn(2, 8, 64, dtype=torch.float16))
    _check(ValueError, "k_cache", k_cache=torch.randn(2, 32, 128, dtype=torch.float16))


def test_kv_shape_mismatch():
    _check(ValueError, "v_cache", v_cache=torch.randn(2, 31, 2, 64, dtype=torch.float16))


def test_head_dim_mismatch():
    _check(ValueError, "head dim", k_cache=torch.randn(2, 32, 2, 128, dtype=torch.float16),
           v_cache=torch.randn(2, 32, 2, 128, dtype=torch.float16))


def test_heads_not_multiple():
    _check(ValueError, "multiple", k_cache=torch.randn(2, 32, 3, 64, dtype=torch.float16),
           v_cache=torch.randn(2, 32, 3, 64, dtype=torch.float16))


def test_seqlens_wrong_length_dtype_device_values():
    _check(ValueError, "cache_seqlens", cache_seqlens=torch.tensor([3], dtype=torch.int32))
    _check(TypeError, "cache_seqlens", cache_seqlens=torch.tensor([3, 3], dtype=torch.int64))
    _check(ValueError, "cache_seqlens", cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32))
    _check(ValueError, "cache_seqlens", cache_seqlens=torch.tensor([33, 3], dtype=torch.int32))
    if torch.cuda.is_available():
        _check(ValueError, "cache_seqlens", cache_seqlens=torch.tensor([3, 3], dtype=torch.int32, device="cuda"))


def test_sq_too_large_and_head_dim_unsupported():
    _check(ValueError, "Sq", q=torch.randn(2, 17, 8, 64, dtype=torch.float16))
    _check(ValueError, "head dim", q=torch.randn(2, 1, 8, 84, dtype=torch.float16),
           k_cache=torch.randn(2, 32, 2, 84, dtype=torch.float16), v_cache=torch.randn(2, 32, 2, 84, dtype=torch.float16))


def test_non_unit_stride_on_d():
    k = torch.randn(2, 32, 2, 128, dtype=torch.float16)[..., ::2]
    _check(ValueError, "unit stride", k_cache=k)


def test_unknown_backend_and_bad_num_splits():
    _check(ValueError, "backend", backend="cuda-magic")
    _check(ValueError, "num_splits", num_splits=0)
    _check(ValueError, "num_splits", num_splits=2.5)


def test_float32_only_on_torch_backend():
    q, k, v, sl = _ok(dtype=torch.float32)
    with pytest.raises(TypeError, match="q"):
        splitkv.decode(q, k, v, sl, backend="triton")


def test_block_table_errors():
    q, k, v, sl = _ok(L=16)
    kp = torch.randn(8, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="block_table"):
        splitkv.decode(q, kp, kp, sl, block_table=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_table"):
        splitkv.decode(q, kp, kp, sl, block_table=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):  # needs 3 pages, table has 2 columns
        splitkv.decode(q, kp, kp, torch.tensor([40, 3], dtype=torch.int32),
                       block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table"):  # used page id out of range
        splitkv.decode(q, kp, kp, sl, block_table=torch.tensor([[0, 1], [9, 1]], dtype=torch.int32))


def test_plan_mismatch():
    q, k, v, sl = _ok()
    p = splitkv.plan(sl, 8, 1, 64)
    with pytest.raises(ValueError, match="plan"):
        splitkv.decode(q, k, v, sl, plan=p)


def test_lengths_and_page_ids_are_checked_on_the_cpu_with_a_plan_too():
    """On the CPU reading them is free, so a call with a plan checks lengths and used page ids as one
    without does (on a GPU with a plan they are the caller's contract, checked under SPLITKV_DEBUG=1)."""
    q, k, v, sl = _ok(L=16)
    kp = torch.randn(8, 16, 2, 64, dtype=torch.float16)
    p = splitkv.plan(sl, 8, 2, 64, paged=True)
    splitkv.decode(q, kp, kp, sl, block_table=torch.tensor([[0, 1], [2, 1]], dtype=torch.int32), plan=p)
    with pytest.raises(ValueError, match="block_table"):  # page 9 does not exist
        splitkv.decode(q, kp, kp, sl, block_table=torch.tensor([[0, 1], [9, 1]], dtype=torch.int32), plan=p)
    pc = splitkv.plan(sl, 8, 2, 64)
    for bad in ([40, 16], [-1, 16]):  # past Lmax = 16, negative
        with pytest.raises(ValueError, match="cache_seqlens: entry 0"):
            splitkv.decode(q, k, v, torch.tensor(bad, dtype=torch.int32), plan=pc)


def test_debug_mode_flag_keeps_the_checks(monkeypatch):
    q, k, v, sl = _ok(L=16)
    monkeypatch.setattr(execute, "DEBUG", True)
    with pytest.raises(ValueError, match="cache_seqlens"):
        splitkv.decode(q, k, v, torch.tensor([17, 3], dtype=torch.int32), plan=splitkv.plan(sl, 8, 2, 64))


def test_no_query_heads():
    q, k, v, sl = _ok()
    with pytest.raises(ValueError, match="q: expected at least one query head"):
        splitkv.decode(q[:, :, :0], k, v, sl)


def test_plan_rejects_what_decode_would():
    sl = torch.tensor([100, 20], dtype=torch.int32)
    with pytest.raises(TypeError, match="kv_dtype"):
        splitkv.plan(sl, 8, 2, 64, kv_dtype=torch.int8)
    with pytest.raises(TypeError, match="kv_dtype"):
        splitkv.plan(sl, 8, 2, 64, kv_dtype=torch.float16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype: torch.float32 runs on the torch backend"):
        splitkv.plan(sl, 8, 2, 64, dtype=torch.float32, backend="triton")
    for bad in (0, -1, 2.5, -1.0, True):
        with pytest.raises(ValueError, match="num_sms"):
            splitkv.plan(sl, 8, 2, 64, num_sms=bad)
    assert splitkv.plan(sl, 8, 2, 64, kv_dtype=torch.bfloat16).batch == 2


def test_plan_checks_cpu_lengths_against_max_seqlen():
    """A graph-safe plan (max_seqlen given) still reads CPU lengths, where reading is free."""
    for bad, match in (([-5, 3], "lengths must be >= 0"), ([9, 3], "longest length 9 exceeds max_seqlen 8")):
        with pytest.raises(ValueError, match=f"cache_seqlens: {match}"):
            splitkv.plan(torch.tensor(bad, dtype=torch.int32), 8, 2, 64, max_seqlen=8)
    assert splitkv.plan(torch.tensor([8, 0], dtype=torch.int32), 8, 2, 64, max_seqlen=8).batch == 2


def test_variant_calls_check_q_before_reading_its_shape():
    q, k, v, sl = _ok()
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        splitkv.decode(q.tolist(), k, v, sl, softcap=1.0)
    with pytest.raises(ValueError, match="q: expected rank 4"):
        splitkv.decode(q[:, 0], k, v, sl, sinks=torch.zeros(8))
    with pytest.raises(TypeError, match="k_cache: expected a torch.Tensor"):
        splitkv.decode(q, None, v, sl, window_size=(4, 0))


def test_paged_cache_of_page_size_zero():
    q, _, _, sl = _ok()
    pool = torch.zeros(2, 0, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache: page size"):
        splitkv.decode(q, pool, pool, sl * 0, block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_as_int():
    """An integer (Python, NumPy, 0-d integer tensor) as a Python int; anything else (bools and
    floats too, -1.0 included) None."""
    np = pytest.importorskip("numpy")
    for x in (0, -1, 7, np.int64(-1), np.int32(3), torch.tensor(-1), torch.tensor(5, dtype=torch.int32)):
        assert type(validate.as_int(x)) is int and validate.as_int(x) == int(x)
    for x in (True, False, -1.0, 2.5, np.float64(-1.0), torch.tensor(-1.0), torch.tensor([1, 2]), torch.tensor([3]),
              torch.tensor(True), "1", None):
        assert validate.as_int(x) is None


def test_plan_for_another_device():
    q, k, v, sl = _ok()
    p = splitkv.plan(sl, 8, 2, 64)
    object.__setattr__(p, "device", torch.device("meta"))  # stands in for a plan made on a GPU
    with pytest.raises(ValueError, match="plan"):
        splitkv.decode(q, k, v, sl, plan=p)


def test_signature_keeps_devices_apart():
    """A call validated once is remembered by its signature: the same shapes with a tensor on
    another device (here a meta cache beside CPU ones) is another signature, checked again."""
    q, k, v, sl = _ok()
    splitkv.decode(q, k, v, sl, backend="torch")  # remembered
    sig = validate._signature(q, k, v, sl, None, None, None, "torch")
    assert sig != validate._signature(q, k.to("meta"), v, sl, None, None, None, "torch")
    with pytest.raises(ValueError, match="k_cache"):
        splitkv.decode(q, k.to("meta"), v, sl, backend="torch")
    if torch.cuda.is_available():
        assert sig != validate._signature(q, k.cuda(), v, sl, None, None, None, "torch")
