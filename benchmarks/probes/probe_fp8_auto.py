"""Probe (GPU): which backend `auto` should take for fp8 caches beyond the fp8 suite's six shapes.
With the CuTe fp8 tile at 128 keys x 4 stages (heuristics.FP8_TILE, one CTA per SM) the suite's
contiguous rows ran ahead of Triton's fp8 path on the H100 (B=1 GQA 32/8 128K 97.8 vs 101.0 us,
B=16 GQA 32K 358.9 vs 370.6, B=1 MHA 32K 97.8 vs 102.8) and its paged rows level or behind
(B=1 GQA 128K 103.0 vs 102.3, B=16 GQA 32K 382.6 vs 371.7, B=1 MHA 32K 99.8 vs 101.8).

Graph replay of each backend's own graph-safe plan, rounds interleaved (min of 3), e4m3 cache,
bf16 q, per-tensor scales. Prediction: CuTe 2-5% ahead on contiguous split plans; unknown on full
batches (one CTA per SM, several waves) and short contexts, where the plan differs most.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_fp8_auto.py
"""
import torch

import splitkv
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape, spread_lengths
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
F8 = "fp8_e4m3"
SHAPES = [
    make_shape(1, 4096, 32, 8, kv_dtype=F8),
    make_shape(4, 4096, 32, 8, kv_dtype=F8),
    make_shape(1, 32768, 64, 8, kv_dtype=F8),
    make_shape(1, 32768, 32, 8, q_len=4, kv_dtype=F8),
    make_shape(8, 131072, 32, 8, kv_dtype=F8),
    make_shape(16, 32768, 32, 32, kv_dtype=F8),
    make_shape(64, 32768, 32, 8, kv_dtype=F8),
    make_shape(16, spread_lengths(16, 1024, 131072), 32, 8, kv_dtype=F8),
    make_shape(1, 32768, 32, 8, 256, kv_dtype=F8),
    make_shape(16, 32768, 32, 32, page_size=16, kv_dtype=F8),
    make_shape(8, 131072, 32, 8, page_size=16, kv_dtype=F8),
    make_shape(1, 4096, 32, 8, page_size=16, kv_dtype=F8),
]

for shape in SHAPES:
    case = build_case(shape, torch.bfloat16, dev, 0)
    sets = case.rotation(case.rotation_count())
    s, kw = shape, case.call_kwargs
    fns, plans = {}, {}
    for backend in ("triton", "cutlass"):
        p = splitkv.plan(case.base.cache_seqlens, s.num_q_heads, s.num_kv_heads, s.head_dim, q_len=s.q_len,
                         max_seqlen=s.max_seqlen, backend=backend, paged=s.paged,
                         kv_dtype=case.base.k_cache.dtype, **kw)
        p.refresh(case.base.cache_seqlens)
        plans[backend] = p
        fns[backend] = [lambda ts=ts, p=p, b=backend: splitkv.decode(
            ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table, causal=s.causal,
            plan=p, backend=b, **kw) for ts in sets]
    best = {b: float("inf") for b in fns}
    for _ in range(3):
        for b, f in fns.items():
            best[b] = min(best[b], time_graph(f, dev, 10)[0])
    gb = shape.bytes(2) / 1e9
    t, c = best["triton"], best["cutlass"]
    print(f"{shape.name:45s} triton {t:8.1f}  cutlass {c:8.1f}  cutlass/triton {c / t:5.3f}  "
          f"({gb:.2f} GB; cutlass {plans['cutlass'].max_splits} splits, triton {plans['triton'].max_splits})",
          flush=True)
    case.release()
    del case, sets, fns, plans
    torch.cuda.empty_cache()
