"""Decode tokens/s of a Hugging Face Llama model: splitkv (PagedKVCache + splitkv attention, via
splitkv.integrations.hf) against transformers' default attention (sdpa + DynamicCache).

    python benchmarks/hf_decode.py --out results/hf_decode.json            # H200: 32K prompt
    python benchmarks/hf_decode.py --out /tmp/hf.json --device cpu --tiny  # CPU smoke run

The model is randomly initialised from a config (nothing is downloaded): by default 8 layers,
Hq 32 / Hkv 8, head dim 128, hidden 4096, MLP 14336, vocab 32000, bf16 (a Llama-3-8B layer shape).
For each batch size both providers run the same loop: prefill the prompt once (the model's own
attention in both), then greedy decode steps, one token per request each. Only decode is timed:
warm-up steps first (Triton compilation, allocator growth), then `--new-tokens` steps between two
CUDA synchronisations. tokens/s = batch x steps / time. Both loops feed the model identical tokens
(teacher forcing with the transformers run's greedy tokens), so both attend over the same contexts;
the row also records the max |logit difference| between the two at the timed steps.
Writes JSON (--out) and markdown (same path, .md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from splitkv.bench.report import _version, collect_meta
from splitkv.integrations import hf


def build_model(a, device):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers, num_attention_heads=a.hq,
        num_key_value_heads=a.hkv, head_dim=a.head_dim, vocab_size=a.vocab,
        max_position_embeddings=max(a.prompt_len + a.new_tokens + a.warmup + 16, 4096))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype=getattr(torch, a.dtype)).eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_transformers(model, ids, steps, warmup, device):
    """Prefill + decode with transformers' own cache and attention; returns (tokens [B, steps +
    warmup + 1], logits of the timed steps [B, steps, V], prefill s, decode s)."""
    import transformers

    B, S = ids.shape
    cache = transformers.DynamicCache(config=model.config)
    kw = {hf._cache_kwarg(model): cache, "logits_to_keep": 1}
    _sync(device)
    t0 = time.perf_counter()
    logits = model(input_ids=ids, use_cache=True, **kw).logits[:, -1]
    _sync(device)
    prefill = time.perf_counter() - t0
    toks, timed = [logits.argmax(-1)], []
    pos = torch.full((B, 1), S, dtype=torch.long, device=device)
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            t0 = time.perf_counter()
        logits = model(input_ids=toks[-1][:, None], position_ids=pos, use_cache=True, **kw).logits[:, -1]
        pos += 1
        toks.append(logits.argmax(-1))
        if i >= warmup:
            timed.append(logits)
    _sync(device)
    decode = time.perf_counter() - t0
    return torch.stack(toks, 1), torch.stack(timed, 1), prefill, decode


@torch.no_grad()
def run_splitkv(model, ids, tokens, steps, warmup, device, page_size, backend="auto"):
    """The same loop through splitkv, fed the transformers run's tokens (teacher forcing)."""
    _sync(device)
    t0 = time.perf_counter()
    state, _ = hf.prefill(model, ids, max_new_tokens=warmup + steps + 1, page_size=page_size, backend=backend)
    _sync(device)
    prefill = time.perf_counter() - t0
    timed = []
    try:
        with hf.use_splitkv(model):
            for i in range(warmup + steps):
                if i == warmup:
                    _sync(device)
                    t0 = time.perf_counter()
                logits = hf.decode_step(model, state, tokens[:, i])
                if i >= warmup:
                    timed.append(logits)
            _sync(device)
            decode = time.perf_counter() - t0
    finally:
        state.free()
    return torch.stack(timed, 1), prefill, decode


def measure(model, a, B, device):
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(0, a.vocab, (B, a.prompt_len), generator=g).to(device)
    toks, ref_logits, tf_prefill, tf_decode = run_transformers(model, ids, a.new_tokens, a.warmup, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    skv_logits, skv_prefill, skv_decode = run_splitkv(model, ids, toks, a.new_tokens, a.warmup, device,
                                                      a.page_size, a.backend)
    diff = float((skv_logits.float() - ref_logits.float()).abs().max())
    scale = float(ref_logits.float().abs().max())
    rows = []
    skv_name = "splitkv" if a.backend == "auto" else f"splitkv-{a.backend}"
    runs = (("transformers-sdpa", tf_prefill, tf_decode), (skv_name, skv_prefill, skv_decode))
    for name, pre, dec in runs:
        rows.append({"provider": name, "batch": B, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "prefill_s": pre, "decode_ms_per_step": dec / a.new_tokens * 1e3,
                     "tokens_per_s": B * a.new_tokens / dec, "max_logit_diff_vs_transformers": diff,
                     "max_abs_logit": scale})
    rows[1]["speedup_vs_transformers"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    del ids, toks, ref_logits, skv_logits
    return rows


def write_markdown(path: Path, meta: dict, config: dict, rows: list[dict]) -> None:
    lines = [f"# HF Llama decode: splitkv vs transformers ({meta['device']})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, transformers "
             f"{meta['transformers']}, triton {meta['triton']}, splitkv {meta['splitkv']} "
             f"({meta['git_commit']})", "",
             "Model: random Llama, " + ", ".join(f"{k} {v}" for k, v in config.items()) + ".", "",
             "| batch | prompt | provider | prefill s | decode ms/step | tokens/s | speedup "
             "| max logit diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r.get("speedup_vs_transformers")
        lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['provider']} | {r['prefill_s']:.2f} | "
                     f"{r['decode_ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{f'{sp:.2f}x' if sp else '—'} | {r['max_logit_diff_vs_transformers']:.3g} "
                     f"(of {r['max_abs_logit']:.3g}) |")
    lines += ["", meta["timing"], ""]
    path.write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path (markdown goes next to it as .md)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default 1,4)")
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps before timing")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--backend", default="auto", help="splitkv backend for the decode steps (auto, triton, "
                    "cutlass, torch): max_logit_diff_vs_transformers compares backends on teacher-forced tokens")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke settings (2 layers, 4/2 heads, D 64)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers, a.hq, a.hkv, a.head_dim, a.hidden, a.mlp, a.vocab = 2, 4, 2, 64, 128, 256, 256
        a.prompt_len, a.new_tokens = min(a.prompt_len, 512), min(a.new_tokens, 8)
        a.warmup, a.batches = 2, "1,2"
    device = torch.device(a.device)
    model = build_model(a, device)
    rows = []
    for B in (int(x) for x in a.batches.split(",")):
        rows += measure(model, a, B, device)
        for r in rows[-2:]:
            print(json.dumps(r), flush=True)
    meta = collect_meta(device, [], 0.0)
    meta.pop("sol_tbps")
    meta.pop("byte_model")
    meta.update(command="python benchmarks/hf_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
                transformers=_version("transformers"),
                timing=(f"Decode only: {a.warmup} warm-up steps, then {a.new_tokens} steps timed between two "
                        "synchronisations (perf_counter); greedy, one token per request per step; both "
                        "providers fed the transformers run's tokens. Prefill (the model's own sdpa in both) "
                        "is timed once, cold, for reference."))
    config = {k: getattr(a, k) for k in ("layers", "hq", "hkv", "head_dim", "hidden", "mlp", "vocab", "dtype",
                                         "page_size")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": "splitkv.hf_decode/1", "meta": meta, "config": config, "rows": rows},
                              indent=1))
    write_markdown(out.with_suffix(".md"), meta, config, rows)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
