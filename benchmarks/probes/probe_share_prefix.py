"""Probe (GPU): decode speed of Engine(share_prefix=True) against the plain engine, n samples of
one prompt (README: "Its speed has not been measured, so it is off by default").

Model: random Llama-3-8B shape (32 layers, hidden 4096, Hq 32 / Hkv 8, D 128, bf16). Each case
adds one request of `n` samples (temperature 0.8, seeded) on a `ctx`-token prompt to a fresh
engine, steps until every sample has emitted WARM tokens (prefill, graph captures), then times
TIMED steps (each emits n tokens; step() returns tokens to the host, so host time is included).
Prediction (bytes per step at the card's bandwidth): the plain step reads ~15 GB of weights plus
n x ctx x 128 KB of K/V, the shared step the weights plus ctx x 128 KB once, so at n=16 the
shared step is ~2x faster at 8K and ~4x at 32K.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_share_prefix.py
"""
import os
import time

import torch
import transformers

from splitkv.integrations.engine import Engine

WARM, TIMED = 6, 24
TINY = os.environ.get("PROBE_TINY") == "1"  # a CPU smoke run of the script: tiny model, short prompts
DEV = "cpu" if TINY else "cuda"
dims = (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1000) if TINY else
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=128256))
cfg = transformers.LlamaConfig(num_attention_heads=32 if not TINY else 4, num_key_value_heads=8 if not TINY else 2,
                               head_dim=128 if not TINY else 64, max_position_embeddings=40000, **dims)
torch.manual_seed(0)
with torch.device(DEV):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16 if not TINY else torch.float32).eval()
print(torch.cuda.get_device_name() if not TINY else "cpu", flush=True)


@torch.no_grad()
def tokens_per_s(prompt, n, share):
    eng = Engine(model, num_pages=1100, page_size=64, share_prefix=share)
    rids = eng.add_request(prompt, WARM + TIMED + 4, eos_token_id=None, temperature=0.8, seed=0, n=n)
    got = {r: [] for r in rids}
    while min(len(v) for v in got.values()) < WARM:
        for rid, tok, _ in eng.step():
            got[rid].append(tok)
    if not TINY:
        torch.cuda.synchronize()
    t0, emitted = time.perf_counter(), 0
    for _ in range(TIMED):
        out = eng.step()
        emitted += len(out)
        for rid, tok, _ in out:
            got[rid].append(tok)
    if not TINY:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    eng.run()
    del eng
    if not TINY:
        torch.cuda.empty_cache()
    return emitted / dt, dt / TIMED * 1e3, got


for ctx, n in ((8192, 16), (32768, 16)) if not TINY else ((300, 4),):
    prompt = torch.randint(3, cfg.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx))
    plain, plain_ms, a = tokens_per_s(prompt, n, False)
    shared, shared_ms, b = tokens_per_s(prompt, n, True)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(a[ra], b[rb]))
    total = sum(min(len(a[ra]), len(b[rb])) for ra, rb in zip(a, b))
    print(f"ctx {ctx:6d} n {n:2d}: plain {plain:7.1f} tok/s ({plain_ms:6.2f} ms/step), shared {shared:7.1f} tok/s "
          f"({shared_ms:6.2f} ms/step), {shared / plain:.2f}x; tokens equal {same}/{total}", flush=True)
