"""Probe (GPU): one layer's attention of Engine(share_prefix=True)'s decode step against the plain
step's, in parts, under CUDA-graph replay (the whole-model probe, probe_share_prefix.py, measured
the shared step 3.2 ms slower on an H100, NOTES #74; this says which part costs it).

The shapes are the engine's at n samples of one ctx-token prompt: a batch bucket of n rows, page 64,
the table width of hf_graph.width_for, every row holding the prompt's pages then one page of its
own (ctx + 6 keys: the probe's first timed steps), GQA 32/8, D 128, bf16, the plans made as
hf._step_plan makes them (max_seqlen = the table's capacity, backend auto; plan() schedules the
splits once, for these lengths).
Rows, µs per call (graph replay, median):
  plain         decode over every row's keys, the rows' prompt pages shared (forked: what the engine has)
  plain-copies  the same with each row's prompt in pages of its own (n x the bytes from HBM: no L2 reuse)
  suffix        the shared step's decode of each row's own keys
  prefix        cascade.group_prefix_decode: each group's prompt pages once, the members in the heads
  prefix-gathered  the same with its gathers made once (cascade.prefix_gather: once per step in the engine)
  prefix-unfused  the same, the partials merged by the merge kernel instead of the split kernel's last CTA
  prefix-triton   the same on the Triton backend
  merge         merge_states of the two
  shared        suffix + prefix + merge (what the shared step runs per layer)
Prediction (bytes at ~3 TB/s on an H100): plain-copies n x ctx x 4 KB (8K, n=16: 537 MB, ~180 us);
prefix ctx x 4 KB (34 MB, ~11 us); suffix and merge a few us each. plain < plain-copies would mean
the forked pages come from the L2.
--profile ROWS lists those rows' CUDA kernels (eager calls: where a row's time goes, kernel by kernel).
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_share_prefix_attn.py [--cases 8192:16,...]
"""
import argparse

import torch

from splitkv.api import decode
from splitkv.bench.timing import time_graph
from splitkv.cache import table_window
from splitkv.cascade import group_prefix_decode, prefix_gather
from splitkv.heuristics import tile_override
from splitkv.integrations.hf_graph import bucket_for, members_for, width_for
from splitkv.merge import merge_states
from splitkv.plan import plan as make_plan

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="8192:16,32768:16", help="prompt tokens:samples, comma-separated")
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--profile", default="", help="comma-separated rows whose CUDA kernels to list (torch.profiler, "
                "10 eager calls each, kernel totals / 10), e.g. prefix,prefix-triton")
a = ap.parse_args()
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run, no timing
dt = torch.bfloat16
Hq, Hkv, D, PS, EXTRA = 32, 8, 128, 64, 6
print(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (no timing)", flush=True)


def plan_for(lens, heads, bound, backend="auto"):
    return make_plan(lens, heads, Hkv, D, max_seqlen=bound, paged=True, dtype=dt, kv_dtype=dt, backend=backend)


def describe(p):
    return f"{p.backend} {p.tile} max_splits {p.max_splits} fuse {p.fuse}"


def profile_row(name, fn, calls=10):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"  {name} kernels (us per call, eager):")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]:
        print(f"    {e.device_time_total / calls:8.1f}  x{e.count // calls}  {e.key[:90]}")


@torch.no_grad()
def case(ctx, n):
    prompt_pages, B = ctx // PS, bucket_for(n)
    pages_per_row = prompt_pages + 1
    W = width_for(pages_per_row, 10**9)
    bound = W * PS
    num_pages = prompt_pages * (n + 1) + n + 1
    kp = torch.randn(num_pages, PS, Hkv, D, device=dev, dtype=dt)
    vp = torch.randn_like(kp)
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=dt)
    shared_ids = torch.arange(prompt_pages, dtype=torch.int32)
    own = prompt_pages * (n + 1) + torch.arange(n, dtype=torch.int32)
    forked = torch.zeros(B, W, dtype=torch.int32)
    copies = torch.zeros(B, W, dtype=torch.int32)
    for r in range(n):
        forked[r, :prompt_pages] = shared_ids
        copies[r, :prompt_pages] = prompt_pages * (r + 1) + shared_ids
        forked[r, prompt_pages] = copies[r, prompt_pages] = own[r]
    forked, copies = forked.to(dev), copies.to(dev)
    lens = torch.zeros(B, dtype=torch.int32, device=dev)
    lens[:n] = ctx + EXTRA
    m = members_for(n)
    members = torch.full((B, m), B, dtype=torch.long, device=dev)
    members[0, :n] = torch.arange(n, device=dev)
    row_pages = torch.zeros(B, dtype=torch.int32, device=dev)
    row_pages[:n] = prompt_pages
    group_pages = torch.zeros(B, dtype=torch.int32, device=dev)
    group_pages[0] = prompt_pages
    suffix_table = table_window(forked, row_pages, W)
    suffix_lens, prefix_lens = lens - row_pages * PS, group_pages * PS
    p_plain, p_copies = plan_for(lens, Hq, bound), plan_for(lens, Hq, bound)
    p_s, p_p = plan_for(suffix_lens, Hq, bound), plan_for(prefix_lens, Hq * m, bound)
    with tile_override(fused_merge=False):
        p_pu = plan_for(prefix_lens, Hq * m, bound)
    p_pt = plan_for(prefix_lens, Hq * m, bound, backend="triton")
    print(f"ctx {ctx} n {n}: bucket {B}, width {W} pages, members/group {m}\n"
          f"  plain plan:  {describe(p_plain)}\n  suffix plan: {describe(p_s)}\n  prefix plan: {describe(p_p)}\n"
          f"  prefix-unfused plan: {describe(p_pu)}\n  prefix-triton plan: {describe(p_pt)}")
    fns = {
        "plain": lambda: decode(q, kp, vp, lens, block_table=forked, plan=p_plain),
        "plain-copies": lambda: decode(q, kp, vp, lens, block_table=copies, plan=p_copies),
        "suffix": lambda: decode(q, kp, vp, suffix_lens, block_table=suffix_table, plan=p_s, return_lse=True),
        "prefix": lambda: group_prefix_decode(q, kp, vp, forked, members, prefix_lens, plan=p_p),
        "prefix-gathered": lambda: group_prefix_decode(q, kp, vp, forked, members, prefix_lens, plan=p_p, gather=gat),
        "prefix-unfused": lambda: group_prefix_decode(q, kp, vp, forked, members, prefix_lens, plan=p_pu),
        "prefix-triton": lambda: group_prefix_decode(q, kp, vp, forked, members, prefix_lens, plan=p_pt),
        "merge": lambda: merge_states(o_s, lse_s, o_p, lse_p),
        "shared": lambda: merge_states(*fns["suffix"](), *fns["prefix"]()),
    }
    gat = prefix_gather(members, B, 1, Hq, Hkv)
    (o_s, lse_s), (o_p, lse_p) = fns["suffix"](), fns["prefix"]()  # the merge row's inputs
    ref = fns["plain"]().float()
    err = (fns["shared"]()[0].float() - ref)[:n].abs().max().item()
    if dev.type == "cuda":
        for name, f in fns.items():
            print(f"  {name:13s} {time_graph([f], dev, a.reps)[0]:9.1f} us", flush=True)
    print(f"  shared vs plain: max |diff| {err:.4f} over the {n} rows", flush=True)
    if dev.type == "cuda":
        for name in filter(None, a.profile.split(",")):
            profile_row(name, fns[name])
        for name in ("prefix-unfused", "prefix-triton"):
            d = (fns[name]()[0].float() - o_p.float())[:n].abs().max().item()
            print(f"  {name} vs prefix: max |diff| {d:.4f}", flush=True)


for c in a.cases.split(","):
    case(*map(int, c.split(":")))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
