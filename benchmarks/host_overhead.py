"""Host (CPU) time per decode call and per stage, on a GPU: what eager small-shape latency is made of.

    python benchmarks/host_overhead.py [--out DIR]

Each stage runs N times back to back without synchronising; wall time / N is its host cost (the
GPU work is tiny, B=1 GQA 32/8 4K, so the host is the bottleneck and this is what we measure).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import splitkv
from splitkv import backends, validate
from splitkv.backends.triton import launch

N = 300


def per_call_us(fn, n=N):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    B, Hq, Hkv, D, L = 1, 32, 8, 128, 4096
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    p = splitkv.plan(sl, Hq, Hkv, D)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, 1, device="cuda")
    op, lp = p.partials()
    scale = 1 / math.sqrt(D)
    res = {
        "decode(plan=p, out=out)": per_call_us(lambda: splitkv.decode(q, k, v, sl, plan=p, out=out)),
        "decode(plan=p)": per_call_us(lambda: splitkv.decode(q, k, v, sl, plan=p)),
        "decode() planning each call": per_call_us(lambda: splitkv.decode(q, k, v, sl)),
        "validate": per_call_us(lambda: validate.check_decode_inputs(q, k, v, sl, None, None, None, "auto")),
        "resolve backend": per_call_us(lambda: backends.resolve("auto", q.device)),
        "plan.partials()": per_call_us(lambda: p.partials()),
        "torch.empty x2": per_call_us(lambda: (torch.empty_like(q), torch.empty(B, Hq, 1, device="cuda"))),
        "triton run (split+combine)": per_call_us(lambda: launch.run(q, k, v, sl, None, p, op, lp, out, lse, scale, True)),
        "triton combine only": per_call_us(lambda: launch.combine(op, lp, p.num_splits, out, lse, skip_single=True)),
        "sdpa cudnn (peer)": per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)),
    }
    for name, us in res.items():
        print(f"HOST {name:32s} {us:8.1f} us/call", flush=True)
    if a.out:
        with open(f"{a.out}/host_overhead.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
