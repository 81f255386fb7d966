"""Decode step time of a Hugging Face Llama model: splitkv (eager and CUDA-graph steps, bf16 and
fp8 KV) against transformers' own configurations, next to the step's memory floor.

    python -m splitkv bench hf-step --out results/hf_step.json            # H200, Llama-3-8B shape
    python -m splitkv bench hf-step --out /tmp/hf.json --device cpu --tiny  # CPU smoke run

Model: randomly initialised from a config (nothing downloaded), by default the Llama-3-8B shape
(32 layers, hidden 4096, Hq 32 / Hkv 8, D 128, MLP 14336, vocab 128256, bf16). Each (batch,
context) cell times one decode step (one new token per request over `context` cached tokens),
feeding each step's greedy token back, `--steps` steps between two synchronisations after
`--warmup` untimed steps (graph capture, compilation). The context is synthetic — the cache is
filled with random (splitkv) or zero (transformers) K/V of that length instead of a prefill — so
every provider attends over exactly `context` keys per request and no prefill is paid.

Providers: splitkv-graph / splitkv-eager (splitkv.integrations.hf decode_step with / without
CUDA graphs), splitkv-graph-fp8 (an fp8 e4m3 paged cache), splitkv-graph-compile (graphs whose
norms and MLPs run through torch.compile: cuda_graph="compile"); transformers-sdpa-dynamic (the default:
sdpa + DynamicCache), transformers-static (StaticCache, eager) and transformers-static-compile
(StaticCache + torch.compile(mode="reduce-overhead", fullgraph=True): what generate(...,
cache_implementation="static") runs; compiled only for the cells in --compile-cells, since
each shape compiles anew for about a minute).
Memory floor: bytes a step must read (every weight but the embedding table, plus the KV cache) at
4.4 TB/s. Writes JSON (--out) and markdown (same path, .md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from splitkv import PagedKVCache
from splitkv.bench.report import _version, collect_meta
from splitkv.integrations import hf

FLOOR_TBPS = 4.4
PAGE = 64


def build_model(a, device):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers, num_attention_heads=a.hq,
        num_key_value_heads=a.hkv, head_dim=a.head_dim, vocab_size=a.vocab,
        max_position_embeddings=max(a.contexts) + a.steps + a.warmup + 64)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, a.dtype))
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step, tok, a, device):
    """ms per step: warm-up steps, then a.steps steps between two synchronisations."""
    for _ in range(a.warmup):
        tok = step(tok)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        tok = step(tok)
    _sync(device)
    return (time.perf_counter() - t0) / a.steps * 1e3


@torch.no_grad()
def run_splitkv(model, a, B, ctx, device, graphs, kv_dtype):
    layers = model.config.num_hidden_layers
    n_steps = a.warmup + a.steps
    pages = B * (-(-(ctx + n_steps) // PAGE)) + B
    cache = PagedKVCache(pages, PAGE, a.hkv, a.head_dim, num_layers=layers, dtype=kv_dtype, device=device)
    for layer in range(layers):  # random contents (fp8: drawn in bf16, then cast)
        for pool in (cache.k_pages(layer), cache.v_pages(layer)):
            pool.copy_(torch.randn(pool.shape, device=device, dtype=torch.bfloat16))
    ids = [cache.add_sequence() for _ in range(B)]
    cache.extend(ids, ctx)
    state = hf.DecodeState(cache, ids, torch.full((B,), ctx, dtype=torch.long, device=device), "auto")
    hf.use_graphs(model, state, graphs)
    tok = torch.zeros(B, dtype=torch.long, device=device)
    with hf.use_splitkv(model):
        _sync(device)
        t0 = time.perf_counter()  # the first step makes the plans and captures the graph (and compiles)
        tok = hf.decode_step(model, state, tok).argmax(-1)
        _sync(device)
        first_ms = (time.perf_counter() - t0) * 1e3
        ms = _time(lambda t: hf.decode_step(model, state, t).argmax(-1), tok, a, device)
        # kernels inside a graph replay are not reported to the profiler: the eager row is profiled
        # (same kernels; its host gaps are what the graph removes)
        prof = None
        if a.profile and not graphs and device.type == "cuda":
            prof = kernel_profile(lambda t: hf.decode_step(model, state, t).argmax(-1), tok)
    state.free()
    return ms, prof, first_ms


def kernel_profile(step, tok, n=3, top=12):
    """Where a step's GPU time goes: [kernel, µs per step, launches per step], largest first, and
    the total (torch.profiler over n steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            tok = step(tok)
        torch.cuda.synchronize()
    rows = [(e.key[:90], getattr(e, "device_time_total", 0) / n, e.count / n) for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    return {"total_us": sum(r[1] for r in rows), "kernels": rows[:top]}


@torch.no_grad()
def run_transformers(model, a, B, ctx, device, kind):
    import transformers

    layers = model.config.num_hidden_layers
    key = hf._cache_kwarg(model)
    if kind == "dynamic":
        cache = transformers.DynamicCache()
        zeros = torch.zeros(B, a.hkv, ctx, a.head_dim, device=device, dtype=getattr(torch, a.dtype))
        for layer in range(layers):
            cache.update(zeros.clone(), zeros.clone(), layer)
        del zeros
        fwd = model.forward
    else:
        cache = transformers.StaticCache(config=model.config, max_cache_len=ctx + a.warmup + a.steps + 1)
        if hasattr(cache, "early_initialization"):  # as generate does: allocated (and marked static) before compiling
            cache.early_initialization(B, a.hkv, a.head_dim, getattr(torch, a.dtype), device)
        fwd = model.forward
        if kind == "static-compile":
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    pos = [ctx]

    def step(tok):
        if kind == "static-compile":
            torch.compiler.cudagraph_mark_step_begin()
        p = torch.full((B, 1), pos[0], dtype=torch.long, device=device)
        kw = {key: cache, "position_ids": p, "use_cache": True, "logits_to_keep": 1}
        if kind != "dynamic":
            kw["cache_position"] = p[0]
        out = fwd(input_ids=tok[:, None], **kw)
        pos[0] += 1
        return out.logits[:, -1].argmax(-1)

    if kind != "dynamic":  # the static cache's first update allocates it: a step at position 0 .. ctx - 1 is free
        pos[0] = ctx
    ms = _time(step, torch.zeros(B, dtype=torch.long, device=device), a, device)
    return ms


def floor_ms(model, a, B, ctx) -> float:
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv = B * ctx * model.config.num_hidden_layers * 2 * a.hkv * a.head_dim * torch.finfo(getattr(torch, a.dtype)).bits // 8
    return (weights + kv) / (FLOOR_TBPS * 1e12) * 1e3


TINY = dict(layers=2, hq=4, hkv=2, head_dim=64, hidden=128, mlp=256, vocab=256)  # --tiny: the CPU smoke model


def add_model_args(ap, dtypes=("bfloat16", "float16")) -> None:
    """The random Llama's shape (default: Llama-3-8B) and dtype."""
    for name, val in (("--layers", 32), ("--hq", 32), ("--hkv", 8), ("--head-dim", 128), ("--hidden", 4096),
                      ("--mlp", 14336), ("--vocab", 128256)):
        ap.add_argument(name, type=int, default=val)
    ap.add_argument("--dtype", default="bfloat16", choices=dtypes)


def run_meta(device, command: str, argv) -> dict:
    """The results' meta: machine, versions, the command that ran."""
    meta = collect_meta(device, [], 0.0)
    meta.pop("sol_tbps")
    meta.pop("byte_model")
    meta.update(command=f"python -m splitkv bench {command} " + " ".join(sys.argv[1:] if argv is None else argv),
                transformers=_version("transformers"))
    return meta


def cells(a):
    out = []
    for B in a.batches:
        for ctx in a.contexts:
            kv_gb = B * ctx * a.layers * 2 * a.hkv * a.head_dim * 2 / 1e9
            if kv_gb <= a.max_kv_gb:
                out.append((B, ctx))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m splitkv bench hf-step",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", required=True, help="JSON path (markdown goes next to it as .md)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--max-kv-gb", type=float, default=40.0, help="skip cells whose bf16 KV exceeds this")
    ap.add_argument("--providers", default="splitkv-graph,splitkv-eager,splitkv-graph-fp8,transformers-sdpa-dynamic,"
                    "transformers-static,transformers-static-compile")
    ap.add_argument("--compile-cells", default="1x32768,8x32768",
                    help="BxCONTEXT cells where transformers-static-compile runs (each compiles for ~1 min)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    add_model_args(ap)
    ap.add_argument("--profile", action="store_true", help="add splitkv-eager rows' top kernels (torch.profiler)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke settings (2 layers, 4/2 heads, D 64)")
    a = ap.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    if a.tiny:
        vars(a).update(TINY)
        a.batches, a.contexts, a.steps, a.warmup = [1, 2], [256], 3, 1
        a.compile_cells = ""
    device = torch.device(a.device)
    model = build_model(a, device)
    providers = a.providers.split(",")
    compile_cells = {tuple(int(x) for x in c.split("x")) for c in a.compile_cells.split(",") if c}
    rows = []
    for B, ctx in cells(a):
        fl = floor_ms(model, a, B, ctx)
        for prov in providers:
            if prov == "transformers-static-compile" and (B, ctx) not in compile_cells:
                continue
            if prov.startswith("splitkv"):
                kv_dtype = torch.float8_e4m3fn if prov.endswith("fp8") else getattr(torch, a.dtype)
                graphs = {"splitkv-eager": False, "splitkv-graph-compile": "compile"}.get(prov, True)
                ms, prof, first = run_splitkv(model, a, B, ctx, device, graphs, kv_dtype)
            else:
                prof = first = None
                ms = run_transformers(model, a, B, ctx, device, prov.removeprefix("transformers-").removeprefix("sdpa-"))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append({"provider": prov, "batch": B, "context": ctx, "ms_per_step": ms,
                         "tokens_per_s": B / ms * 1e3, "floor_ms": fl, "x_floor": ms / fl})
            if first is not None:
                rows[-1]["first_step_ms"] = first
            if prof:
                rows[-1]["profile"] = prof
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
            for name, us, calls in (prof or {}).get("kernels", []):
                print(f"    {us:9.1f} us {calls:6.1f}x {name}")
    for B, ctx in cells(a):  # splitkv-graph's speed-up over the best transformers configuration of the cell
        cell = [r for r in rows if (r["batch"], r["context"]) == (B, ctx)]
        tf = [r["ms_per_step"] for r in cell if r["provider"].startswith("transformers")]
        for r in cell:
            if r["provider"].startswith("splitkv") and tf:
                r["x_best_transformers"] = min(tf) / r["ms_per_step"]
    meta = run_meta(device, "hf-step", argv)
    config = {k: getattr(a, k) for k in ("layers", "hq", "hkv", "head_dim", "hidden", "mlp", "vocab", "dtype",
                                         "steps", "warmup")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": "splitkv.hf_step/1", "meta": meta, "config": config, "rows": rows},
                              indent=1))
    write_markdown(out.with_suffix(".md"), meta, config, rows)
    print(f"wrote {out} and {out.with_suffix('.md')}")


def write_markdown(path: Path, meta: dict, config: dict, rows: list[dict]) -> None:
    lines = [f"# Llama decode step: splitkv vs transformers ({meta['device']})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"triton {meta['triton']}, splitkv {meta['splitkv']} ({meta['git_commit']})", "",
             "Random model, " + ", ".join(f"{k} {v}" for k, v in config.items()) + ". Floor: weights (less the "
             f"embedding table) + KV bytes at {FLOOR_TBPS} TB/s.", "",
             "| B | context | provider | ms/step | tokens/s | × floor | × best transformers | first step ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x, first = r.get("x_best_transformers"), r.get("first_step_ms")
        lines.append(f"| {r['batch']} | {r['context']} | {r['provider']} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['x_floor']:.2f} | {f'{x:.2f}' if x else '—'} | "
                     f"{f'{first:.0f}' if first is not None else '—'} |")
    path.write_text("\n".join(lines) + "\n")
