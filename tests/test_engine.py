"""splitkv.integrations.engine on a randomly initialised tiny Llama (CPU, fp32): requests joining
and leaving mid-run get exactly the tokens they get alone; chunked prefill interleaves with decode;
a full pool queues requests and every page comes back."""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from test_hf import _model  # noqa: E402

from splitkv.integrations import engine as E  # noqa: E402
from splitkv.integrations import hf  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return _model(tf)


def _prompt(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _alone(model, ids, new):
    return hf.generate(model, ids[None], new, eos_token_id=None)[0, ids.numel():].tolist()


def test_requests_joining_and_leaving_get_their_solo_tokens(model):
    prompts = [_prompt(37, 1), _prompt(300, 2), _prompt(5, 3), _prompt(130, 4)]
    new = [10, 6, 12, 3]
    eng = E.Engine(model, num_pages=64, page_size=16, prefill_chunk=64)
    rids = [eng.add_request(prompts[i], new[i], eos_token_id=None) for i in (0, 1)]
    outs: dict[int, list[int]] = {}
    log = []
    for step in range(200):
        if step == 3:  # two more join while the first ones run (request 1 still prefilling)
            rids += [eng.add_request(prompts[i], new[i], eos_token_id=None) for i in (2, 3)]
        if not eng.pending:
            break
        for rid, tok, done in eng.step():
            outs.setdefault(rid, []).append(tok)
            log.append((step, rid, done))
    assert not eng.pending
    for rid, ids, n in zip(rids, prompts, new, strict=True):
        assert outs[rid] == _alone(model, ids, n), rid
    # request 0 decoded while request 1's 300-token prompt was prefilled in 64-token chunks
    first_of_1 = min(s for s, r, _ in log if r == rids[1])
    assert sum(1 for s, r, _ in log if r == rids[0] and s < first_of_1) >= 3
    assert eng.cache.num_free_pages == eng.cache.num_pages  # every page back


def test_a_full_pool_queues_requests_and_leaks_no_page(model):
    eng = E.Engine(model, num_pages=6, page_size=16)  # one request of <= 96 tokens at a time
    prompts = [_prompt(60, 5), _prompt(50, 6), _prompt(40, 7)]
    rids = [eng.add_request(p, 20, eos_token_id=None) for p in prompts]
    first = eng.step()  # request 0 prefilled (its first token); the others wait for pages
    assert [(r, d) for r, _, d in first] == [(rids[0], False)] and eng.queued == 2 and eng.pending == 3
    outs = eng.run()
    outs[rids[0]] = [first[0][1]] + outs[rids[0]]
    assert [outs[r] for r in rids] == [_alone(model, p, 20) for p in prompts]
    assert eng.cache.num_free_pages == 6


def test_eos_ends_a_request_early(model):
    ids = _prompt(40, 8)
    solo = _alone(model, ids, 12)
    eos = solo[4]
    eng = E.Engine(model, num_pages=16, page_size=16)
    rid = eng.add_request(ids, 12, eos_token_id=eos)
    out = eng.run()[rid]
    assert out == solo[: solo.index(eos) + 1]
    assert eng.cache.num_free_pages == 16


def test_bad_requests_are_named(model):
    eng = E.Engine(model, num_pages=4, page_size=16)
    with pytest.raises(ValueError, match="input_ids"):
        eng.add_request(torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request(_prompt(5, 9), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):  # 60 + 10 tokens need 5 pages of 16
        eng.add_request(_prompt(60, 9), 10)
    with pytest.raises(ValueError, match="num_pages"):
        E.Engine(model, num_pages=0)
    vocab = model.get_input_embeddings().num_embeddings
    for bad in ([1, 2, vocab], [-1, 2]):  # would fail every later step of the engine, not this call
        with pytest.raises(ValueError, match=r"input_ids: token ids must be in \[0, "):
            eng.add_request(bad, 4)
    with pytest.raises(ValueError, match="input_ids: expected a non-empty"):
        eng.add_request([], 4)
    for bad in ([1.5, 2.0], torch.tensor([True, False])):
        with pytest.raises(TypeError, match="input_ids: expected integer token ids"):
            eng.add_request(bad, 4)
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request(_prompt(5, 9), 4, temperature=float("inf"))
    for bad in ("abc", -1.0, True):  # -1.0: not an int either (as_int's old -1 sentinel let it through)
        with pytest.raises(TypeError, match="seed"):
            eng.add_request(_prompt(5, 9), 4, temperature=1.0, seed=bad)
    with pytest.raises(ValueError, match="backend"):  # at construction, not at the first decode step
        E.Engine(model, num_pages=4, backend="nope")
    assert eng.queued == 0


def test_a_failed_step_gives_the_model_its_attention_back(model, monkeypatch):
    eng = E.Engine(model, num_pages=16, page_size=16, backend="torch")
    own = model.config._attn_implementation
    eng.add_request(_prompt(7, 3), 4, eos_token_id=None)
    eng.step()  # the prefill
    monkeypatch.setattr(hf, "decode_step", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        eng.step()
    assert model.config._attn_implementation == own
    E.Engine(model, num_pages=4)  # the model is usable again


def test_decode_only_steps_do_not_switch_attention(model, monkeypatch):
    """Switching the model's attention implementation re-walks its modules: only a step whose work
    needs the other implementation switches; the model gets its own back when the engine is idle."""
    switches = []
    real = hf._set_attention

    def counted(m, name):
        if name != m.config._attn_implementation:
            switches.append(name)
        real(m, name)

    monkeypatch.setattr(hf, "_set_attention", counted)
    eng = E.Engine(model, num_pages=16, page_size=16)
    eng.add_request(_prompt(30, 10), 8, eos_token_id=None)
    eng.step()  # prefill only
    eng.step()  # decode: one switch to splitkv
    n = len(switches)
    for _ in range(5):
        eng.step()  # decode only: no switch
    assert len(switches) == n == 1 and switches == [hf.ATTN_NAME]
    eng.run()
    assert model.config._attn_implementation == "sdpa" and switches[-1] == "sdpa"


def test_fp8_pool(model):
    """An fp8 pool with calibrated per layer / KV head scales: runs to the end, pages come back, and
    the tokens mostly follow the fp32 cache's (e4m3 rounding can flip a near-tie)."""
    ids = _prompt(50, 11)
    scales = torch.full((model.config.num_hidden_layers, model.config.num_key_value_heads), 0.02)
    eng = E.Engine(model, num_pages=8, page_size=16, kv_cache_dtype="fp8_e4m3", k_scale=scales, v_scale=scales)
    assert eng.cache.dtype == torch.float8_e4m3fn
    rid = eng.add_request(ids, 10, eos_token_id=None)
    out, solo = eng.run()[rid], _alone(model, ids, 10)
    assert len(out) == 10 and out[0] == solo[0]  # the first token comes from the model's own prefill
    assert sum(a == b for a, b in zip(out, solo, strict=True)) >= 5, (out, solo)
    assert eng.cache.num_free_pages == 8
    # a prefix on the fp8 pool: the suffix's prefill reads its K/V dequantised (per layer and head)
    scales = scales.clone()
    scales[-1] = torch.linspace(0.03, 0.05, model.config.num_key_value_heads)
    eng = E.Engine(model, num_pages=8, page_size=16, kv_cache_dtype="fp8_e4m3", k_scale=scales, v_scale=scales * 2)
    h = eng.add_prefix(ids[:40])
    dyn = tf.DynamicCache()
    eng._load_prefix(eng._prefixes[h], dyn)
    own = tf.DynamicCache()
    model(input_ids=ids[None, :40], use_cache=True, **{hf._cache_kwarg(model): own})
    for layer in range(model.config.num_hidden_layers):
        for got, want in zip(hf._layer_kv(dyn, layer), hf._layer_kv(own, layer), strict=True):
            assert got.shape == want.shape and (got - want).abs().max() <= 0.07 * want.abs().max()
    rid = eng.add_request(ids[40:], 6, eos_token_id=None, prefix=h)
    assert len(eng.run()[rid]) == 6
    eng.remove_prefix(h)
    assert eng.cache.num_free_pages == 8


def test_sampling_is_per_request_and_reproducible(model):
    """Sampled requests draw from their own seeded generator: the same tokens alone or next to
    others; top_k=1 and a tiny top_p are greedy; different seeds give different text."""
    ids = [_prompt(30, 12), _prompt(70, 13)]

    def run(pairs, **kw):
        eng = E.Engine(model, num_pages=32, page_size=16)
        rids = [eng.add_request(ids[i], 12, eos_token_id=None, **kw, **extra) for i, extra in pairs]
        out = eng.run()
        return [out[r] for r in rids]

    alone = run([(0, dict(seed=1))], temperature=1.5)[0]
    together = run([(1, dict(seed=2)), (0, dict(seed=1))], temperature=1.5)
    assert together[1] == alone and alone != run([(0, dict(seed=3))], temperature=1.5)[0]
    greedy = _alone(model, ids[0], 12)
    assert run([(0, dict(seed=4, top_k=1))], temperature=2.0)[0] == greedy
    assert run([(0, dict(seed=5, top_p=1e-6))], temperature=2.0)[0] == greedy
    eng = E.Engine(model, num_pages=8, page_size=16)
    for kw, name in ((dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=name):
            eng.add_request(ids[0], 4, **kw)


def test_n_samples_share_the_prompt_pages(model):
    """n samples of one prompt: prefilled once, its pages shared (forked), each sample the tokens it
    gets as a request of its own with its seed; the pool accounting leaves no page behind."""
    ids = _prompt(40, 14)  # 2 full pages of 16 + a partial one
    eng = E.Engine(model, num_pages=32, page_size=16)
    rids = eng.add_request(ids, 8, eos_token_id=None, temperature=1.5, seed=20, n=3)
    first = eng.step()  # the prefill: one sequence's pages, three first tokens
    assert [r for r, _, _ in first] == rids and eng.cache.num_free_pages == 32 - 3
    outs = eng.run()
    for i, rid in enumerate(rids):
        solo = E.Engine(model, num_pages=32, page_size=16)
        r = solo.add_request(ids, 8, eos_token_id=None, temperature=1.5, seed=20 + i)
        assert [t for x, t, _ in first if x == rid] + outs[rid] == solo.run()[r], i
    assert eng.cache.num_free_pages == 32
    # a pool that fits the group only thanks to sharing: 2 shared pages + 3 x the page holding
    # tokens 32..47 (8 of the prompt, 8 new) = 5 pages (9 unshared)
    tight = E.Engine(model, num_pages=5, page_size=16)
    group = tight.add_request(ids, 8, eos_token_id=None, n=3)
    out = tight.run()
    assert all(out[g] == _alone(model, ids, 8) for g in group) and tight.cache.num_free_pages == 5
    with pytest.raises(ValueError, match="max_new_tokens"):
        tight.add_request(ids, 8, n=4)
    with pytest.raises(ValueError, match="n:"):
        tight.add_request(ids, 8, n=0)


def test_samples_of_a_prompt_shorter_than_a_page_are_not_overcommitted(model):
    """A 5-token prompt with n = 3 and page 16: the samples' own pages (the copy of the shared
    partial page) count as claimed from admission on, so a request that would take them waits in
    the queue instead of failing a running sample's copy on write."""
    eng = E.Engine(model, num_pages=4, page_size=16, backend="torch")
    group = eng.add_request(_prompt(5, 21), 4, eos_token_id=None, n=3)  # 3 pages in all
    eng.step()  # the prefill: one page held, two more claimed
    late = eng.add_request(_prompt(20, 22), 10, eos_token_id=None)  # 2 pages: must wait
    assert eng._claimable() == 2 and eng.queued == 1
    out = eng.run()
    assert len(out[late]) == 10 and all(len(out[g]) == 3 for g in group)  # + the prefill step's token
    assert eng.cache.num_free_pages == 4


def test_cancel_stops_a_request_and_returns_its_pages(model):
    """Engine.cancel: a decoding request stops at once (its tokens so far are a prefix of what it
    gets alone) and its pages go back; a queued one never runs; the others are untouched; an
    unknown or finished id is refused; with nothing left the model has its own attention back."""
    a, b, c = _prompt(37, 30), _prompt(50, 31), _prompt(20, 32)
    eng = E.Engine(model, num_pages=8, page_size=16, prefill_chunk=64)  # a and b fit (4 pages each), c waits
    ra, rb, rc = (eng.add_request(p, 12, eos_token_id=None) for p in (a, b, c))
    outs: dict[int, list[int]] = {}
    for _ in range(4):
        for rid, tok, _ in eng.step():
            outs.setdefault(rid, []).append(tok)
    assert eng.queued == 1 and rb in outs
    free = eng.cache.num_free_pages
    assert eng.cancel(rb) and eng.cache.num_free_pages == free + 4  # its 51 cached tokens: 4 pages
    assert eng.cancel(rc) and eng.queued == 0
    assert not eng.cancel(rb) and not eng.cancel(999)
    for rid, tok, _ in eng.stream():
        outs.setdefault(rid, []).append(tok)
    assert outs[ra] == _alone(model, a, 12)
    assert outs[rb] == _alone(model, b, 12)[:len(outs[rb])] and len(outs[rb]) < 12
    assert rc not in outs and not eng.cancel(ra)  # finished
    assert eng.cache.num_free_pages == 8 and model.config._attn_implementation != hf.ATTN_NAME


def test_cancel_one_sample_of_a_prompt(model):
    """n = 3 samples: cancelling the first while the prompt still prefills hands the prefill to the
    next; cancelling another while it decodes stops only that one; the last gets its solo tokens."""
    ids = _prompt(70, 33)
    eng = E.Engine(model, num_pages=32, page_size=16, prefill_chunk=32)  # three prefill steps
    group = eng.add_request(ids, 6, eos_token_id=None, n=3)
    assert eng.step() == [] and eng.cancel(group[0])  # one chunk done
    outs: dict[int, list[int]] = {}
    for _ in range(3):
        for rid, tok, _ in eng.step():
            outs.setdefault(rid, []).append(tok)
    assert set(outs) == {group[1], group[2]}
    assert eng.cancel(group[1])
    for rid, tok, _ in eng.stream():
        outs.setdefault(rid, []).append(tok)
    solo = _alone(model, ids, 6)
    assert outs[group[2]] == solo and outs[group[1]] == solo[:len(outs[group[1]])] and len(outs[group[1]]) < 6
    assert eng.cache.num_free_pages == 32


def test_cancel_while_iterating_stream(model):
    """cancel() inside the stream() loop (the README's pattern): the request emits no token after
    the one that led to its cancel, not even one its last step already made (c is cancelled on
    a's token, before c's token of that step is yielded); the others run to their end; every page
    comes back."""
    a, b, c = _prompt(30, 34), _prompt(45, 35), _prompt(20, 36)
    eng = E.Engine(model, num_pages=16, page_size=16)
    ra, rb, rc = (eng.add_request(p, 9, eos_token_id=None) for p in (a, b, c))
    outs: dict[int, list[int]] = {}
    for rid, tok, _ in eng.stream():
        outs.setdefault(rid, []).append(tok)
        if rid == rb and len(outs[rb]) == 3:
            assert eng.cancel(rb)
        if rid == ra and len(outs[ra]) == 5:  # a's token comes before c's in a step: c's is dropped
            assert eng.cancel(rc)
            at_cancel = len(outs[rc])
    assert outs[ra] == _alone(model, a, 9) and outs[rb] == _alone(model, b, 9)[:3]
    assert 0 < at_cancel == len(outs[rc]) and outs[rc] == _alone(model, c, 9)[:at_cancel]
    assert eng.cache.num_free_pages == 16


def test_prefix_requests_get_the_tokens_of_their_whole_prompt(model):
    """add_prefix prefills a shared prefix once and holds its pages; requests continuing it (one
    joining later, one with n = 2 samples) get exactly the tokens of prefix + suffix run alone, and
    its pages go back once it is removed and its last user has finished."""
    ps, N = 16, 40
    pre_ids = _prompt(40, 30)  # 2 full pages + 8 tokens
    eng = E.Engine(model, num_pages=N, page_size=ps, prefill_chunk=32)
    h = eng.add_prefix(pre_ids)
    assert eng.cache.num_free_pages == N - 3 and not eng.pending
    suffixes = [_prompt(5, 31), _prompt(30, 32), _prompt(1, 33)]
    rids = [eng.add_request(suffixes[0], 6, eos_token_id=None, prefix=h),
            eng.add_request(suffixes[1], 4, eos_token_id=None, prefix=h)]
    outs: dict[int, list[int]] = {}
    for step in range(100):
        if step == 2:
            rids.append(eng.add_request(suffixes[2], 5, eos_token_id=None, prefix=h))
        if not eng.pending:
            break
        for rid, tok, _ in eng.step():
            outs.setdefault(rid, []).append(tok)
    assert not eng.pending
    for rid, suf, n in zip(rids, suffixes, (6, 4, 5), strict=True):
        assert outs[rid] == _alone(model, torch.cat([pre_ids, suf]), n), rid
    assert eng.cache.num_free_pages == N - 3  # the prefix still holds its pages
    pair = eng.add_request(suffixes[0], 5, eos_token_id=None, prefix=h, temperature=1.5, seed=7, n=2)
    eng.remove_prefix(h)  # a request still needs it: its pages stay until that one has forked them
    assert eng.cache.num_free_pages == N - 3
    with pytest.raises(ValueError, match="prefix: expected a handle"):
        eng.add_request(suffixes[0], 5, prefix=h)
    got = eng.run()
    for i, rid in enumerate(pair):
        solo = E.Engine(model, num_pages=N, page_size=ps)
        r = solo.add_request(torch.cat([pre_ids, suffixes[0]]), 5, eos_token_id=None, temperature=1.5, seed=7 + i)
        assert got[rid] == solo.run()[r], i
    assert eng.cache.num_free_pages == N  # prefix removed, every request done: every page back


def test_prefix_pages_are_shared_and_counted(model):
    """A pool that holds the requests only thanks to the shared prefix pages; a prefix the pool cannot
    hold, and handles that are not live, are refused by name."""
    ps = 16
    eng = E.Engine(model, num_pages=7, page_size=ps, backend="torch")
    h = eng.add_prefix(_prompt(64, 40))  # 4 full pages
    # each request: its own page (tokens 64..79: 3 of the suffix + 12 new), 3 x 1 + 4 = 7 pages
    rids = [eng.add_request(_prompt(3, 41 + i), 12, eos_token_id=None, prefix=h) for i in range(3)]
    first = eng.step()
    assert eng.queued == 0  # all three admitted at once
    out = eng.run()
    assert all(len(out[r]) + sum(x == r for x, _, _ in first) == 12 for r in rids)
    with pytest.raises(ValueError, match="max_new_tokens: prompt .* need 8 pages, the pool has 7"):
        eng.add_request(_prompt(3, 48), 60, prefix=h)  # 4 pages of its own while the prefix holds 4
    with pytest.raises(E.CacheFullError, match="needs 4 free pages"):
        eng.add_prefix(_prompt(64, 42))
    with pytest.raises(ValueError, match="prefix: expected a handle"):
        eng.add_request(_prompt(3, 43), 4, prefix=h + 1)
    with pytest.raises(ValueError, match="input_ids"):
        eng.add_prefix([])
    eng.remove_prefix(h)
    assert eng.cache.num_free_pages == 7
    with pytest.raises(ValueError, match="prefix: expected a handle"):
        eng.remove_prefix(h)
    # a request that fits the pool but not what the prefixes leave: step() says so instead of spinning
    h3 = eng.add_prefix(_prompt(64, 46))
    big = eng.add_request(_prompt(50, 47), 8, eos_token_id=None)  # 4 pages, 3 free
    with pytest.raises(RuntimeError, match=f"request {big} needs 4 free pages.*remove_prefix"):
        eng.step()
    eng.remove_prefix(h3)
    assert len(eng.run()[big]) == 8 and eng.cache.num_free_pages == 7
    # removed while its only user waits: the pages go when that request is cancelled
    h2 = eng.add_prefix(_prompt(20, 44))
    rid = eng.add_request(_prompt(3, 45), 4, eos_token_id=None, prefix=h2)
    eng.remove_prefix(h2)
    assert eng.cache.num_free_pages == 5 and eng.cancel(rid) and eng.cache.num_free_pages == 7


def test_share_prefix_without_graph_steps_says_so(model, caplog):
    """share_prefix needs the CUDA-graph steps: on the CPU the engine says it reads whole prompts."""
    with caplog.at_level("WARNING", logger="splitkv"):
        E.Engine(model, num_pages=4, page_size=16, share_prefix=True)
    assert any("share_prefix" in r.getMessage() for r in caplog.records)


def test_plans_keep_their_bound_as_the_batch_changes(model):
    """The eager steps' plan is rebuilt at every batch change: it keeps its length bound (doubling it
    at each change overflowed int32 after ~30 joins and leaves) and never exceeds the pool's tokens."""
    eng = E.Engine(model, num_pages=16, page_size=16, backend="torch")
    rids = []
    for i in range(40):  # a request joins every step, each leaves after 2 or 3 tokens: the batch churns
        rids.append(eng.add_request(_prompt(3 + i % 5, 60 + i), 2 + i % 2, eos_token_id=None))
        eng.step()
    out = eng.run()
    (plan,) = eng._state.plans.values()
    assert plan.max_seqlen <= 16 * 16
    assert all(len(out.get(r, [])) <= 3 for r in rids) and eng.cache.num_free_pages == 16
