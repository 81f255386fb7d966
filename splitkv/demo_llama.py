"""The demo's model section: a random-weight Llama decoding a long context through PagedKVCache +
splitkv (splitkv.integrations.hf), next to transformers' own generate in the same run.

What it prints: decode time per token apart from prefill (splitkv's CUDA-graph steps; transformers'
generate with its default DynamicCache and with a StaticCache, and with --tf-compile on a GPU its
compiled StaticCache, the fastest, compiled at its first call), and correctness measured the
honest way for a random model, whose nearly flat logits make greedy tokens part at near-ties in
bf16: both libraries are fed the same tokens (teacher forcing) and their logits are compared with
an fp32 run of the same weights; splitkv passes when its error is at most 2x transformers' own bf16
error. On the CPU (fp32) the greedy tokens must also be identical.

GPU: 8 layers, hidden 4096, Hq 32 / Hkv 8, D 128, bf16, 32K-token prompt. CPU: 2 layers, hidden
256, Hq 4 / Hkv 2, D 64, fp32, 512-token prompt (seconds). Skipped with a note when transformers
is not installed (from a checkout: `pip install -e ".[hf]"`).
"""

from __future__ import annotations

import copy
import importlib.util
import time

import torch


def _model(device, layers, hidden, hq, hkv, head_dim, vocab, dtype, max_pos):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim,
                                   vocab_size=vocab, max_position_embeddings=max_pos, initializer_range=0.2)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype=dtype).eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _tf_generate(model, ids, new, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)


def _tf_ms_per_token(model, ids, new, device, **kw) -> float:
    """transformers' decode time per token: generate(new) - generate(1), over new - 1 tokens."""
    _tf_generate(model, ids, 2, **kw)  # warm-up
    _, t1 = _timed(lambda: _tf_generate(model, ids, 1, **kw), device)
    _, tn = _timed(lambda: _tf_generate(model, ids, new, **kw), device)
    return (tn - t1) / (new - 1) * 1e3


@torch.no_grad()
def _splitkv_teacher_forced(hf, model, ids, tokens, device):
    """splitkv's logits [new, vocab] when fed `tokens` [new]; (logits, prefill s, ms per decode step
    after the first, first step ms — it captures the CUDA graph)."""
    (state, first), t_pre = _timed(lambda: hf.prefill(model, ids, max_new_tokens=tokens.numel()), device)
    out = [first[0]]
    try:
        with hf.use_splitkv(model):
            logits, t_first = _timed(lambda: hf.decode_step(model, state, tokens[:1]), device)
            out.append(logits[0])
            _sync(device)
            t0 = time.perf_counter()
            for k in range(1, tokens.numel() - 1):
                out.append(hf.decode_step(model, state, tokens[k:k + 1])[0])
            _sync(device)
            t_rest = time.perf_counter() - t0
    finally:
        state.free()
    return torch.stack(out), t_pre, t_rest / max(tokens.numel() - 2, 1) * 1e3, t_first * 1e3


@torch.no_grad()
def _fp32_logits(hf, model, ids, tokens, chunk=2048):
    """The fp32 truth: the same weights in fp32, fed the prompt (in chunks: one 32K-token fp32
    attention would need a 128 GB score matrix) and tokens[:-1]; logits [new, vocab]."""
    import transformers

    ref = copy.deepcopy(model).float()
    kw = {hf._cache_kwarg(ref): transformers.DynamicCache(), "use_cache": True}
    for a in range(0, ids.shape[1], chunk):
        first = ref(input_ids=ids[:, a:a + chunk], logits_to_keep=1, **kw).logits[0]
    rest = ref(input_ids=tokens[None, :-1], **kw).logits[0]
    del ref
    return torch.cat((first, rest))


def _tf_compiled_ms(model, ids, new, device):
    """transformers' generate with a StaticCache and its automatic torch.compile (CUDA): (ms per
    token, compile s: the first call's time) or the error that stopped it."""
    try:
        _, t_compile = _timed(lambda: _tf_generate(model, ids, 2, cache_implementation="static"), device)
        return _tf_ms_per_token(model, ids, new, device, cache_implementation="static"), t_compile
    except Exception as e:  # noqa: BLE001 - a peer's failure must not hide splitkv's result
        return f"{type(e).__name__}: {str(e)[:200]}"


def run(console, device, tf_compile: bool = False) -> bool:
    """Print the model section; return whether splitkv passed its check. tf_compile: on a GPU also
    time transformers' compiled StaticCache (its fastest generate; it compiles at its first call)."""
    if importlib.util.find_spec("transformers") is None:
        console.print("[yellow]model demo skipped: transformers is not installed "
                      "(from a checkout: pip install -e '.\\[hf]')[/]")
        return True
    from splitkv.integrations import hf

    gpu = device.type == "cuda"
    layers, hidden, hq, hkv, D = (8, 4096, 32, 8, 128) if gpu else (2, 256, 4, 2, 64)
    prompt, new = (32768, 32) if gpu else (512, 16)
    dtype = torch.bfloat16 if gpu else torch.float32
    model = _model(device, layers, hidden, hq, hkv, D, 32000 if gpu else 256, dtype, prompt + new + 16)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref = _tf_generate(model, ids, new, output_logits=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, prompt:]
        their_logits = torch.stack(ref.logits, 1)[0]
        _splitkv_teacher_forced(hf, model, ids, tokens[:3], device)  # warm-up: kernel compiles
        ours, t_pre, ms_ours, ms_first = _splitkv_teacher_forced(hf, model, ids, tokens, device)
        ms_dyn = _tf_ms_per_token(model, ids, new, device)
        ms_static = _tf_ms_per_token(model, ids, new, device, cache_implementation="static", disable_compile=True)
        compiled = _tf_compiled_ms(model, ids, new, device) if gpu and tf_compile else None
        truth = _fp32_logits(hf, model, ids, tokens) if gpu else their_logits.float()
    err_ours = float((ours.float() - truth).abs().max())
    err_theirs = float((their_logits.float() - truth).abs().max())
    console.print(f"\n[bold]Random-weight Llama[/] ({layers} layers, hidden {hidden}, Hq {hq} / Hkv {hkv}, D {D}, "
                  f"{str(dtype).replace('torch.', '')}), {prompt}-token prompt, {new} new tokens:")
    how = "CUDA-graph steps" if gpu else "eager steps"
    best = min(ms_dyn, ms_static)
    theirs = f"sdpa + DynamicCache {ms_dyn:.2f} ms, StaticCache {ms_static:.2f} ms"
    if isinstance(compiled, tuple):
        best = min(best, compiled[0])
        theirs += f", StaticCache compiled {compiled[0]:.2f} ms (compiled in {compiled[1]:.0f} s)"
    console.print(f"  decode, per token: splitkv ({how}) [bold]{ms_ours:.2f} ms[/] ({1e3 / ms_ours:.0f} tokens/s); "
                  f"transformers generate: {theirs} -> {best / ms_ours:.2f}x the fastest of these", highlight=False)
    if isinstance(compiled, str):
        console.print(f"  [yellow]transformers' compiled StaticCache failed: {compiled}[/]", highlight=False)
    elif gpu and compiled is None:
        console.print("  (transformers' compiled StaticCache, its fastest generate, not run: add --tf-compile; "
                      "it compiles at its first call)", highlight=False)
    console.print(f"  prefill (the model's own attention, then K/V copied into the paged cache): {t_pre:.2f} s; "
                  f"splitkv's first decode step {ms_first:.0f} ms" + (" (captures the graph)" if gpu else ""),
                  highlight=False)
    if gpu:
        ok = err_ours <= 2 * err_theirs + 1e-2
        mark = "[green]ok[/]" if ok else "[red]FAILED[/]"
        console.print(f"  fed the same tokens, max |logit error| vs an fp32 run of the same weights: splitkv "
                      f"{err_ours:.3g}, transformers (bf16) {err_theirs:.3g}, logits up to {float(truth.abs().max()):.3g}: "
                      f"{mark} (must be <= 2x transformers')",
                      highlight=False)
        return ok
    greedy = hf.generate(model, ids, new, eos_token_id=None)[0, prompt:]
    same = int((greedy == tokens).sum())
    ok = same == new and err_ours < 1e-3
    mark = "[green]" if ok else "[red]"
    console.print(f"  {mark}fp32: {same}/{new} greedy tokens identical to transformers' generate; logits fed the "
                  f"same tokens differ by at most {err_ours:.2g}[/]", highlight=False)
    return ok
