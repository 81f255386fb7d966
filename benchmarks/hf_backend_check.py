"""Each backend's attention inside the demo's random-weight Llama (splitkv/demo_llama.py settings:
initializer_range 0.2, bf16, 32K prompt), checked layer by layer against the fp64 reference on the
very inputs the model produces, then greedy tokens per backend against transformers' generate.

    python benchmarks/hf_backend_check.py --out $OUT/hf_backend_check.json      # H200
    python benchmarks/hf_backend_check.py --out /tmp/c.json --device cpu --tiny # CPU smoke run

Part 1 (teacher-forced on the first backend): at each of --steps decode steps, every layer's
attention call also runs every variant (backend x merge path x split count x cache layout) on the
same q / paged cache and records max |o - ref| and max |lse - ref|, next to PyTorch's own
low-precision error (reference.decode_lowp) as the yardstick. Part 2: hf.generate per backend vs
model.generate: identical tokens, first divergence, and the reference logits' top-2 gap there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

import splitkv
from splitkv import heuristics as H
from splitkv.demo_llama import _model
from splitkv.integrations import hf
from splitkv.reference import decode_lowp, decode_reference, gather_keys


@contextlib.contextmanager
def _unfused():
    old = H.CUTLASS_FUSED_MERGE_MAX_SPLITS
    H.CUTLASS_FUSED_MERGE_MAX_SPLITS = 0
    try:
        yield
    finally:
        H.CUTLASS_FUSED_MERGE_MAX_SPLITS = old


def _variants(backends):
    """name -> (backend, num_splits or None, paged, unfused)."""
    v = {}
    for be in backends:
        v[f"{be}"] = (be, None, True, False)
        v[f"{be}-dense"] = (be, None, False, False)
        v[f"{be}-1split"] = (be, 1, True, False)
        if be == "cutlass":
            v["cutlass-unfused"] = (be, None, True, True)
    return v


def check_layer(q, kp, vp, bt, sl, scale, variants):
    """One attention call's inputs -> {variant: (o err, lse err)} and the reference's stats."""
    ref_o, ref_lse = decode_reference(q, kp, vp, sl, block_table=bt, softmax_scale=scale)
    L = int(sl[0])
    kd = gather_keys(kp, 0, L, bt)[None].contiguous()
    vd = gather_keys(vp, 0, L, bt)[None].contiguous()
    low = decode_lowp(q, kd, vd, sl, softmax_scale=scale)
    row = {"keys": L, "ref_max_abs_o": float(ref_o.abs().max()), "ref_lse_min": float(ref_lse.min()),
           "ref_lse_max": float(ref_lse.max()), "lowp_err": float((low.double() - ref_o).abs().max())}
    for name, (be, ns, paged, unfused) in variants.items():
        k_, v_, bt_ = (kp, vp, bt) if paged else (kd, vd, None)
        with _unfused() if unfused else contextlib.nullcontext():
            o, lse = splitkv.decode(q, k_, v_, sl, block_table=bt_, softmax_scale=scale, num_splits=ns,
                                    return_lse=True, backend=be)
        row[name] = {"o_err": float((o.double() - ref_o).abs().max()),
                     "lse_err": float((lse.double() - ref_lse).abs().max())}
    return row


def part1(model, ids, a, variants):
    rows, orig = [], hf.splitkv_attention
    step = {"i": 0}

    def checking(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        o, w = orig(module, query, key, value, attention_mask, scaling, dropout, **kw)
        state = hf._ACTIVE.get()
        layer = module.layer_idx
        bt, sl = state.cache.batch(state.seq_ids, layer=layer)
        row = check_layer(query.transpose(1, 2), state.cache.k_pages(layer), state.cache.v_pages(layer), bt, sl,
                          scaling, variants)
        rows.append({"step": step["i"], "layer": layer, "splits": state.plan.max_splits, **row})
        print(json.dumps(rows[-1]), flush=True)
        return o, w

    state, logits = hf.prefill(model, ids, max_new_tokens=a.steps + 1, backend=a.backends[0])
    hf.splitkv_attention = checking
    try:
        with hf.use_splitkv(model):
            for i in range(a.steps):
                step["i"] = i
                logits = hf.decode_step(model, state, logits.argmax(-1))
    finally:
        hf.splitkv_attention = orig
        hf.register()
        state.free()
    return rows


def part2(model, ids, a):
    P = ids.shape[1]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref_ids, ref_logits = out.sequences[0, P:], torch.stack(out.logits, 1)[0].float()
    top2 = ref_logits.topk(2, -1).values
    gap = (top2[:, 0] - top2[:, 1]).tolist()
    rows = []
    for be in a.backends:
        t0 = time.perf_counter()
        ours, logits = hf.generate(model, ids, a.new, eos_token_id=None, backend=be, output_logits=True)
        ours = ours[0, P:]
        diff = (ours != ref_ids).nonzero()
        first = int(diff[0]) if len(diff) else None
        d0 = float((logits[0, 0].float() - ref_logits[0]).abs().max())  # after the prefill: same model path
        d1 = float((logits[0, 1].float() - ref_logits[1]).abs().max()) if a.new > 1 else None  # one decode step
        rows.append({"backend": be, "identical": int((ours == ref_ids).sum()), "of": a.new,
                     "first_divergence": first, "ref_top2_gap_there": gap[first] if first is not None else None,
                     "logit_diff_step0": d0, "logit_diff_step1": d1, "min_ref_top2_gap": min(gap),
                     "s": round(time.perf_counter() - t0, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="triton,cutlass")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=2, help="decode steps checked layer by layer")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens compared with transformers")
    ap.add_argument("--tiny", action="store_true", help="CPU: 2 layers, hidden 256, 4/2 heads, D 64, fp32")
    a = ap.parse_args(argv)
    a.backends = a.backends.split(",")
    device = torch.device(a.device)
    dims = (2, 256, 4, 2, 64, 256, torch.float32) if a.tiny else (8, 4096, 32, 8, 128, 32000, torch.bfloat16)
    if a.tiny:
        a.prompt = min(a.prompt, 512)
    model = _model(device, *dims, a.prompt + a.new + 16)
    ids = torch.randint(3, model.config.vocab_size, (1, a.prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        res = {"config": {"dims": [str(x) for x in dims], "prompt": a.prompt, "backends": a.backends},
               "layers": part1(model, ids, a, _variants(a.backends))}
        res["generate"] = part2(model, ids, a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
