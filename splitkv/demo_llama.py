"""The demo's model section: a random-weight Llama decoding a long context through PagedKVCache +
splitkv (splitkv.integrations.hf), checked token by token against transformers' own generate.

GPU: 8 layers, hidden 4096, Hq 32 / Hkv 8, D 128, bf16, 32K-token prompt. CPU: 2 layers, hidden
256, Hq 4 / Hkv 2, D 64, fp32, 512-token prompt (seconds). Skipped with a note when transformers
is not installed (from a checkout: `pip install -e ".[hf]"`).
"""

from __future__ import annotations

import importlib.util
import time

import torch
from rich.markup import escape

import splitkv


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


def run(console, device) -> bool:
    """Print the model section; return whether splitkv's tokens match transformers' generate."""
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
        # warm both paths first (kernel compiles, plans, allocator): the timings compare steady state
        hf.generate(model, ids, 2, eos_token_id=None)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        _sync(device)
        t0 = time.perf_counter()
        ours, our_logits = hf.generate(model, ids, new, eos_token_id=None, output_logits=True)
        _sync(device)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        _sync(device)
        t_ref = time.perf_counter() - t0
    ours, theirs = ours[0, prompt:], ref.sequences[0, prompt:]
    same = int((ours == theirs).sum())
    lens = torch.tensor([prompt + new - 1], dtype=torch.int32, device=device)
    p = splitkv.plan(lens, hq, hkv, D, paged=True)  # as the HF decode plans it (auto, paged cache)
    console.print(f"\n[bold]Random-weight Llama[/] ({layers} layers, hidden {hidden}, Hq {hq} / Hkv {hkv}, D {D}, "
                  f"{str(dtype).replace('torch.', '')}) on a {prompt}-token prompt, {new} greedy tokens, "
                  "every decode step through PagedKVCache + splitkv:")
    console.print(f"  splitkv generate: {t_ours:.2f} s including prefill ({new / t_ours:.1f} tokens/s overall); "
                  f"transformers generate: {t_ref:.2f} s (both timed after a warm-up generate)")
    if gpu:
        console.print(f"  splits at the last step: {int(p.num_splits.tolist()[0])} per KV head "
                      f"({escape(p.describe())})", highlight=False)
    else:
        console.print("  on the CPU each step runs one fused attention pass per request (no split)", highlight=False)
    if same == new:
        note = "" if gpu else " (fp32 on CPU: must be identical)"
        console.print(f"  [green]{same}/{new} tokens identical to transformers' generate{note}[/]")
        return True
    tie = _near_tie(our_logits[0], torch.stack(ref.logits, 1)[0], ours, theirs)
    console.print(f"  [yellow]{same}/{new} tokens identical to transformers' generate[/]: {tie[1]}")
    return gpu and tie[0]  # fp32 on the CPU must match exactly


def _near_tie(our_logits, ref_logits, ours, theirs):
    """At the first differing token (same prefix before it, so the two logit rows are comparable):
    (whether transformers' top-2 gap there is within splitkv's logit difference, the sentence)."""
    k = int((ours != theirs).nonzero()[0])
    top2 = ref_logits[k].float().topk(2).values
    gap = float(top2[0] - top2[1])
    diff = float((our_logits[k].float() - ref_logits[k].float()).abs().max())
    tie = gap <= diff
    what = ("a near-tie that low-precision rounding order decides, not an attention error" if tie
            else "NOT a near-tie: check the attention output against splitkv.reference")
    return tie, (f"they first differ at new token {k}, where transformers' own top-2 logits are {gap:.3g} apart "
                 f"and splitkv's logits differ from transformers' by up to {diff:.3g}: {what}")
