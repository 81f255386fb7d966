"""CPU: the torch backend's fast path vs its spec path (the backend before the fast path) vs SDPA.

    python benchmarks/cpu_torch_backend.py [--reps N] [--no-model] [--out FILE.json]

Decode shapes: the CPU demo's (splitkv/demo.py _cases: B=1, Hq 32 / Hkv 8, D 128, 4K and 16K
keys), in fp32 and bf16, plus the 16K bf16 case over a paged cache (page 16, shuffled pages: the
fast path gathers the used pages). Columns, median µs per call of `splitkv.decode(q, k, v, lens,
backend="torch")` with no plan (what a new user calls), timed in interleaved rounds:
  spec  - the spec path (vectorised split/merge, fp32; what every call ran before the fast path),
          forced by patching torch_backend.spec_wanted;
  fast  - what decode runs now;
  sdpa  - torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) on K/V laid out
          [B, Hkv, L, D] contiguous once outside the timing (as the bench's SDPA provider does);
  sdpa view - the same on strided views of splitkv's [B, L, Hkv, D] cache (no copy).
Every splitkv result is checked against splitkv.reference (fp64) with the test suite's rule.
Then the demo's model section (splitkv/demo_llama.py, CPU: 2 layers, hidden 256, Hq 4 / Hkv 2, D 64,
fp32, 512-token prompt, 16 greedy tokens): splitkv's generate with the fast path, with the spec
path, and transformers' generate, each the median of --reps runs (interleaved), tokens compared.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

import splitkv  # noqa: E402
from splitkv.backends import torch_backend  # noqa: E402
from splitkv.reference import decode_lowp, decode_reference  # noqa: E402


class spec_path:  # noqa: N801 - a context manager read as a phrase
    """Within the block the torch backend runs its spec path for every call."""

    def __enter__(self):
        self.old = torch_backend.spec_wanted
        torch_backend.spec_wanted = lambda plan: True

    def __exit__(self, *exc):
        torch_backend.spec_wanted = self.old


def median_us(fns: dict, reps: int) -> dict:
    """Median µs per call of each fn, timed in interleaved rounds (one call of each per round), so
    a shared, noisy CPU slows them alike. A fn may be a (fn, context manager factory) pair."""
    def call(f):
        if isinstance(f, tuple):
            with f[1]():
                return f[0]()
        return f()

    ts = {name: [] for name in fns}
    for f in fns.values():
        call(f)  # warm-up (plan, allocations)
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            call(f)
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in ts.items()}


def _paged(k, v, L, ps, seed=0):
    n = -(-L // ps)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    kp = torch.empty(n, ps, *k.shape[2:], dtype=k.dtype)
    vp = torch.empty_like(kp)
    kp[perm] = k[0, :n * ps].unflatten(0, (n, ps))
    vp[perm] = v[0, :n * ps].unflatten(0, (n, ps))
    return kp, vp, perm.int()[None]


def decode_rows(reps: int) -> list[dict]:
    rows = []
    B, Hq, Hkv, D = 1, 32, 8, 128
    for dtype in (torch.float32, torch.bfloat16):
        for L, page in ((4096, None), (16384, None)) + (((16384, 16),) if dtype == torch.bfloat16 else ()):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(B, 1, Hq, D, generator=g).to(dtype)
            k = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
            v = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
            sl = torch.tensor([L], dtype=torch.int32)
            kc, vc, bt = (k, v, None) if page is None else _paged(k, v, L, page)

            def ours():
                return splitkv.decode(q, kc, vc, sl, block_table=bt, backend="torch")

            # the suite's rule: fp32 within 1e-4, low precision within 2x PyTorch's own error + 1e-3
            ro, _ = decode_reference(q, k, v, sl)
            bound = 1e-4 if dtype == torch.float32 else 2 * (decode_lowp(q, k, v, sl).double() - ro).abs().max() + 1e-3
            with spec_path():
                err_spec = float((ours().double() - ro).abs().max())
            err_fast = float((ours().double() - ro).abs().max())
            qt, kt, vt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            fns = {"spec": (ours, spec_path), "fast": ours}
            if page is None:
                fns["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                fns["view"] = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2), enable_gqa=True)
            t = median_us(fns, reps)
            t_spec, t_fast, t_sdpa, t_view = t["spec"], t["fast"], t.get("sdpa"), t.get("view")
            rows.append(dict(dtype=str(dtype).replace("torch.", ""), B=B, Hq=Hq, Hkv=Hkv, D=D, keys=L,
                             cache="contiguous" if page is None else f"paged{page} shuffled",
                             spec_us=t_spec, fast_us=t_fast, sdpa_us=t_sdpa, sdpa_view_us=t_view,
                             err_spec=err_spec, err_fast=err_fast,
                             bound=float(bound), ok=max(err_spec, err_fast) <= bound))
            r = rows[-1]
            sd, ratio = ("—", "—") if page else (f"{t_sdpa:9.0f} {t_view:10.0f}", f"{t_sdpa / t_fast:7.2f}x")
            print(f"{r['dtype']:>8} {L:6d} {r['cache']:>17} {t_spec:10.0f} {t_fast:9.0f} {sd:>20} "
                  f"{t_spec / t_fast:8.1f}x {ratio:>9}  "
                  f"{'ok' if r['ok'] else 'FAIL'} ({err_fast:.1e} / {err_spec:.1e} <= {float(bound):.1e})",
                  flush=True)
    return rows


def model_rows(reps: int) -> dict | None:
    try:
        from splitkv.demo_llama import _model
        from splitkv.integrations import hf
    except ImportError as exc:
        print(f"model section skipped: {exc}")
        return None
    dev = torch.device("cpu")
    prompt, new = 512, 16
    model = _model(dev, 2, 256, 4, 2, 64, 256, torch.float32, prompt + new + 16)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    times = {"fast": [], "spec": [], "transformers": []}
    toks = {}
    with torch.no_grad():
        for i in range(reps + 1):  # the first round warms up
            for name in times:
                t0 = time.perf_counter()
                if name == "transformers":
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
                elif name == "spec":
                    with spec_path():
                        out = hf.generate(model, ids, new, eos_token_id=None)
                else:
                    out = hf.generate(model, ids, new, eos_token_id=None)
                if i:
                    times[name].append(time.perf_counter() - t0)
                toks[name] = out[0, prompt:]
    med = {k: statistics.median(v) for k, v in times.items()}
    same = {k: int((toks[k] == toks["transformers"]).sum()) for k in ("fast", "spec")}
    print(f"\nmodel section (demo_llama CPU model, {prompt}-token prompt, {new} tokens, median of {reps}):")
    print(f"  splitkv generate, fast path: {med['fast'] * 1e3:7.1f} ms  ({same['fast']}/{new} tokens = transformers)")
    print(f"  splitkv generate, spec path: {med['spec'] * 1e3:7.1f} ms  ({same['spec']}/{new} tokens = transformers)")
    print(f"  transformers generate:       {med['transformers'] * 1e3:7.1f} ms")
    return dict(median_s=med, tokens_equal=same, new_tokens=new, prompt=prompt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'dtype':>8} {'keys':>6} {'cache':>17} {'spec µs':>10} {'fast µs':>9} {'sdpa µs':>9} {'sdpa view':>10} "
          f"{'spec/fast':>7} {'sdpa/fast':>8}  check (|err| fast / spec <= bound)")
    rows = decode_rows(a.reps)
    model = None if a.no_model else model_rows(max(3, a.reps // 3))
    if a.out:
        a.out.write_text(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(),
                                         date=time.strftime("%Y-%m-%d"), decode=rows, model=model), indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
