"""Probe (GPU): decode speed of Engine(share_prefix=True) against the plain engine, n samples of
one prompt (README: share_prefix is off by default because it measured slower).

Model: random Llama-3-8B shape (32 layers, hidden 4096, Hq 32 / Hkv 8, D 128, bf16). Each case
adds one request of `n` samples (seeded) on a `ctx`-token prompt to a fresh
engine, steps until every sample has emitted WARM tokens (prefill, graph captures), then times
TIMED steps (each emits n tokens; step() returns tokens to the host, so host time is included).
Greedy by default (--temperature): the n samples are then alike, and the two engines' tokens match
unless rounding flips a near-tie of the random model; sampled tokens would part at the first step.
Prediction (bytes per step at the card's bandwidth): the plain step reads ~15 GB of weights plus
n x ctx x 128 KB of K/V, the shared step the weights plus ctx x 128 KB once, so at n=16 the
shared step is ~2x faster at 8K and ~4x at 32K. Measured on an H100 at 8K: 0.84x (NOTES #74); the
samples' forked prompt pages (33.5 MB of K/V per layer at 8K) may be read from the L2, not HBM.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_share_prefix.py
(--tiny: a CPU smoke run, hf_step's tiny model in float32 and one 300-token prompt, n=4; there
share_prefix falls back to the plain step, so it checks the probe, not the feature; --profile: the
CUDA kernels of 4 steps of each engine, by total time, from torch.profiler; --cases 8192:16,...)
"""
import argparse
import logging
import time

import torch

from splitkv.bench import hf_step
from splitkv.integrations.engine import Engine

WARM, TIMED = 6, 24
ap = argparse.ArgumentParser()
hf_step.add_model_args(ap, dtypes=("bfloat16", "float16", "float32"))
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--profile", action="store_true")
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--cases", default="8192:16,32768:16", help="prompt tokens:samples, comma-separated")
a = ap.parse_args()
CASES = ((300, 4),) if a.tiny else tuple(tuple(map(int, c.split(":"))) for c in a.cases.split(","))
if a.profile:  # the graph captures, and any eager fallback, with their keys
    logging.basicConfig()
    logging.getLogger("splitkv").setLevel(logging.INFO)
if a.tiny:
    vars(a).update(hf_step.TINY, dtype="float32")
device = torch.device("cpu" if a.tiny else "cuda")
a.contexts, a.steps, a.warmup = [c for c, _ in CASES], TIMED, WARM + 4  # build_model's position range
model = hf_step.build_model(a, device)
print(torch.cuda.get_device_name() if device.type == "cuda" else "cpu", flush=True)


@torch.no_grad()
def tokens_per_s(prompt, n, share):
    eng = Engine(model, num_pages=1100, page_size=64, share_prefix=share)
    rids = eng.add_request(prompt, WARM + TIMED + 8, eos_token_id=None, temperature=a.temperature, seed=0, n=n)
    got = {r: [] for r in rids}
    while min(len(v) for v in got.values()) < WARM:
        for rid, tok, _ in eng.step():
            got[rid].append(tok)
    hf_step._sync(device)
    t0, emitted = time.perf_counter(), 0
    for _ in range(TIMED):
        out = eng.step()
        emitted += len(out)
        for rid, tok, _ in out:
            got[rid].append(tok)
    hf_step._sync(device)
    dt = time.perf_counter() - t0
    if a.profile and device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                eng.step()
            hf_step._sync(device)
        print(f"share_prefix={share}: 4 steps\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    eng.run()
    del eng
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return emitted / dt, dt / TIMED * 1e3, got


for ctx, n in CASES:
    prompt = torch.randint(3, a.vocab, (ctx,), generator=torch.Generator().manual_seed(ctx))
    plain, plain_ms, got_p = tokens_per_s(prompt, n, False)
    shared, shared_ms, got_s = tokens_per_s(prompt, n, True)
    pairs = [(got_p[rp], got_s[rs]) for rp, rs in zip(got_p, got_s)]
    same = sum(x == y for tp, ts in pairs for x, y in zip(tp, ts))
    total = sum(min(len(tp), len(ts)) for tp, ts in pairs)
    print(f"ctx {ctx:6d} n {n:2d}: plain {plain:7.1f} tok/s ({plain_ms:6.2f} ms/step), shared {shared:7.1f} tok/s "
          f"({shared_ms:6.2f} ms/step), {shared / plain:.2f}x; tokens equal {same}/{total}", flush=True)
