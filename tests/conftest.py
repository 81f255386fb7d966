"""Test setup: without CUDA, Triton kernels run in the interpreter (must be set before triton is
imported); tests marked `gpu` are skipped."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("SPLITKV_TEST_SHARD")  # "i/n": the i-th of n contiguous slices (gpu_run.sh
    if shard:  # runs n pytest processes at once, so the kernel compiles of a GPU run spread over the CPUs)
        i, n = (int(x) for x in shard.split("/"))
        lo, hi = len(items) * i // n, len(items) * (i + 1) // n
        config.hook.pytest_deselected(items=items[:lo] + items[hi:])
        items[:] = items[lo:hi]
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _fresh_plans():
    """decode() without a plan keeps its plans per signature: a test that patches a heuristic must
    not run on a plan an earlier test made."""
    import splitkv

    splitkv.clear_plans()
    yield
