"""Context-parallel decode (splitkv.distributed) on the CPU: gloo process groups of 2 and 4 ranks
on this machine. Every rank builds the same inputs from one seed, keeps its shard of the cache, and
must return what a single-process decode over the whole cache returns (fp32: within rounding)."""

import datetime
import os
import tempfile
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import splitkv
from splitkv import distributed as D

F32 = torch.float32


def _run(world: int, fn, *args, backend_name: str = "gloo", timeout_s: int = 120) -> dict:
    """fn(rank, world, *args) on `world` ranks (gloo: CPU processes); a rank's exception fails the
    test with its traceback; collectives time out after timeout_s instead of hanging."""
    errs = _run_collect(world, fn, *args, backend_name=backend_name, timeout_s=timeout_s)
    assert not errs, "\n".join(errs.values())
    return errs


def _run_collect(world: int, fn, *args, backend_name: str = "gloo", timeout_s: int = 120) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        manager = mp.get_context("spawn").Manager()
        errs, finished = manager.dict(), manager.dict()
        try:
            mp.start_processes(_worker, args=(world, init, errs, finished, fn, args, backend_name, timeout_s),
                               nprocs=world, start_method="spawn", join=True)
        except mp.ProcessExitedException as e:
            # A rank that died after its fn returned or raised (and reported) died in the process group's
            # teardown (seen once in CI: gloo's "terminate called without an active exception" at exit);
            # what the test checks was already decided. A rank that died inside fn fails the test (so
            # does one that dies in teardown while another rank is still inside fn: rarer, not covered).
            if set(finished.keys()) != set(range(world)):
                raise
            warnings.warn(f"a rank died after finishing its work: {e}", stacklevel=2)
        return dict(errs)


def _worker(rank, world, init, errs, finished, fn, args, backend_name, timeout_s):
    if backend_name == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend_name, init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    except Exception:  # noqa: BLE001 - reported to the parent
        errs[rank] = f"rank {rank}:\n{traceback.format_exc()}"
    finished[rank] = True
    dist.destroy_process_group()


def _case(seed, B, Sq, Hq, Hkv, Dh, lens):
    g = torch.Generator().manual_seed(seed)
    L = max(lens)
    k = torch.randn(B, L, Hkv, Dh, generator=g)
    v = torch.randn(B, L, Hkv, Dh, generator=g)
    q = torch.randn(B, Sq, Hq, Dh, generator=g)
    k_new = torch.randn(B, Sq, Hkv, Dh, generator=g)
    v_new = torch.randn(B, Sq, Hkv, Dh, generator=g)
    return q, k, v, k_new, v_new


def _check_steps(rank, world, policy, lens, page_size, shard_tokens, device="cpu", dtype=F32, backend="torch"):
    for Sq in (1, 3):
        _check_step(rank, world, policy, Sq, lens, page_size, shard_tokens, device, dtype, backend)


def _check_step(rank, world, policy, Sq, lens, page_size, shard_tokens, device, dtype, backend):
    B, Hq, Hkv, Dh = len(lens), 8, 2, 64
    q, k, v, k_new, v_new = (t.to(device, dtype) for t in _case(0, B, Sq, Hq, Hkv, Dh, lens))
    cache = D.ShardedPagedKVCache(64, page_size, Hkv, Dh, policy=policy, shard_tokens=shard_tokens, dtype=dtype,
                                  device=device, backend="torch" if backend == "torch" else "auto")
    ids = [cache.add_sequence() for _ in range(B)]
    cache.append(ids, k, v, lengths=lens)  # the prompt, dealt out by position
    held = [cache.local.seq_len(s) for s in ids]
    expect = [sum(cache.owner(p) == rank for p in range(L)) for L in lens]
    assert held == expect, (held, expect)  # appends land on the owning rank only
    bt, local_lens = cache.batch(ids)
    o, lse = D.decode_context_parallel(q, cache.local.k_pages(), cache.local.v_pages(),
                                       local_lens.to(device, torch.int32), block_table=bt.to(device), new_k=k_new,
                                       new_v=v_new, return_lse=True, backend=backend)
    # the single-process truth: the whole cache plus the step's keys, causal, bottom-right
    full_k = torch.zeros(B, max(lens) + Sq, Hkv, Dh, device=device, dtype=dtype)
    full_v = torch.zeros_like(full_k)
    for b, L in enumerate(lens):
        full_k[b, :L], full_v[b, :L] = k[b, :L], v[b, :L]
        full_k[b, L:L + Sq], full_v[b, L:L + Sq] = k_new[b], v_new[b]
    total = torch.tensor([L + Sq for L in lens], dtype=torch.int32, device=device)
    ro, rl = splitkv.decode(q, full_k, full_v, total, return_lse=True, backend=backend)
    tol = 1e-5 if dtype == F32 else 2e-2
    assert (o.float() - ro.float()).abs().max() < tol and (lse - rl).abs().max() < tol
    # the new keys go to their owners; the next step's shards agree with the global lengths
    cache.append(ids, k_new, v_new)
    assert [cache.seq_len(s) for s in ids] == [L + Sq for L in lens]
    assert sum(cache.owner(p) == rank for p in range(lens[0] + Sq)) == cache.local.seq_len(ids[0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("policy", D.POLICIES)
def test_context_parallel_equals_single_process(world, policy):
    # ragged: request 1 is shorter than one rank's contiguous shard (later ranks hold none of it),
    # request 2 is empty before the step; Sq 1 and 3 (causal over the step's keys)
    _run(world, _check_steps, policy, [150, 20, 0, 97], 16, 48)


def _check_steps_gpu(rank, world, policy):
    torch.cuda.set_device(rank)
    _check_steps(rank, world, policy, [1500, 20, 0, 970], 16, 480, device=f"cuda:{rank}", dtype=torch.bfloat16,
                 backend="auto")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("policy", D.POLICIES)
def test_context_parallel_on_gpus_over_nccl(policy):
    _run(min(torch.cuda.device_count(), 4), _check_steps_gpu, policy, backend_name="nccl")


def _sq1_without_new_keys(rank, world):
    B, Hq, Hkv, Dh, lens = 3, 4, 4, 64, [70, 5, 33]
    q, k, v, _, _ = _case(1, B, 1, Hq, Hkv, Dh, lens)
    cache = D.ShardedPagedKVCache(32, 8, Hkv, Dh, dtype=F32, device="cpu", backend="torch")
    ids = [cache.add_sequence() for _ in range(B)]
    cache.append(ids, k, v, lengths=lens)
    bt, local_lens = cache.batch(ids)
    o = D.decode_context_parallel(q, cache.local.k_pages(), cache.local.v_pages(), local_lens.to(torch.int32),
                                  block_table=bt, backend="torch")
    ro = splitkv.decode(q, k, v, torch.tensor(lens, dtype=torch.int32), backend="torch")
    assert (o - ro).abs().max() < 1e-5
    with pytest_raises(ValueError, "new_k"):
        D.decode_context_parallel(q.expand(B, 2, Hq, Dh), cache.local.k_pages(), cache.local.v_pages(),
                                  local_lens.to(torch.int32), block_table=bt, backend="torch")


def pytest_raises(exc, text):
    return pytest.raises(exc, match=text)


def test_sq1_with_the_step_already_cached_and_the_causal_rule():
    _run(2, _sq1_without_new_keys)


def test_single_process_is_plain_decode():
    q, k, v, k_new, v_new = _case(2, 2, 2, 4, 2, 64, [40, 9])
    lens = torch.tensor([40, 9], dtype=torch.int32)
    o = D.decode_context_parallel(q, k, v, lens, new_k=k_new, new_v=v_new, backend="torch")
    full_k, full_v = torch.cat([k, torch.zeros_like(k_new)], 1), torch.cat([v, torch.zeros_like(v_new)], 1)
    for b, L in enumerate([40, 9]):
        full_k[b, L:L + 2], full_v[b, L:L + 2] = k_new[b], v_new[b]
    ro = splitkv.decode(q, full_k, full_v, lens + 2, backend="torch")
    assert (o - ro).abs().max() < 1e-5


def test_cost_model_predicts_the_obvious():
    small = D.cost_model(4096, 8)
    big = D.cost_model(1 << 20, 8)
    assert small.speedup < 1.5 < big.speedup < 8  # communication and overhead dominate short contexts
    assert D.cost_model(1 << 20, 1).speedup == pytest.approx(1.0)
    assert D.cost_model(1 << 20, 4, link_gbps=50).comm_us > D.cost_model(1 << 20, 4).comm_us


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="policy"):
        D.ShardedPagedKVCache(8, 16, 2, 64, policy="stripes", device="cpu")
    with pytest.raises(ValueError, match="shard_tokens"):
        D.ShardedPagedKVCache(8, 16, 2, 64, policy="contiguous", device="cpu")
    q, k, v, k_new, v_new = _case(3, 1, 2, 4, 2, 64, [10])
    with pytest.raises(ValueError, match="new_k/new_v"):
        D.decode_context_parallel(q, k, v, torch.tensor([10], dtype=torch.int32), new_k=k_new, backend="torch")


def test_sharded_cache_and_cp_decode_name_bad_arguments():
    c = D.ShardedPagedKVCache(10, 16, 2, 64, dtype=F32, device="cpu")
    s = c.add_sequence()
    k3 = torch.randn(1, 3, 2, 64)
    with pytest.raises(ValueError, match="v: shape"):  # k and v of different lengths
        c.append([s], k3, torch.randn(1, 4, 2, 64))
    with pytest.raises(ValueError, match="seq_ids: 99"):
        c.append([99], k3, k3)
    with pytest.raises(ValueError, match="layer"):
        c.append([s], k3, k3, layer=5)
    with pytest.raises(ValueError, match="sid: 1234"):
        c.seq_len(1234)
    assert c.seq_len(s) == 0
    q, lens = torch.randn(1, 1, 8, 64), torch.tensor([10], dtype=torch.int32)
    k, new = torch.randn(1, 10, 2, 64), torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match=r"new_k/new_v: expected \[B, Sq, Hkv, D\] = \(1, 1, 2, 64\)"):
        D.decode_context_parallel(q, k, k, lens, new_k=new, new_v=new, backend="torch")
    with pytest.raises(ValueError, match="q: expected a tensor"):
        D.decode_context_parallel(q[0], k, k, lens, backend="torch")
    with pytest.raises(ValueError, match="world"):
        D.cost_model(1000, 0)
    with pytest.raises(ValueError, match="link_gbps"):
        D.cost_model(1000, 2, link_gbps=0)
    with pytest.raises(SystemExit):
        D.main(["--link-gbps", "0"])


def _bad_heads_on_every_rank(rank, world):
    # 3 tokens, round_robin by page of 16: rank 1 owns none of them, and must still refuse them
    c = D.ShardedPagedKVCache(8, 16, 2, 64, dtype=F32, device="cpu")
    s = c.add_sequence()
    bad = torch.randn(1, 3, 3, 64)
    with pytest.raises(ValueError, match="k: expected shape"):
        c.append([s], bad, bad)
    assert c.seq_len(s) == 0 and c.local.seq_len(s) == 0


def test_a_bad_append_is_refused_by_ranks_that_own_none_of_it():
    _run(2, _bad_heads_on_every_rank)


def _one_rank_fails(rank, world):
    q, k, v, _, _ = _case(4, 1, 1, 4, 2, 64, [30])
    lens = torch.tensor([30], dtype=torch.int32)
    if rank == 1:
        k = k[..., :32]  # a bad shard on one rank: its decode raises before any collective
    D.decode_context_parallel(q, k, v, lens, backend="torch")


def test_a_failing_rank_is_reported_not_hung():
    """Rank 1's input error surfaces with its message; rank 0, left waiting in the all-gather, gets
    an error from the collective (its peer left, or at the latest the 10 s timeout), not a hang."""
    errs = _run_collect(2, _one_rank_fails, timeout_s=10)
    assert set(errs) == {0, 1}
    assert "k_cache" in errs[1]  # the validation message names the argument
