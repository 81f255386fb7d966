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
    launch.schedule(sl, sched, rule)
    n, c = H.schedule(sl.cpu(), rule)
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
