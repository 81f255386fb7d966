"""The GPU scheduler (Triton; interpreted on the CPU) computes exactly heuristics.schedule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitkv import heuristics as H

launch = pytest.importorskip("splitkv.backends.triton.launch")


def _both(lens, rule, device, stride=1):
    base = torch.tensor([x for L in lens for x in [L] + [-7] * (stride - 1)], dtype=torch.int32, device=device)
    sl = base[::stride]
    sched = torch.full((2, 4 * len(lens) + 4), -1, dtype=torch.int32, device=device)
    items = H.work_items(rule, len(lens))
    work = torch.full((2, items + 5), -9, dtype=torch.int32, device=device) if items else None
    launch.schedule(sl, sched, rule, work=work[:, :items] if items else None)
    n, c = H.schedule(sl.cpu(), rule)
    if items:  # the work list: the spec's in the first `items` columns, nothing written past them
        assert torch.equal(work[:, :items].cpu(), H.work_list(n, items)), (lens, rule)
        assert bool((work[:, items:] == -9).all())
    return sched[:, : len(lens)].cpu(), torch.stack([n, c])


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 140000)), min_size=1, max_size=20),
       hkv=st.sampled_from([1, 2, 8, 32]), sms=st.sampled_from([8, 132]), mode=st.sampled_from(["auto", "forced",
                                                                                                   "fixed"]),
       stride=st.sampled_from([1, 2]))
def test_kernel_matches_the_rule(lens, hkv, sms, mode, stride):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rule = H.split_rule(batch=len(lens), groups_per_request=hkv, block_n=64, max_seqlen=max(max(lens), 1),
                        num_sms=sms, num_splits=5 if mode == "forced" else None, batch_invariant=mode == "fixed")
    got, want = _both(lens, rule, device, stride)
    assert torch.equal(got, want), (lens, rule)


def test_kernel_ragged_replan(device):
    lens = [int(1024 * 2 ** (7 * i / 15)) for i in range(16)]
    rule = H.split_rule(batch=16, groups_per_request=8, block_n=64, max_seqlen=131072, num_sms=132)
    got, want = _both(lens, rule, device)
    assert torch.equal(got, want) and int(want[0].sum()) * 8 > 132 * 2  # the ragged re-plan ran


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 140000)), min_size=1, max_size=40),
       hkv=st.sampled_from([1, 2, 8, 32]), sms=st.sampled_from([8, 132]), block_n=st.sampled_from([64, 128]))
def test_work_items_bound_every_schedule(lens, hkv, sms, block_n):
    """No lengths under the bound give more splits than the work list has items (else splits would
    be dropped): the list is sized from the rule alone."""
    rule = H.split_rule(batch=len(lens), groups_per_request=hkv, block_n=block_n, max_seqlen=max(max(lens), 1),
                        num_sms=sms)
    n, _ = H.schedule(torch.tensor(lens, dtype=torch.int32), rule)
    items = H.work_items(rule, len(lens))
    assert int(n.sum()) <= (items if items is not None else len(lens) * rule.max_splits)


def test_work_list_spec():
    w = H.work_list(torch.tensor([2, 1, 3], dtype=torch.int32), 8)
    assert w.tolist() == [[0, 0, 1, 2, 2, 2, -1, -1], [0, 1, 0, 0, 1, 2, -1, -1]]
    with pytest.raises(AssertionError):
        H.work_list(torch.tensor([5, 5], dtype=torch.int32), 8)


def test_work_list_kernel_ragged(device):
    """A B=4 GQA batch (the work list's case): uniform and ragged lengths; B=16 keeps the grid."""
    assert H.work_items(H.split_rule(batch=16, groups_per_request=8, block_n=128, max_seqlen=131072,
                                     num_sms=132), 16) is None
    for lens in ([32768] * 4, [1000, 131072, 7, 40000]):
        rule = H.split_rule(batch=4, groups_per_request=8, block_n=128, max_seqlen=131072, num_sms=132)
        assert H.work_items(rule, 4) == 33
        got, want = _both(lens, rule, device)
        assert torch.equal(got, want)
