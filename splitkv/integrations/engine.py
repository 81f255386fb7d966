"""Continuous batching for Hugging Face Llama-family models: requests join and leave at any step.

    engine = Engine(model, num_pages=4096, page_size=64)
    a = engine.add_request(prompt_ids, max_new_tokens=128)
    b = engine.add_request(other_ids, max_new_tokens=32)
    sys_ = engine.add_prefix(system_prompt_ids)          # prefilled once, its pages held
    c = engine.add_request(question_ids, 64, prefix=sys_)  # attends system prompt + question
    for rid, token, done in engine.stream():   # or: outputs = engine.run()
        ...

Why an engine of our own and not transformers' continuous batching: `generate_batch` /
ContinuousBatchingManager call their attention implementations with their own paged-cache layout
and scheduler state; splitkv's attention function needs its PagedKVCache (pages shared by every
layer, block tables built once per step). So the engine owns one PagedKVCache and runs:
  * prefill — each request through the model's own attention, alone (no padding), in chunks of
    `prefill_chunk` tokens: one chunk per step, so a long prompt does not stall the decoding
    requests for its whole prefill; when the prompt is done its K/V are copied into the paged cache
    and its first token is emitted;
  * decode — one token for every active request per step, through splitkv (integrations.hf's
    attention function over the shared cache), greedy or sampled per request;
  * finish — at an EOS token or max_new_tokens; the request's pages go back to the pool at once.
Shared prefixes: add_prefix(ids) prefills a prompt prefix (a system prompt) once and holds its
pages; add_request(suffix, prefix=handle) forks them (PagedKVCache.fork: the full pages shared, the
partial last one copied on write) and prefills only the suffix, over the prefix's K/V read back from
the pool. remove_prefix(handle) lets the pages go once no waiting request still needs them.
Attention switching: the model runs prefill with its own attention implementation and decode with
"splitkv"; switching costs ~2 ms on a 32-layer model (transformers re-walks its modules), so the
engine switches only when a step's work needs the other one (a decode-only step switches nothing)
and gives the model back its own implementation whenever no request is left.
Memory policy: a request is admitted only when the pool's free pages, less what the admitted
requests may still claim, cover its prompt plus max_new_tokens; otherwise it waits in the queue
(first come, first served). A running request therefore never meets a full pool. A request that
could never fit the pool is refused by add_request.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

import torch

from .. import validate
from ..cache import CacheFullError, PagedKVCache
from ..reference import _dequant, gather_keys
from . import hf


@dataclass
class _Prefix:
    ids: torch.Tensor  # int64 [P] on the model's device
    sid: int  # its sequence in the paged cache (holds its pages until it is removed)
    removed: bool = False


@dataclass
class _Request:
    rid: int
    prompt: torch.Tensor  # int64 [S] on the model's device
    max_new_tokens: int
    eos: list[int] | None
    pages: int  # pages the whole request may hold (prompt + max_new_tokens)
    done_prefill: int = 0  # prompt tokens prefilled
    dyn: object = None  # the DynamicCache of an unfinished prefill
    sid: int | None = None  # its sequence in the paged cache, once prefilled
    position: int = 0  # the next token's position
    last: int | None = None  # the last token emitted (the next decode input)
    out: list[int] = field(default_factory=list)
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    generator: torch.Generator | None = None  # the request's own random stream (seeded)
    followers: list = field(default_factory=list)  # the other samples of its prompt (add_request n > 1)
    shared: int = 0  # a follower: the prompt's full pages it shares with its leader (not its own)
    follower: bool = False  # sample i > 0 of an n > 1 request (forked from the first after prefill)
    family: object = None  # decode rows that share pages: the n samples' first id, or a prefix's handle
    group_pages: int = 0  # the full pages its family shares (the prompt's, or the prefix's)
    prefix: _Prefix | None = None  # add_request(prefix=...): forked from its sequence after the prefill

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from logits [vocab]: greedy, or sampled from softmax(logits / temperature)
        restricted to the top_k tokens and the smallest set whose probability reaches top_p."""
        if self.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, -1)
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # the token that crosses top_p stays
        if self.top_k:
            keep[self.top_k:] = False
        sorted_p = sorted_p * keep
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self.generator)])


def _promote(lead: _Request) -> _Request:
    """The first follower of a cancelled, not yet prefilled lead, in its place: the prompt's whole
    page count, its prefill progress and the other followers."""
    new, rest = lead.followers[0], lead.followers[1:]
    new.pages, new.shared, new.follower, new.followers = lead.pages, lead.shared, False, rest
    new.dyn, new.done_prefill = lead.dyn, lead.done_prefill
    return new


class Engine:
    """Continuous-batching greedy decode of a Llama-family model (module docstring).

    num_pages / page_size: the paged KV pool (every layer's K/V of one token share a slot);
    prefill_chunk: prompt tokens prefilled per step; backend, kv_cache_dtype, cuda_graph: as in
    hf.generate (on a GPU each decode step replays a CUDA graph of the whole model step, one per
    batch-size bucket: hf_graph). share_prefix=True: the decode steps attend the prompt prefix that
    the n samples of a request (or the requests on one add_prefix prefix) share once for all of
    them (cascade.group_prefix_decode, merged with each sample's own keys) instead of once per
    sample; with the fixed-shape / graph steps only (a GPU). Off by default: on an H100 it measured
    1.36x the plain step at n=16 of a 32K prompt, 1.01x at 8K and 0.88x at 2K, where the plain
    step's reads of the shared pages hit the L2 (benchmarks/probes/probe_share_prefix.py).
    An fp8 pool's scales (k_scale, v_scale: a float, or float32 [num_layers, Hkv]) are fixed when
    it is made, before any prompt is seen: calibrate them offline for K/V with outlier channels
    (PagedKVCache). Not thread-safe."""

    def __init__(self, model, *, num_pages: int, page_size: int = 64, prefill_chunk: int = 2048,
                 backend: str = "auto", kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, cuda_graph: bool | str = True,
                 share_prefix: bool = False):
        for name, val in (("num_pages", num_pages), ("page_size", page_size), ("prefill_chunk", prefill_chunk)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        self.model = model
        Hkv, D, layers = hf._model_dims(model)
        model_dtype = next(model.parameters()).dtype
        dtype = hf._kv_cache_dtype(kv_cache_dtype, model_dtype)
        self.device = next(model.parameters()).device
        scales = dict(k_scale=k_scale, v_scale=v_scale) if dtype in hf.FP8_DTYPES else {}
        self.cache = PagedKVCache(num_pages, page_size, Hkv, D, num_layers=layers, dtype=dtype, device=self.device,
                                  **scales)
        self.prefill_chunk = prefill_chunk
        validate.check_backend(backend)  # here, not at the first decode step
        self._state = hf.DecodeState(self.cache, [], torch.zeros(0, dtype=torch.long, device=self.device),
                                     hf.decode_backend(backend, model_dtype, self.device))
        hf.use_graphs(model, self._state, cuda_graph)
        if not isinstance(share_prefix, bool):
            raise TypeError(f"share_prefix: expected a bool, got {share_prefix!r}")
        self.share_prefix = share_prefix
        if share_prefix and self._state.graphs is None:
            logging.getLogger("splitkv").warning(
                "share_prefix: shared prefixes are decoded once per group by the CUDA-graph steps only (a GPU, "
                "cuda_graph on, a GPU backend); here every row reads its whole prompt")
        self._queue: deque[_Request] = deque()
        self._prefilling: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._dropped: set[int] = set()  # ids cancelled during the current step's stream() tokens
        self._next = 0
        self._prefixes: dict[int, _Prefix] = {}
        self._next_prefix = 0
        self._transformers = hf._transformers()
        hf.register()
        self._own = model.config._attn_implementation
        if self._own == hf.ATTN_NAME:
            raise ValueError("model: its attention implementation is already 'splitkv'; the engine needs the "
                             "model's own one for prefill")

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids, max_new_tokens: int, *, eos_token_id=hf._DEFAULT, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None, n: int = 1,
                    prefix: int | None = None) -> int | list[int]:
        """Queue a request (a 1-D prompt of token ids); returns its id. eos_token_id as in
        hf.generate (default: the model's generation_config). temperature 0 (default): greedy;
        otherwise sampling from softmax(logits / temperature), cut to top_k tokens (0: all) and to
        the nucleus of probability top_p, from the request's own generator (seed: reproducible,
        whatever else is in the batch).
        n > 1: n samples of the prompt (ids returned as a list; sample i seeded seed + i), which
        prefill it once and share its pages (PagedKVCache.fork: copy on write of the last,
        partial page).
        prefix: a handle from add_prefix: input_ids continue that prefix (positions after it); the
        request shares its pages and prefills input_ids only."""
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"input_ids: expected a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        hf.check_token_ids(self.model, ids)  # once per request, on its prompt
        ids = ids.to(device=self.device, dtype=torch.long)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: expected an int >= 1 (samples of the prompt), got {n!r}")
        pre = self._prefix(prefix)
        if pre is not None:
            ids = torch.cat([pre.ids, ids])
        ps, S, P = self.cache.page_size, ids.numel(), pre.ids.numel() if pre is not None else 0
        pages = math.ceil((S + max_new_tokens) / ps) - P // ps  # past the prefix's full pages
        own = math.ceil((S + max_new_tokens) / ps) - S // ps  # a follower's pages: past the prompt's full ones
        need = pages + (n - 1) * own + math.ceil(P / ps)  # the prefix holds its pages until the request forks
        if need > self.cache.num_pages:
            raise ValueError(f"max_new_tokens: prompt ({S}) + max_new_tokens ({max_new_tokens}) x n ({n}) need "
                             f"{need} pages, the pool has {self.cache.num_pages}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature: expected a float >= 0 (0 = greedy), got {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = no cut), got {top_k!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1], got {top_p!r}")
        if not math.isfinite(temperature):
            raise ValueError(f"temperature: expected a finite float >= 0 (0 = greedy), got {temperature!r}")
        if seed is not None:
            if (as_seed := validate.as_int(seed)) is None:
                raise TypeError(f"seed: expected None or an int, got {seed!r}")
            seed = as_seed
        eos, _ = hf._eos_pad(self.model, eos_token_id, None)
        group = []
        for i in range(n):
            gen = None
            if temperature > 0:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed + i) if seed is not None else gen.seed()
            group.append(_Request(self._next, ids, max_new_tokens, eos, pages if i == 0 else own,
                                  temperature=float(temperature), top_k=top_k, top_p=float(top_p), generator=gen,
                                  shared=P // ps if i == 0 else S // ps, follower=i > 0, done_prefill=P,
                                  family=self._next - i if n > 1 else (("prefix", id(pre)) if pre else None),
                                  group_pages=S // ps if n > 1 else P // ps, prefix=pre))
            self._next += 1
        group[0].followers = group[1:]
        self._queue.append(group[0])
        return group[0].rid if n == 1 else [r.rid for r in group]

    @torch.no_grad()
    def add_prefix(self, input_ids) -> int:
        """Prefill a prompt prefix (a shared system prompt) now, through the model's own attention,
        and hold its pages; returns a handle for add_request(..., prefix=handle). Runs at once (not
        one chunk per step): a long prefix delays the running requests' next step. Raises
        CacheFullError when the pool, less what admitted requests may still claim, cannot hold it."""
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"input_ids: expected a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        hf.check_token_ids(self.model, ids)
        ids = ids.to(device=self.device, dtype=torch.long)
        need = math.ceil(ids.numel() / self.cache.page_size)
        room = self.cache.num_free_pages - self._claimable()
        if need > room:
            raise CacheFullError(need, room)  # room: free pages less what admitted requests may claim
        hf._set_attention(self.model, self._own)
        dyn = self._transformers.DynamicCache()
        for a in range(0, ids.numel(), self.prefill_chunk):
            self._forward(ids, a, min(ids.numel(), a + self.prefill_chunk), dyn)
        sid = self._store(dyn, None, 0)
        handle = self._next_prefix
        self._next_prefix += 1
        self._prefixes[handle] = _Prefix(ids, sid)
        return handle

    def remove_prefix(self, handle: int) -> None:
        """Let a prefix's pages go: at once if no queued or prefilling request still needs them,
        otherwise when the last one has forked them. Requests already running keep what they share."""
        self._prefix(handle).removed = True
        self._release_prefixes()

    def _prefix(self, handle) -> _Prefix | None:
        if handle is None:
            return None
        pre = None if isinstance(handle, bool) else self._prefixes.get(validate.as_int(handle))
        if pre is None or pre.removed:
            raise ValueError(f"prefix: expected a handle from add_prefix that was not removed, got {handle!r}")
        return pre

    def _release_prefixes(self) -> None:
        waiting = {id(r.prefix) for lead in (*self._queue, *self._prefilling) for r in (lead, *lead.followers)}
        for h, pre in list(self._prefixes.items()):
            if pre.removed and id(pre) not in waiting:
                self.cache.free(pre.sid)
                del self._prefixes[h]

    def cancel(self, request_id: int) -> bool:
        """Stop a request now (a client went away, a deadline passed): a queued one leaves the queue,
        a prefilling or decoding one gives its pages back to the pool at once; the tokens it has
        emitted stay emitted and it emits no more. The samples of an n > 1 request are cancelled one
        by one: the others go on (one whose prompt is still prefilling takes the prefill over).
        Returns False for an id that is unknown or already finished. Between steps (also while
        iterating stream(), whose tokens of a step are all emitted before the next step runs)."""
        if not (self._drop_active(request_id) or self._drop_waiting(request_id)):
            return False
        self._dropped.add(request_id)
        self._release_prefixes()
        if not self.pending:
            hf._set_attention(self.model, self._own)
        return True

    def _drop_active(self, request_id: int) -> bool:
        for i, r in enumerate(self._active):
            if r.rid == request_id:
                self.cache.free(r.sid)
                r.sid = None
                del self._active[i]
                return True
        return False

    def _drop_waiting(self, request_id: int) -> bool:
        """Remove a queued or prefilling request (a lead or one of its followers)."""
        for waiting in (self._queue, self._prefilling):
            for i, lead in enumerate(waiting):
                if lead.rid == request_id:
                    if lead.followers:  # the next sample leads (and prefills) in its place
                        waiting[i] = _promote(lead)
                    else:
                        del waiting[i]
                    return True
                if any(f.rid == request_id for f in lead.followers):
                    lead.followers = [f for f in lead.followers if f.rid != request_id]
                    return True
        return False

    @property
    def queued(self) -> int:
        """Requests waiting for pool pages (not admitted yet)."""
        return sum(1 + len(r.followers) for r in self._queue)

    @property
    def pending(self) -> int:
        """Requests not finished (queued, prefilling or decoding)."""
        return self.queued + sum(1 + len(r.followers) for r in self._prefilling) + len(self._active)

    def _claimable(self) -> int:
        """Pages the admitted requests may still take from the pool."""
        claim = 0
        for r in (*(x for lead in self._prefilling for x in (lead, *lead.followers)), *self._active):
            held = 0
            n = self.cache.seq_len(r.sid) if r.sid is not None else 0
            if n > (r.prompt.numel() if r.follower else 0):  # a fresh fork holds only shared pages
                held = math.ceil(n / self.cache.page_size) - r.shared
            claim += r.pages - held
        return claim

    def _admit(self) -> None:
        while self._queue:
            lead = self._queue[0]
            if lead.pages + sum(f.pages for f in lead.followers) > self.cache.num_free_pages - self._claimable():
                break
            self._prefilling.append(self._queue.popleft())

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[tuple[int, int, bool]]:
        """Admit what fits, prefill one chunk, decode one token for every active request;
        returns (request id, token, finished) for each token emitted this step. An exception leaves
        the model with its own attention implementation (the engine's state is not recoverable)."""
        try:
            return self._step()
        except BaseException:
            hf._set_attention(self.model, self._own)
            raise

    def _step(self) -> list[tuple[int, int, bool]]:
        self._admit()
        if self._queue and not self._prefilling and not self._active:  # nothing running will free a page
            lead = self._queue[0]
            need = lead.pages + sum(f.pages for f in lead.followers)
            raise RuntimeError(f"request {lead.rid} needs {need} free pages, and with no request running the pool "
                               f"has {self.cache.num_free_pages}: the prefixes hold the rest (remove_prefix) or "
                               f"cancel it; it stays queued")
        emitted = []
        decoding = list(self._active)  # the requests prefilled before this step
        joined = []
        if self._prefilling:
            hf._set_attention(self.model, self._own)
            req = self._prefilling[0]
            logits = self._prefill_chunk(req)
            if logits is not None:  # its prompt is done: first tokens, and it decodes from the next step
                self._prefilling.popleft()
                for f in req.followers:  # the other samples share the prompt's pages
                    f.sid, f.position = self.cache.fork(req.sid), req.position
                joined = [req, *req.followers]
                emitted += [self._emit(r, r.pick(logits)) for r in joined]
                if req.prefix is not None:
                    self._release_prefixes()
        if decoding:
            hf._set_attention(self.model, hf.ATTN_NAME)  # no-op while it already is
            self._state.seq_ids = [r.sid for r in decoding]
            self._state.positions = torch.tensor([r.position for r in decoding], dtype=torch.long,
                                                 device=self.device)
            self._state.groups = self._groups(decoding) if self.share_prefix else None
            tokens = torch.tensor([r.last for r in decoding], dtype=torch.long, device=self.device)
            logits = hf.decode_step(self.model, self._state, tokens)
            greedy = logits.argmax(-1).tolist()
            for i, r in enumerate(decoding):
                r.position += 1
                emitted.append(self._emit(r, greedy[i] if r.temperature == 0 else r.pick(logits[i])))
        self._active = [r for r in (*decoding, *joined) if r.sid is not None]
        if not self.pending:
            hf._set_attention(self.model, self._own)
        return emitted

    def _groups(self, decoding: list[_Request]) -> list[tuple[list[int], int]]:
        """(batch rows, shared pages) of the samples of one prompt decoding together: the prompt's
        full pages, which fork shares and copy on write never touches."""
        rows: dict[object, list[int]] = {}
        for i, r in enumerate(decoding):
            if r.family is not None:
                rows.setdefault(r.family, []).append(i)
        return [(rs, decoding[rs[0]].group_pages) for rs in rows.values()
                if len(rs) > 1 and decoding[rs[0]].group_pages >= 1]

    def _emit(self, req: _Request, tok: int) -> tuple[int, int, bool]:
        """Record req's new token; at its end, give its pages back to the pool."""
        req.out.append(tok)
        req.last = tok
        done = len(req.out) >= req.max_new_tokens or (req.eos is not None and tok in req.eos)
        if done:
            self.cache.free(req.sid)
            req.sid = None
        return req.rid, tok, done

    def _prefill_chunk(self, req: _Request) -> torch.Tensor | None:
        """Feed the next chunk of req's prompt through the model's own attention; when the prompt is
        done, copy its K/V into the paged cache and return the last position's logits [vocab]."""
        S = req.prompt.numel()
        if req.dyn is None:
            req.dyn = self._transformers.DynamicCache()
            if req.prefix is not None:  # the prefix's K/V, read back from its pages
                self._load_prefix(req.prefix, req.dyn)
        a, b = req.done_prefill, min(S, req.done_prefill + self.prefill_chunk)
        out = self._forward(req.prompt, a, b, req.dyn)
        req.done_prefill = b
        if b < S:
            return None
        req.sid = self._store(req.dyn, req.prefix, req.prefix.ids.numel() if req.prefix is not None else 0)
        req.dyn = None
        req.position = S
        return out.logits[0, -1]

    def _forward(self, ids: torch.Tensor, a: int, b: int, dyn):
        """The model's own forward over ids[a:b] at positions a..b-1, after dyn's keys."""
        return self.model(input_ids=ids[None, a:b], position_ids=torch.arange(a, b, device=self.device)[None],
                          use_cache=True, **{hf._cache_kwarg(self.model): dyn})

    def _store(self, dyn, prefix: _Prefix | None, start: int) -> int:
        """A sequence holding dyn's K/V from position start on: a new one, or a fork of prefix's."""
        sid = self.cache.add_sequence() if prefix is None else self.cache.fork(prefix.sid)
        for layer in range(self.cache.num_layers):
            k, v = hf._layer_kv(dyn, layer)  # [1, Hkv, S, D]
            self.cache.append([sid], k[:, :, start:].transpose(1, 2), v[:, :, start:].transpose(1, 2), layer=layer)
        return sid

    def _load_prefix(self, prefix: _Prefix, dyn) -> None:
        """dyn gets the prefix's K/V [1, Hkv, P, D] per layer (dequantised from an fp8 pool)."""
        c, P = self.cache, prefix.ids.numel()
        table, _ = c.batch([prefix.sid])
        dtype = next(self.model.parameters()).dtype
        fp8 = c.dtype in hf.FP8_DTYPES
        for layer in range(c.num_layers):
            k, v = (gather_keys(pool, 0, P, table) for pool in (c.k_pages(layer), c.v_pages(layer)))
            k = _dequant(k, c.k_scale(layer) if fp8 else None, dtype)
            v = _dequant(v, c.v_scale(layer) if fp8 else None, dtype)
            dyn.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer)

    # ------------------------------------------------------------------ loops
    def stream(self):
        """Yield (request id, token, finished) until every request has finished (a cancelled
        one's tokens stop at its cancel, without a finished one)."""
        while self.pending:
            self._dropped.clear()
            for item in self.step():
                if item[0] not in self._dropped:  # cancelled while this step's tokens were yielded
                    yield item

    def run(self) -> dict[int, list[int]]:
        """Run every request to the end; returns request id -> generated token ids."""
        outs: dict[int, list[int]] = {}
        for rid, tok, _ in self.stream():
            outs.setdefault(rid, []).append(tok)
        return outs
