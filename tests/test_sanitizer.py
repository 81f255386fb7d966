"""compute-sanitizer (memcheck, racecheck) over every CuTe DSL kernel variant, marked gpu.

The variants run in four parts (fp16 and bf16 split kernels, fp8-cache split kernels, merge
kernels), each its own sanitized process: the whole set in one process outlasted a 10-minute GPU
call. `bash benchmarks/gpu_run.sh sanitizer` compiles them all into the kernel disk cache first, in
parallel (fill_disk_cache), then runs the parts side by side; under the sanitizer a kernel is only
loaded from that cache, never compiled.
"""

import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
from helpers import needs_dsl

ARCH = "sm_90a"
PARTS = ("fp16", "bf16", "fp8", "merge")


def configs(part: str | None = None) -> list:
    """The kernel configs a part launches (None: all of them)."""
    from splitkv.backends.cutlass import config as C

    split = C.split_variants()
    by_part = {"fp16": [c for c in split if c.dtype == "float16" and not c.kv_fp8],
               "bf16": [c for c in split if c.dtype == "bfloat16" and not c.kv_fp8],
               "fp8": [c for c in split if c.kv_fp8], "merge": C.merge_variants()}
    return by_part[part] if part else [c for p in PARTS for c in by_part[p]]


def _compile(cfg) -> str:
    from splitkv.backends.cutlass import config as C
    from splitkv.backends.cutlass import launch as L

    (L.compile_split if isinstance(cfg, C.SplitConfig) else L.compile_merge)(cfg, ARCH)
    return cfg.name


def fill_disk_cache(cfgs: list, jobs: int | None = None) -> int:
    """Compile the configs the disk cache lacks, in spawned processes (compiles are CPU-bound;
    186 of them one after another take minutes). Returns how many were compiled."""
    from splitkv.backends.cutlass import cache

    root = cache.cache_dir()
    if root is None:  # SPLITKV_CACHE_DIR=off: nothing a later process could load
        return 0
    todo = [c for c in cfgs if not (root / (cache.cache_key(c.name, ARCH) + ".mlirbc")).exists()]
    jobs = max(1, min(len(todo), jobs or (os.cpu_count() or 2) - 2))
    if len(todo) == 1 or jobs == 1:
        for c in todo:
            _compile(c)
    elif todo:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as ex:
            list(ex.map(_compile, todo))
    return len(todo)


_SPLIT_PART = """
dt = {'fp16': torch.float16, 'bf16': torch.bfloat16}[PART]
for D in C.HEAD_DIMS:
    for G, Sq in ((4, 1), (8, 4), (16, 4)):  # 4 / 32 / 64 packed rows: block_m 16 / 32 / 64
        for page in (None, 16):
            lens = [70, 3, 0]
            q, k, v, sl = make_inputs(3, Sq, 2 * G, 2, D, lens, dt, 'cuda', seed=D + G)
            kk, vv, bt = (k, v, None) if page is None else to_paged(k, v, lens, page)
            for ns in ((3, 1) if page is None else (3,)):  # 1: the unsplit tile (its own at some D)
                o, lse = splitkv.decode(q, kk, vv, sl, block_table=bt, num_splits=ns, backend='cutlass',
                                        return_lse=True)
                # on the CPU (racecheck flags cuBLAS's own kernels); the contiguous cache holds the same keys
                assert_close_to_reference(*(t.cpu() for t in (o, lse, q, k, v, sl)))
for G, Sq in ((4, 1), (8, 4), (16, 4)):  # the several-wave tile (D 128 contiguous): a plan for 4 SMs
    lens = [0, 1, 17, 113, 600]
    q, k, v, sl = make_inputs(5, Sq, 2 * G, 2, 128, lens, dt, 'cuda', seed=G)
    p = splitkv.plan(sl, 2 * G, 2, 128, q_len=Sq, backend='cutlass', num_sms=4, max_seqlen=600)
    assert (p.tile.block_n, p.tile.num_stages) == (128, 3), p.tile
    o, lse = splitkv.decode(q, k, v, sl, plan=p, backend='cutlass', return_lse=True)
    assert_close_to_reference(*(t.cpu() for t in (o, lse, q, k, v, sl)))
"""

_FP8_PART = """
for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):  # fp8 caches (their kernels: C.FP8_HEAD_DIMS)
    for dt in (torch.float16, torch.bfloat16):
        for D in C.FP8_HEAD_DIMS:
            for G, Sq in ((4, 1), (8, 4), (16, 4)):
                for page in (None, 16):
                    lens = [70, 3, 0]
                    q, k, v, sl = make_inputs(3, Sq, 2 * G, 2, D, lens, torch.float32, 'cuda', seed=D + G,
                                              nan_tail=False)
                    k8, v8 = k.to(f8), v.to(f8)
                    kk, vv, bt = (k8, v8, None) if page is None else to_paged(k8, v8, lens, page)
                    splitkv.decode(q.to(dt), kk, vv, sl, block_table=bt, num_splits=3, backend='cutlass',
                                   k_scale=0.5, v_scale=2.0)
                    torch.cuda.synchronize()
"""

_MERGE_PART = """
for pdt in (torch.float32, torch.float16, torch.bfloat16):  # merge_states feeds fp16/bf16 partials
    for odt in (torch.float16, torch.bfloat16):
        for D in C.HEAD_DIMS:
            S, B, H, T = 5, 2, 3, 2
            op = torch.randn(S, B, H, T, D, device='cuda').to(pdt)
            lp = torch.randn(S, B, H, T, device='cuda')
            lp[:, 1] = -math.inf
            out, lse = torch.empty(B, T, H, D, dtype=odt, device='cuda'), torch.empty(B, H, T, device='cuda')
            L.merge(op, lp, torch.tensor([5, 2], dtype=torch.int32, device='cuda'), out, lse)
            torch.cuda.synchronize()
            assert torch.all(out[1] == 0) and torch.isfinite(out[0]).all()
"""


def _snippet(part: str) -> str:
    """The part's launches, then a check that they reached every config of the part."""
    body = {"fp16": _SPLIT_PART, "bf16": _SPLIT_PART, "fp8": _FP8_PART, "merge": _MERGE_PART}[part]
    want = sorted(c.name for c in configs(part))
    return (f"import math, torch, splitkv\nfrom helpers import make_inputs, to_paged, assert_close_to_reference\n"
            f"from splitkv.backends.cutlass import config as C, launch as L\nPART = {part!r}\n{body}\n"
            f"want = set({want!r})\nnames = {{key[0] for key in L._PACKERS}}\n"
            "print('ok', names >= want, len(names & want), 'of', len(want), 'variants; missing:', "
            "sorted(want - names))\n")


def test_parts_cover_every_variant_once():
    """Pure Python: the parts partition the backend's variant list, and each snippet compiles."""
    from splitkv.backends.cutlass import config as C

    every = [c.name for c in C.split_variants() + C.merge_variants()]
    names = [c.name for c in configs()]
    assert sorted(names) == sorted(every) and len(set(names)) == len(names)
    for part in PARTS:
        assert configs(part) and f"PART = {part!r}" in _snippet(part)
        compile(_snippet(part), f"<sanitizer {part}>", "exec")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool, part):
    _skip_without_sanitizer()
    fill_disk_cache(configs(part))  # compiling under the sanitizer would take many minutes
    _assert_sanitizer_clean(tool, _snippet(part), timeout=560)


def _skip_without_sanitizer() -> None:
    import shutil

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")


def _assert_sanitizer_clean(tool: str, snippet: str, timeout: int) -> None:
    """Run snippet (which prints 'ok True' when its own checks pass) under compute-sanitizer `tool`."""
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    # --report-api-errors no: on the H200 (2026-11-29) memcheck reported 34 errors whose host frames
    # were the DSL's GPU-arch probe (cuda-python API calls), not kernel accesses; count device errors only
    res = subprocess.run(["compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
                          sys.executable, "-c", snippet], capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0 and "ok True" in res.stdout, (res.stdout + res.stderr)[-4000:]
    print(res.stdout.strip().splitlines()[-1], [ln for ln in res.stdout.splitlines() if "SUMMARY" in ln])


# the work-list grid (heuristics.work_items): auto plans of small batches, ragged lengths (a request
# with no key, items past the last split), dense and paged, the fused merge's arrival counters
_WORK_LIST_SNIPPET = """
import torch, splitkv
from helpers import make_inputs, to_paged, assert_close_to_reference
n = 0
for paged, B, L in ((False, 4, 4096), (True, 2, 16384)):  # the smallest batches whose plans take a list
    q, k, v, _ = make_inputs(B, 1, 32, 8, 128, [L] * B, torch.bfloat16, 'cuda', nan_tail=False)
    kk, vv, bt = to_paged(k, v, [L] * B, 16) if paged else (k, v, None)
    p = splitkv.plan(torch.full((B,), L, dtype=torch.int32, device='cuda'), 32, 8, 128, num_sms=132,
                     backend='cutlass', paged=paged)
    assert p.work is not None, p.describe()
    ragged = ([L - 96, 0, 17, 2500], [1, 2, 3, L]) if B == 4 else ([0, L - 5], [1, L])
    for lens in ([L] * B, *ragged):
        sl = torch.tensor(lens, dtype=torch.int32, device='cuda')
        p.refresh(sl)
        o, lse = splitkv.decode(q, kk, vv, sl, block_table=bt, plan=p, return_lse=True)
        # the reference on the CPU: racecheck flags cuBLAS's own kernels (nvjet_*) on the GPU
        cpu = [t.cpu() if t is not None else None for t in (o, lse, q, kk, vv, sl, bt, k, v)]
        assert_close_to_reference(*cpu[:6], block_table=cpu[6], lowp_k=cpu[7], lowp_v=cpu[8])
        n += 1
print('ok', n == 6, n, 'work-list calls')
"""


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_work_list_grid_is_sanitizer_clean(tool):
    """The CuTe split kernel reading a work list (two D 128 bf16 variants: quick to compile, unlike
    test_compute_sanitizer_is_clean's every variant, whose forced plans take the (split, request) grid)."""
    _skip_without_sanitizer()
    _assert_sanitizer_clean(tool, _WORK_LIST_SNIPPET, timeout=560)


@needs_dsl
def test_fill_disk_cache_compiles_only_what_is_missing(tmp_path, monkeypatch):
    """The parallel fill writes each config's disk entry (as a first decode would) and skips those present."""
    from splitkv.backends.cutlass import cache

    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    cfgs = configs("merge")[:2]
    assert fill_disk_cache(cfgs, jobs=2) == 2
    assert all((tmp_path / (cache.cache_key(c.name, ARCH) + ".mlirbc")).exists() for c in cfgs)
    assert fill_disk_cache(cfgs, jobs=2) == 0
    monkeypatch.setenv("SPLITKV_CACHE_DIR", "off")
    assert fill_disk_cache(configs("merge"), jobs=2) == 0
