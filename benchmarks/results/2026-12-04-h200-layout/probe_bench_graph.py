"""Probe: the bench's own rows of B=1 GQA 32/8 32K (runner.run: eager, then graph), with each timed
graph's calls captured again and replayed once under torch.profiler: kernels per replay and their
mean GPU time, and each plan's split counts afterwards; no plan vs a plan.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_bench_graph.py
"""
import collections

import torch

from splitkv import execute
from splitkv.bench import registry, runner, shapes
from splitkv.bench.timing import graph_calls

real = runner.time_graph


def profiled(fns, device, reps):
    res = real(fns, device, reps)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
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
    n, t = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n[e.name[:50]] += 1
            t[e.name[:50]] += e.device_time
    print(f"  timed {res[0]:.1f} us/call; one replay: {({k: (v, round(t[k] / v, 1)) for k, v in n.items()})}")
    for key, p in execute._PLANS.items():
        print("   own plan", key[1][0] if isinstance(key[1][0], int) else "", p.num_splits.tolist(),
              p.chunk_lens.tolist())
    return res


runner.time_graph = profiled
shape = [s for s in shapes.suite("headline") if s.name == "b1-l32k-h32x8-d128"]
for name in ("splitkv-auto-noplan", "splitkv-auto"):
    print(name)
    cfg = runner.Config(device=torch.device("cuda"), suite="headline", dtypes=["bf16"], reps=20, host=False)
    rows = runner.run(shape, [registry.make(name)], cfg)
    print(f"  row: eager {rows[0]['eager_us']:.1f} graph {rows[0]['graph_us']:.1f}")
