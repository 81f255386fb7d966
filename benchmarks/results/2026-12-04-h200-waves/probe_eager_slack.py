"""Probe: is the bench's eager column (timing.time_eager: a 256 MB L2 flush, then events around
one call) host-bound on small shapes? probe_noplan_eager.txt found identical kernels with and
without a plan (one split kernel per call, 10.6-10.8 us) but eager times 16.4 vs 19.8 us.

Per shape and mode (plan reused / no plan), interleaved twice, no profiler in this process:
  flush  = GPU time of the flush alone (events around cache.zero_());
  eager  = time_eager's median (start event after the flush, end after the call);
  host   = wall time per iteration of time_eager's loop body (zero_, record, call, record), host only;
  call   = wall time of the call alone in that loop.
If host per iteration exceeds flush + eager, the GPU waits for the host and eager includes host time.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-waves/probe_eager_slack.py
"""
import statistics
import time

import torch

import splitkv
from splitkv.bench import timing
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape

dev = torch.device("cuda")
cache = timing._flush_buffer(dev)


def loop(fn, n=300):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    fl0 = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    call_wall = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fl0[i].record()
        cache.zero_()
        starts[i].record()
        c0 = time.perf_counter()
        fn()
        call_wall.append(time.perf_counter() - c0)
        ends[i].record()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    flush = statistics.median(a.elapsed_time(b) for a, b in zip(fl0, starts))
    eager = statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))
    return flush * 1e3, eager * 1e3, host * 1e6, statistics.median(call_wall) * 1e6


for B, L, Hq, Hkv in ((1, 4096, 64, 8), (1, 4096, 32, 8), (1, 32768, 32, 8)):
    case = build_case(make_shape(B, L, Hq, Hkv), torch.bfloat16, "cuda")
    ts = case.base
    p = splitkv.plan(ts.cache_seqlens, Hq, Hkv, 128)
    modes = {"plan": lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, plan=p),
             "no plan": lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens)}
    for fn in modes.values():
        fn()
    for rep in range(2):
        for name, fn in modes.items():
            f, e, h, c = loop(fn)
            print(f"B={B} L={L} {Hq}/{Hkv} {name:8s} try {rep}: flush {f:.1f} us | eager {e:.2f} us | host/iter "
                  f"{h:.1f} us | call wall {c:.1f} us | time_eager {timing.time_eager(fn, dev, 30)[0]:.2f}", flush=True)
    case.release()
