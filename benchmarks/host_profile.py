"""cProfile of the eager decode host path on a GPU: where the microseconds of one call go.

    python benchmarks/host_profile.py [--backends triton,cutlass] [--top 18]

B=1 GQA 32/8 4K bf16: host us/call (300 calls, no sync) with a plan and without, then the top
functions by own time per call for each. The GPU work is tiny, so the host is what is measured.
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

import splitkv


def per_call_us(fn, n=300):
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
    ap.add_argument("--backends", default="triton,cutlass")
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    B, Hq, Hkv, D, L = 1, 32, 8, 128, 4096
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    for be in a.backends.split(","):
        p = splitkv.plan(sl, Hq, Hkv, D, backend=be)
        calls = {"plan": lambda: splitkv.decode(q, k, v, sl, plan=p, backend=be),
                 "noplan": lambda: splitkv.decode(q, k, v, sl, backend=be)}
        for name, f in calls.items():
            print(f"HOST {be} {name} {per_call_us(f):.1f} us/call", flush=True)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                f()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
            lines = [ln for ln in s.getvalue().splitlines() if ln.strip() and ln.lstrip()[0].isdigit()]
            print("\n".join("   " + ln for ln in lines), flush=True)
    sd = lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                  v.transpose(1, 2), enable_gqa=True)
    print(f"HOST sdpa {per_call_us(sd):.1f} us/call")


if __name__ == "__main__":
    main()
