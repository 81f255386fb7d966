"""Probe: why `decode(q, k, v, lens)` without a plan runs ~0.5-0.7 us slower eagerly than with a
reused plan at B=1 GQA 4K (headline call 5, 200 repetitions: 64/8 18.2 vs 17.5 us, 32/8 15.9 vs
15.4), although both launch the same kernels from the same plan shape.

1. The kernels each mode launches over 3 eager calls (torch profiler, CUDA kernel names and times).
2. Eager timing (L2 flushed, 400 repetitions), modes interleaved twice: plan reused, no plan, and
   no plan with the lengths tensor rebuilt every call (a schedule per call).

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-waves/probe_noplan_eager.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import splitkv
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_eager

dev = torch.device("cuda")
for B, L, Hq, Hkv in ((1, 4096, 64, 8), (1, 4096, 32, 8)):
    case = build_case(make_shape(B, L, Hq, Hkv), torch.bfloat16, "cuda")
    ts = case.base
    p = splitkv.plan(ts.cache_seqlens, Hq, Hkv, 128)
    modes = {
        "plan": lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, plan=p),
        "no plan": lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens),
        "no plan, new lens": lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens.clone()),
    }
    for name, fn in modes.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        ks = [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"B={B} {Hq}/{Hkv} {name}: {len(ks)} kernels in 3 calls: "
              + "; ".join(f"{n[:60]} {t:.1f}" for n, t in ks), flush=True)
    res = {k: [] for k in modes}
    for _ in range(2):
        for name, fn in modes.items():
            res[name].append(time_eager(fn, dev, 400)[0])
    print(f"B={B} {Hq}/{Hkv} eager us: " + " | ".join(f"{k} {min(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})"
                                                   for k, v in res.items()), flush=True)
    case.release()
