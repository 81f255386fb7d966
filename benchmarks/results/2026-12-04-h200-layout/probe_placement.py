"""Probe: does where a plan's buffers land move B=1 GQA 32/8 32K graph replay between ~37 and ~41 us?

(a) one case (q, K, V fixed), the plan made again 8 times, each after a pad allocation of another
size (its workspace, counters and split table move); (b) the case made again 4 times, one plan.
Graph replay with the plan (splitkv.bench.timing.time_graph), two timings each, and the low bits
of each buffer's address.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_placement.py
"""
import torch

import splitkv
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
shape = make_shape(1, 32768, 32, 8)


def fns_of(sets, p):
    return [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p) for t in sets]


def addr(t):
    return f"{t.data_ptr() % (1 << 21):#x}" if t is not None else "-"


case = build_case(shape, torch.bfloat16, "cuda")
sets = case.rotation(case.rotation_count())
pads = []
for trial in range(8):
    pads.append(torch.empty(trial * 3 * 4096 + 512 * trial, dtype=torch.uint8, device=dev))
    p = splitkv.plan(sets[0].cache_seqlens, 32, 8, 128, max_seqlen=32768)
    us = [time_graph(fns_of(sets, p), dev, 20)[0] for _ in range(2)]
    print(f"(a) plan {trial}: {us[0]:.1f} {us[1]:.1f} us | o_part {addr(p.o_part)} lse_part {addr(p.lse_part)} "
          f"counters {addr(p.counters)} sched {addr(p.sched)} lse_scratch {addr(p.lse_scratch)}", flush=True)
p = splitkv.plan(sets[0].cache_seqlens, 32, 8, 128, max_seqlen=32768)
case.release()
del case, sets
for trial in range(4):
    pads.append(torch.empty(7 * 4096 * (trial + 1), dtype=torch.uint8, device=dev))
    case = build_case(shape, torch.bfloat16, "cuda", seed=trial)
    sets = case.rotation(case.rotation_count())
    us = [time_graph(fns_of(sets, p), dev, 20)[0] for _ in range(2)]
    print(f"(b) case {trial}: {us[0]:.1f} {us[1]:.1f} us | q {addr(sets[0].q)} k {addr(sets[0].k_cache)} "
          f"v {addr(sets[0].v_cache)} lens {addr(sets[0].cache_seqlens)}", flush=True)
    case.release()
    del case, sets
