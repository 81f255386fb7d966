"""splitkv.integrations.hf on models with attention variants (random tiny configs, nothing
downloaded): Mistral's sliding window, Gemma 2's alternating sliding/global layers with logit
softcapping, gpt-oss's attention sinks with sliding layers. Greedy tokens equal transformers' own
generate in fp32 on the CPU, with windows shorter than the prompt so they matter."""

from __future__ import annotations

import pytest
import torch

S, PAD1, NEW, WINDOW = 90, 23, 12, 24


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("transformers")


def _common(hidden=64, layers=2):
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=128, initializer_range=0.2)


def _mistral(tf):
    return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=WINDOW, **_common()))


def _gemma2(tf):
    # untied embeddings: with Gemma's scaled, tied embeddings a random model echoes its input token
    cfg = tf.Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=32,
                          tie_word_embeddings=False, **_common(layers=3))
    return tf.Gemma2ForCausalLM(cfg)


def _gpt_oss(tf):
    cfg = tf.GptOssConfig(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                          layer_types=["sliding_attention", "full_attention"], **_common())
    model = tf.GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks large enough to take a real share of the probability mass
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("make", [_mistral, _gemma2, _gpt_oss], ids=["mistral", "gemma2", "gpt-oss"])
def test_variant_models_match_transformers_greedy(tf, make):
    from splitkv.integrations import hf

    torch.manual_seed(0)
    model = make(tf).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, :PAD1] = 0
    ids[1, :PAD1] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    seen = []
    decode = hf.decode
    hf.decode = lambda *a, **k: seen.append({key: k.get(key) is not None for key in ("window_size", "softcap",
                                                                                     "sinks")}) or decode(*a, **k)
    try:
        got = hf.generate(model, ids, NEW, attention_mask=mask, eos_token_id=None)
    finally:
        hf.decode = decode
    assert torch.equal(got, want)
    assert len(set(want[0, S:].tolist())) > 3  # not one repeated token
    assert any(s["window_size"] for s in seen)  # the variant reached splitkv.decode
    if make is _gemma2:
        assert all(s["softcap"] for s in seen) and not all(s["window_size"] for s in seen)
    if make is _gpt_oss:
        assert all(s["sinks"] for s in seen)
