"""Probe: B=1 GQA 32/8 32K under graph replay, decode(q, k, v, lens) with no plan against a reused plan.

Prints both plans (describe()), three graph timings of each, and the kernels of one replay of each
graph (torch.profiler): which launches a captured plain call adds.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_noplan_graph.py
"""
import collections

import torch

import splitkv
from splitkv import execute
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import graph_calls, time_graph

dev = torch.device("cuda")
for paged in (None, 16):
    case = build_case(make_shape(1, 32768, 32, 8, page_size=paged), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    p = splitkv.plan(sets[0].cache_seqlens, 32, 8, 128, max_seqlen=32768, paged=paged is not None)
    runs = {
        "noplan": [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, block_table=t.block_table)
                   for t in sets],
        "plan": [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, block_table=t.block_table,
                                            plan=p) for t in sets],
    }
    print(f"paged={paged} rotation={len(sets)} calls/graph={graph_calls(len(sets))}")
    for name, fns in runs.items():
        us = [time_graph(fns, dev, 20)[0] for _ in range(3)]
        print(f"  {name}: {' '.join(f'{u:.1f}' for u in us)} us/call")
    own = [v for k, v in execute._PLANS.items()]
    print("  plan   :", p.describe())
    for q in own:
        print("  noplan :", q.describe())
    for name, fns in runs.items():  # one replay under the profiler
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for i in range(graph_calls(len(fns))):
                fns[i % len(fns)]()
        g.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        kern = collections.Counter()
        total = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kern[e.name[:60]] += 1
                total[e.name[:60]] += e.device_time
        print(f"  {name} replay kernels:", {k: (v, round(total[k] / v, 1)) for k, v in kern.items()})
        del g
    case.release()
    splitkv.clear_plans()
