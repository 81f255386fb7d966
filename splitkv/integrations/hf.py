"""Hugging Face transformers decode through splitkv: a registered attention function plus cache glue,
no fork of the model code. Llama-family models (those whose attention calls
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` with post-RoPE query/key/value), with the
attention variants such models pass it: Mistral / Qwen2 / gpt-oss sliding windows (per layer, as
`layer_types` says), Gemma 2's logit softcapping, gpt-oss's attention sinks.

    ids = splitkv.integrations.hf.generate(model, input_ids, 32, attention_mask=mask)

How a generation runs:
  * prefill — the model's own forward and attention (whatever config._attn_implementation says)
    over the left-padded prompt with a transformers DynamicCache; then every layer's K/V of each
    request's real tokens (padding dropped) is copied into a splitkv PagedKVCache;
  * decode — config._attn_implementation is switched to "splitkv" (registered in transformers'
    AttentionInterface) and the model runs one token per request with use_cache=False: each
    layer's attention receives the new token's post-RoPE q, k, v, appends k, v to the paged cache
    and calls splitkv.decode over it. The model builds no mask for an implementation it does not
    know, and the paged cache holds no padding, so none is needed. The step's plan is made once,
    at layer 0, from host-known lengths, and reused by every layer (no device->host read). On a
    GPU the whole step is captured as a CUDA graph per batch-size bucket and replayed (hf_graph).

Positions follow transformers' generate for left padding: request b's real tokens sit at
0 .. n_b - 1, its k-th new token at n_b + k. Greedy tokens match `model.generate(do_sample=False)`
(same EOS/padding rule) up to floating-point ties.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch

from .. import validate
from ..api import decode
from ..cache import PagedKVCache
from ..cascade import group_prefix_decode, prefix_gather
from ..merge import merge_states
from ..plan import DecodePlan
from ..plan import plan as make_plan
from ..validate import HEAD_DIM_RULE, head_dim_ok
from ..variants import FP8_DTYPES

ATTN_NAME = "splitkv"
# kv_cache_dtype names (vLLM's spelling) -> the paged cache's dtype; "auto": the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
# fp8 caches: per layer and KV head scales from the prompt, amax / (largest fp8 value / headroom),
# so a decoded token up to FP8_HEADROOM x the prompt's largest |K| or |V| still fits (past that the
# append saturates, as serving engines' fp8 caches do)
FP8_HEADROOM = 2.0
_ACTIVE: contextvars.ContextVar[DecodeState | None] = contextvars.ContextVar("splitkv_hf_state", default=None)


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("splitkv.integrations.hf needs transformers: pip install 'splitkv[hf]'") from e
    return transformers


@dataclass
class DecodeState:
    """One batch of requests being decoded: the paged cache and where each request stands."""

    cache: PagedKVCache
    seq_ids: list[int]
    positions: torch.Tensor  # int64 [B]: position of each request's next token
    backend: str = "auto"
    num_splits: int | None = None
    plan: DecodePlan | None = field(default=None, repr=False)  # the plan the last layer ran
    # one plan per attention variant (a sliding-window layer plans its window), kept across steps
    # and refreshed once per step at the first layer that uses it
    plans: dict = field(default_factory=dict, repr=False)
    refreshed: set = field(default_factory=set, repr=False)  # variants whose split table is computed this step
    # id(s_aux) -> (the parameter, its version, its float32 copy): a layer's sinks converted once, not per step
    sinks: dict = field(default_factory=dict, repr=False)
    # fixed-shape / CUDA-graph steps (hf_graph.GraphSteps): decode_step runs through them when set
    graphs: object = field(default=None, repr=False)
    io: object = field(default=None, repr=False)  # the StepIO of the fixed-shape step now running
    # requests sharing a prompt prefix: [(batch rows, shared pages)] (Engine(share_prefix=True)); the
    # fixed-shape steps then attend each group's prefix once (cascade.group_prefix_decode)
    groups: list | None = None

    def free(self) -> None:
        for sid in self.seq_ids:
            self.cache.free(sid)
        self.seq_ids = []


def _sinks(state: DecodeState, s_aux: torch.Tensor) -> torch.Tensor:
    """s_aux as decode takes sinks (float32, contiguous), converted once per parameter version."""
    hit = state.sinks.get(id(s_aux))
    if hit is None or hit[0] is not s_aux or hit[1] != s_aux._version:
        hit = state.sinks[id(s_aux)] = (s_aux, s_aux._version, s_aux.detach().float().contiguous())
    return hit[2]


def _variant(sliding_window, softcap, sinks) -> dict:
    """splitkv.decode's variant arguments from what transformers passes an attention function:
    sliding_window (keys within the last `sliding_window` positions, the query's own included:
    window_size left = sliding_window - 1), softcap (Gemma 2's attn_logit_softcapping), sinks
    (gpt-oss's per-head attention sinks, s_aux, already float32: _sinks)."""
    kw = {}
    if sliding_window:
        kw["window_size"] = (int(sliding_window) - 1, -1)
    if softcap:
        kw["softcap"] = float(softcap)
    if sinks is not None:
        kw["sinks"] = sinks
    return kw


def splitkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, s_aux=None, **kwargs):
    """transformers attention function: query [B, Hq, Sq, D], key/value [B, Hkv, Sq, D] of the new
    tokens (post-RoPE) -> (attn_output [B, Sq, Hq, D], None). The layer's sliding window, logit
    softcap and attention sinks (when the model passes them) go to splitkv.decode."""
    state = _ACTIVE.get()
    if state is None:
        raise RuntimeError("splitkv attention runs only inside splitkv.integrations.hf.decode_step / "
                           "generate (it needs their paged KV cache)")
    layer = module.layer_idx
    cache, io = state.cache, state.io
    if io is None:
        cache.append(state.seq_ids, key.transpose(1, 2), value.transpose(1, 2), layer=layer)
        block_table, seqlens = cache.batch(state.seq_ids, layer=layer)
        plans = state.plans
    else:  # a fixed-shape step (hf_graph): the slots were counted by extend, the tables are static
        cache.write(layer, key.transpose(1, 2), value.transpose(1, 2), io.block_table, io.starts, io.ntok)
        block_table, seqlens, plans = io.block_table, io.seqlens, io.plans
    B, Hq, Sq, D = query.shape
    bound = block_table.shape[1] * cache.page_size
    var = _variant(sliding_window, softcap, _sinks(state, s_aux) if s_aux is not None else None)
    vkey = (var.get("window_size"), var.get("softcap"), "sinks" in var)
    if cache.dtype in FP8_DTYPES:  # the layer's scales (float32 [Hkv]); the plan needs only their form
        var.update(k_scale=cache.k_scale(layer), v_scale=cache.v_scale(layer))
    q, kp, vp = query.transpose(1, 2), cache.k_pages(layer), cache.v_pages(layer)
    plan = functools.partial(_step_plan, state, plans, Hkv=key.shape[1], D=D, Sq=Sq, bound=bound, dtype=query.dtype,
                             kv_dtype=cache.dtype, var=var)
    if io is not None and io.members is not None and "window_size" not in var and "sinks" not in var:
        # shared prompt prefixes (hf_graph): each group's prefix once, each row's suffix, merged (a
        # window or sinks would not split this way: the sink enters a row's softmax once)
        p_s = plan(("suffix", *vkey), io.suffix_lens, Hq)
        o_s, lse_s = decode(q, kp, vp, io.suffix_lens, block_table=io.suffix_table, softmax_scale=scaling, plan=p_s,
                            backend=state.backend, return_lse=True, **var)
        p_p = plan(("prefix", *vkey), io.prefix_lens, Hq * io.members.shape[1])
        gkey = (Sq, Hq, key.shape[1])
        if gkey not in io.gathers:  # once per step: every layer folds the same members
            io.gathers[gkey] = prefix_gather(io.members, B, *gkey)
        o_p, lse_p = group_prefix_decode(q, kp, vp, block_table, io.members, io.prefix_lens, softmax_scale=scaling,
                                         plan=p_p, backend=state.backend, gather=io.gathers[gkey], **var)
        state.plan = p_s
        return merge_states(o_s, lse_s, o_p, lse_p)[0], None
    p = state.plan = plan(vkey, seqlens, Hq)
    o = decode(q, kp, vp, seqlens, block_table=block_table, softmax_scale=scaling, plan=p, backend=state.backend,
               **var)
    return o, None


def _step_plan(state, plans, key, lens, Hq, *, Hkv, D, Sq, bound, dtype, kv_dtype, var) -> DecodePlan:
    """The plan for `key` at these lengths: made once, sized for the table's capacity (no host read
    of the lengths) and rebuilt when that grows (to twice its old bound, at most the pool's tokens)
    or the batch changes (keeping its bound); its split table refreshed once per step."""
    p = plans.get(key)
    if p is None or (p.batch, p.num_q_heads, p.q_len, p.head_dim) != (lens.shape[0], Hq, Sq, D) \
            or p.max_seqlen < bound:
        old = p.max_seqlen if p is not None else 0
        grown = min(2 * old, state.cache.num_pages * state.cache.page_size) if old < bound else old
        p = plans[key] = make_plan(lens, Hq, Hkv, D, q_len=Sq, num_splits=state.num_splits,
                                   max_seqlen=max(bound, grown),
                                   backend=state.backend, paged=True, dtype=dtype, kv_dtype=kv_dtype, **var)
    elif key not in state.refreshed:  # once per step: the split table for these lengths, on the device
        p.refresh(lens)
    state.refreshed.add(key)
    return p


def register() -> str:
    """Register "splitkv" in transformers' AttentionInterface (idempotent); returns the name."""
    _transformers()
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, splitkv_attention)
    return ATTN_NAME


@contextlib.contextmanager
def use_splitkv(model):
    """Within the block, the model's attention is splitkv's (restored on exit)."""
    register()
    old = model.config._attn_implementation
    _set_attention(model, ATTN_NAME)
    try:
        yield model
    finally:
        _set_attention(model, old)


def _set_attention(model, name) -> None:
    if name == model.config._attn_implementation:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: one config object shared by every layer
        model.config._attn_implementation = name


def _cache_kwarg(model) -> str:
    """transformers renamed forward's `past_key_values` to `cache` (5.2x, old name deprecated)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def _layer_kv(cache, layer: int):
    if hasattr(cache, "layers"):  # transformers >= 4.56: DynamicCache.layers[l].keys / .values
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _model_dims(model):
    cfg = model.config
    Hq = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or Hq
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    if not head_dim_ok(D):
        raise ValueError(f"model: head dim {D} is not supported by splitkv (expected {HEAD_DIM_RULE})")
    return Hkv, D, cfg.num_hidden_layers


def check_token_ids(model, ids: torch.Tensor) -> None:
    """Integer ids inside the model's vocabulary (one host read of min / max per prompt)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"input_ids: expected integer token ids, got dtype {ids.dtype}")
    vocab = model.get_input_embeddings().num_embeddings
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids: token ids must be in [0, {vocab}) (the model's vocabulary), got [{lo}, {hi}]")


def _prompt_lengths(input_ids, attention_mask):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a 2-D tensor [B, S], got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    B, S = input_ids.shape
    if B == 0 or S == 0:
        raise ValueError(f"input_ids: expected at least one row and one token, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.full((B,), S, dtype=torch.long, device=input_ids.device)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} like input_ids, "
                         f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask: expected only 0 (padding) and 1 (token) entries")
    n = attention_mask.long().sum(-1)
    left = attention_mask.long().flip(-1).cumprod(-1).sum(-1)  # trailing ones of each row
    if bool((left != n).any()) or bool((n == 0).any()):
        raise ValueError("attention_mask: expected left padding (each row: zeros, then at least one 1, "
                         "then only ones), as for transformers' generate with decoder-only models")
    return n


def decode_backend(backend: str, model_dtype: torch.dtype, device: torch.device) -> str:
    """The backend a model's decode asks for: 'auto' is 'torch' for an fp32 model on a GPU (the GPU
    kernels take fp16/bf16 only)."""
    return "torch" if backend == "auto" and model_dtype == torch.float32 and device.type == "cuda" else backend


def _kv_cache_dtype(kv_cache_dtype, model_dtype) -> torch.dtype:
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    if kv_cache_dtype is None or kv_cache_dtype == model_dtype or kv_cache_dtype in FP8_DTYPES:
        return kv_cache_dtype or model_dtype
    raise ValueError(f"kv_cache_dtype: expected one of {list(KV_CACHE_DTYPES)}, a float8 dtype or the model's "
                     f"dtype {model_dtype}, got {kv_cache_dtype!r}")


def _fp8_scales(dyn, num_layers: int, lengths: list[int], dtype: torch.dtype):
    """(k_scale, v_scale) float32 [num_layers, Hkv]: each layer's and KV head's largest |value|
    over the prompt's real tokens / (the fp8 dtype's largest value / FP8_HEADROOM)."""
    top = torch.finfo(dtype).max / FP8_HEADROOM
    S = max(lengths)
    dev = _layer_kv(dyn, 0)[0].device
    pad = (torch.arange(S, device=dev)[None, :] < S - torch.tensor(lengths, device=dev)[:, None])[:, None, :]
    out = []
    for which in (0, 1):
        amax = []
        for layer in range(num_layers):
            x = _layer_kv(dyn, layer)[which]  # [B, Hkv, S, D], left-padded
            a = x.float().abs().amax(-1).masked_fill(pad, 0.0)  # padding never counts
            amax.append(a.amax(dim=(0, 2)))
        out.append((torch.stack(amax) / top).clamp(min=torch.finfo(torch.float32).tiny).float())
    return out


@torch.no_grad()
def prefill(model, input_ids, attention_mask=None, *, max_new_tokens=0, page_size=64, backend="auto",
            num_splits=None, kv_cache_dtype="auto", cuda_graph=True):
    """Run the prompt through the model's own attention; returns (DecodeState, last-token logits
    [B, vocab]). The state's PagedKVCache has room for max_new_tokens more tokens per request.
    kv_cache_dtype: "auto" (the model's dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2" (or the torch
    dtype): an fp8 cache, half the KV bytes of bf16, with per layer and KV head scales taken from
    the prompt (FP8_HEADROOM). cuda_graph: on a GPU, decode steps replay CUDA graphs of the whole
    model step (hf_graph; ignored on a CPU and for the torch backend); "compile": graphs whose
    norms and MLPs run through torch.compile (compiled at the first step of each batch bucket)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    _check_cuda_graph(cuda_graph)
    model_dtype = next(model.parameters()).dtype
    cache_dtype = _kv_cache_dtype(kv_cache_dtype, model_dtype)
    transformers = _transformers()
    Hkv, D, num_layers = _model_dims(model)
    n = _prompt_lengths(input_ids, attention_mask)
    check_token_ids(model, input_ids)
    B, S = input_ids.shape
    lengths = n.tolist()
    if attention_mask is None:
        position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
    else:  # transformers' generate: cumsum of the mask (padding positions are never attended)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    # no config: every layer keeps all its K/V (given a config, transformers keeps only the last
    # `sliding_window` tokens of a sliding layer, and the paged cache needs every token of every layer)
    dyn = transformers.DynamicCache()
    kw = {_cache_kwarg(model): dyn}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **kw)
    logits = out.logits[:, -1]

    dtype = model_dtype
    pages = sum(-(-(L + max_new_tokens) // page_size) for L in lengths) + B
    scales = {}
    if cache_dtype in FP8_DTYPES:
        k_scale, v_scale = _fp8_scales(dyn, num_layers, lengths, cache_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    cache = PagedKVCache(pages, page_size, Hkv, D, num_layers=num_layers, dtype=cache_dtype,
                         device=input_ids.device, **scales)
    ids = [cache.add_sequence() for _ in range(B)]
    for layer in range(num_layers):
        k, v = _layer_kv(dyn, layer)  # [B, Hkv, S, D], left-padded
        for b, sid in enumerate(ids):
            cache.append([sid], k[b:b + 1, :, S - lengths[b]:].transpose(1, 2),
                         v[b:b + 1, :, S - lengths[b]:].transpose(1, 2), layer=layer)
    del dyn, out
    state = DecodeState(cache, ids, n.clone(), decode_backend(backend, dtype, input_ids.device), num_splits)
    use_graphs(model, state, cuda_graph)
    return state, logits


def _check_cuda_graph(cuda_graph) -> None:
    if not isinstance(cuda_graph, bool) and cuda_graph != "compile":
        raise TypeError(f"cuda_graph: expected a bool or 'compile', got {cuda_graph!r}")


def use_graphs(model, state: DecodeState, cuda_graph: bool | str) -> None:
    """Route the state's decode steps through CUDA graphs when cuda_graph is true and they apply
    (a CUDA cache, a GPU kernel backend); cuda_graph="compile" also runs the model's norms and MLPs
    through torch.compile inside the graphs (hf_graph)."""
    _check_cuda_graph(cuda_graph)
    if cuda_graph and state.cache.device.type == "cuda" and state.backend != "torch":
        from .hf_graph import GraphSteps

        state.graphs = GraphSteps(model, state, compile=cuda_graph == "compile")
    elif cuda_graph and state.cache.device.type == "cuda":
        logging.getLogger("splitkv").warning("cuda_graph: the torch backend's decode steps run eagerly")


@torch.no_grad()
def decode_step(model, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one new token per request ([B] or [B, 1]) through the model with splitkv attention;
    returns the next-token logits [B, vocab]. Call inside `use_splitkv(model)` to skip switching
    the attention implementation at every step. A state made with cuda_graph=True (prefill's
    default on a GPU) replays the step as a CUDA graph (hf_graph)."""
    tokens = tokens.reshape(-1, 1)
    if tokens.shape[0] != len(state.seq_ids):
        raise ValueError(f"tokens: expected one token per request ({len(state.seq_ids)}), "
                         f"got {tokens.shape[0]}")
    if state.graphs is not None:
        return state.graphs(tokens)
    kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    state.refreshed.clear()
    ctx = use_splitkv(model) if model.config._attn_implementation != ATTN_NAME else contextlib.nullcontext()
    token = _ACTIVE.set(state)
    try:
        with ctx:
            out = model(input_ids=tokens, position_ids=state.positions[:, None], use_cache=False, **kw)
    finally:
        _ACTIVE.reset(token)
    state.positions += 1
    return out.logits[:, -1]


_DEFAULT = object()  # "take it from model.generation_config" (None means none, as in generate)


def _eos_pad(model, eos_token_id, pad_token_id):
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if eos_token_id is _DEFAULT else eos_token_id
    if isinstance(eos, int):
        eos = [eos]
    pad = getattr(gen, "pad_token_id", None) if pad_token_id is _DEFAULT else pad_token_id
    if pad is None and eos:
        pad = eos[0]  # transformers' generate does the same (with a warning)
    return (list(eos) if eos else None), pad


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, *, attention_mask=None, eos_token_id=_DEFAULT,
             pad_token_id=_DEFAULT, page_size=64, backend="auto", num_splits=None, output_logits=False,
             kv_cache_dtype="auto", cuda_graph=True):
    """Greedy generation whose every decode step runs through splitkv; returns token ids
    [B, S + new] like `model.generate(input_ids, attention_mask=..., max_new_tokens=...,
    do_sample=False)` (prompt included; finished rows padded with pad_token_id; stops early when
    every row has produced an EOS). eos_token_id / pad_token_id default to model.generation_config's;
    an explicit None means none, as in generate. output_logits=True also returns the logits
    [B, new, vocab]. kv_cache_dtype, cuda_graph: see prefill ("fp8_e4m3": an fp8 paged cache;
    cuda_graph: decode steps replayed as CUDA graphs on a GPU)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    eos, pad = _eos_pad(model, eos_token_id, pad_token_id)
    if pad is not None:
        if (as_pad := validate.as_int(pad)) is None:
            raise TypeError(f"pad_token_id: expected None or an int token id, got {pad!r}")
        pad = as_pad
    state, logits = prefill(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                            page_size=page_size, backend=backend, num_splits=num_splits,
                            kv_cache_dtype=kv_cache_dtype, cuda_graph=cuda_graph)
    eos_t = torch.tensor(eos, device=input_ids.device) if eos else None
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    new, seen = [], []
    try:
        with use_splitkv(model):
            for step in range(max_new_tokens):
                seen.append(logits)
                tok = logits.argmax(-1)
                if eos_t is not None:
                    tok = torch.where(unfinished, tok, pad)
                    unfinished &= ~torch.isin(tok, eos_t)
                new.append(tok)
                if step + 1 == max_new_tokens or (eos_t is not None and not bool(unfinished.any())):
                    break
                logits = decode_step(model, state, tok)
    finally:
        state.free()
    ids = torch.cat((input_ids, torch.stack(new, 1).to(input_ids.dtype)), 1)
    return (ids, torch.stack(seen, 1)) if output_logits else ids
