"""Planner rules with fake SM counts (pure functions, no GPU)."""

import pytest

from splitkv import heuristics as H
from splitkv.plan import build_plan


def _blocks(lens, chunk, per_split):
    return sum(H.splits_for_lengths(lens, chunk)) * per_split


@pytest.mark.parametrize("num_sms", [8, 78, 132])
@pytest.mark.parametrize("lens", [[131072], [32768] * 4, [4096], [1024, 131072, 65537, 5]])
@pytest.mark.parametrize("hkv", [1, 8, 32])
def test_chunk_is_bounded_and_aligned(num_sms, lens, hkv):
    chunk = H.choose_chunk_len(lens, num_kv_heads=hkv, m_tiles=1, block_n=64, num_sms=num_sms)
    assert chunk % 64 == 0 and chunk >= 64
    splits = H.splits_for_lengths(lens, chunk)
    assert max(splits) <= H.MAX_SPLITS
    if max(splits) > 1:
        assert chunk >= H.MIN_CHUNK_KEYS
        # never more blocks than the target, unless the minimum chunk forces it
        assert _blocks(lens, chunk, hkv) <= num_sms * H.BLOCKS_PER_SM or chunk == H.MIN_CHUNK_KEYS


def test_no_split_when_grid_already_full():
    lens = [32768] * 16
    chunk = H.choose_chunk_len(lens, num_kv_heads=32, m_tiles=1, block_n=64, num_sms=132)  # 512 blocks
    assert H.splits_for_lengths(lens, chunk) == [1] * 16


def test_no_split_for_short_sequences():
    chunk = H.choose_chunk_len([300], num_kv_heads=1, m_tiles=1, block_n=64, num_sms=132)
    assert H.splits_for_lengths([300], chunk) == [1]


def test_longer_sequences_get_more_splits():
    lens = [1024, 16384, 131072]
    chunk = H.choose_chunk_len(lens, num_kv_heads=8, m_tiles=1, block_n=64, num_sms=132)
    s = H.splits_for_lengths(lens, chunk)
    assert s[0] <= s[1] <= s[2] and s[2] > s[0]
    # the per-split work is balanced: no split streams more than chunk keys
    assert all(-(-L // n) <= chunk for L, n in zip(lens, s))


def test_more_sms_more_splits():
    few = H.choose_chunk_len([131072], num_kv_heads=8, m_tiles=1, block_n=64, num_sms=16)
    many = H.choose_chunk_len([131072], num_kv_heads=8, m_tiles=1, block_n=64, num_sms=132)
    assert many < few


def test_forced_num_splits_and_plan():
    p = build_plan([1000, 0, 17], batch=3, num_q_heads=8, num_kv_heads=2, head_dim=64, q_len=1,
                   device="cpu", num_splits=3)
    assert p.num_splits.tolist() == [3, 3, 3] and p.max_splits == 3
    assert all(c % p.tile.block_n == 0 for c in p.chunk_lens.tolist())
    assert p.chunk_lens[0] * 3 >= 1000


def test_tile_config_packs_gqa_rows():
    assert H.tile_config(128, 4).block_m == 16  # mma minimum
    assert H.tile_config(128, 7 * 3).block_m == 32
    t = H.tile_config(128, 16 * 16)
    assert t.block_m == H.MAX_BLOCK_M and H.query_tiles(256, t.block_m) == 4


def test_splits_rule_same_on_tensors_and_ints():
    import torch

    lens = [0, 1, 255, 256, 257, 100000]
    t = H.splits_for_lengths(torch.tensor(lens, dtype=torch.int32), 256, 128)
    assert t.tolist() == H.splits_for_lengths(lens, 256, 128)


def test_print_plan(capsys, monkeypatch):
    import torch

    import splitkv

    monkeypatch.setenv("SPLITKV_PRINT_PLAN", "1")
    splitkv.plan(torch.tensor([5000], dtype=torch.int32), 32, 8, 128, num_sms=132)
    out = capsys.readouterr().out
    assert "DecodePlan" in out and "num_splits=" in out
