"""Fixed-shape / CUDA-graph decode steps (splitkv.integrations.hf_graph) and the cache calls they
stand on (PagedKVCache.extend + write): on the CPU the fixed-shape step runs eagerly and must give
transformers' greedy tokens and logits (fp32), padded batches and changing membership included; on
the GPU (marked) the captured graphs must replay what the eager step computes."""

from __future__ import annotations

import pytest
import torch

from splitkv import CacheFullError, PagedKVCache

tf = pytest.importorskip("transformers")

from test_hf import NEW, S, _model, _prompt  # noqa: E402

from splitkv.integrations import engine as E  # noqa: E402
from splitkv.integrations import hf  # noqa: E402
from splitkv.integrations import hf_graph as G  # noqa: E402


def _cache(dtype=torch.float32, **kw):
    return PagedKVCache(24, 4, 2, 8, num_layers=2, dtype=dtype, device="cpu", backend="torch", **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_extend_then_write_equals_append(dtype):
    g = torch.Generator().manual_seed(0)
    scales = dict(k_scale=0.5, v_scale=2.0) if dtype != torch.float32 else {}
    a, b = _cache(dtype, **scales), _cache(dtype, **scales)
    prompt = [torch.randn(1, n, 2, 8, generator=g) for n in (5, 8, 3)]
    for c in (a, b):
        ids = [c.add_sequence() for _ in prompt]
        for layer in range(2):
            for sid, x in zip(ids, prompt, strict=True):
                c.append([sid], x, 2 * x, layer=layer)
        ids.append(c.fork(ids[0]))  # shares request 0's partly filled last page: copy on write
    for _ in range(6):  # steps; page boundaries crossed at different steps
        k = torch.randn(4, 1, 2, 8, generator=g)
        for layer in range(2):
            a.append(ids, k + layer, 3 * k, layer=layer)
        b.extend(ids, 1)
        table, lens = b.batch(ids)
        for layer in range(2):
            b.write(layer, k + layer, 3 * k, table, lens - 1, torch.ones_like(lens))
    for layer in range(2):
        for sid in ids:
            assert a.seq_len(sid, layer) == b.seq_len(sid, layer)
            ta, tb = a.batch([sid], layer=layer)[0][0], b.batch([sid], layer=layer)[0][0]
            n = a.seq_len(sid, layer)
            ka = a.k_pages(layer)[ta].flatten(0, 1)[:n].float()
            kb = b.k_pages(layer)[tb].flatten(0, 1)[:n].float()
            assert torch.equal(ka, kb) and torch.equal(a.v_pages(layer)[ta].flatten(0, 1)[:n].float(),
                                                       b.v_pages(layer)[tb].flatten(0, 1)[:n].float())
    assert a.num_free_pages == b.num_free_pages
    # the fork's writes never reached request 0's pages
    assert a.pages(ids[0])[-1] != a.pages(ids[3])[1]


def test_write_skips_rows_with_no_tokens():
    c = _cache()
    sid = c.add_sequence()
    c.extend([sid], 3)
    table, lens = c.batch([sid])
    before = c.k_pages(0).clone()
    c.write(0, torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), table, lens - 1, torch.zeros_like(lens))
    assert torch.equal(c.k_pages(0).nan_to_num(), before.nan_to_num())


def test_extend_checks_and_changes_nothing_when_full():
    c = _cache()
    sid = c.add_sequence()
    with pytest.raises(ValueError, match="num_tokens"):
        c.extend([sid], -1)
    with pytest.raises(CacheFullError):
        c.extend([sid], 24 * 4 + 1)
    assert c.seq_len(sid) == 0 and c.num_free_pages == 24
    c.append([sid], torch.ones(1, 2, 2, 8), torch.ones(1, 2, 2, 8), layer=0)  # layer 1 not yet
    with pytest.raises(ValueError, match="different lengths"):
        c.extend([sid], 1)


def test_buckets_and_widths():
    assert [G.bucket_for(b) for b in (1, 3, 5, 9, 13, 17, 33, 256, 257)] == [1, 4, 8, 12, 16, 24, 48, 256, 320]
    assert [G.width_for(p, 1000) for p in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert [G.members_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert G.width_for(100, 50) == 50


def _fixed_shape(model, state):
    state.graphs = G.GraphSteps(model, state, capture=False)  # what a GPU captures, run eagerly
    return state


def test_fixed_shape_steps_equal_transformers_fp32():
    model = _model(tf)
    ids, mask = _prompt()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    state, logits = hf.prefill(model, ids, mask, max_new_tokens=NEW)
    _fixed_shape(model, state)
    toks, seen = [], []
    with hf.use_splitkv(model):
        for _ in range(NEW):
            seen.append(logits)
            toks.append(logits.argmax(-1))
            logits = hf.decode_step(model, state, toks[-1])
    assert torch.equal(torch.stack(toks, 1), ref.sequences[:, S:])
    assert (torch.stack(seen, 1) - torch.stack(ref.logits, 1)).abs().max() < 1e-4
    assert set(state.graphs.steps) == {(2, 16, 1)}  # B = 2: its own bucket, 16 pages/request, no groups
    state.free()


def test_compiled_norms_and_mlps_inside_the_step_equal_transformers_fp32():
    from torch._dynamo.utils import counters

    model = _model(tf)
    ids, mask = _prompt()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    torch._dynamo.reset()
    counters.clear()
    state, logits = hf.prefill(model, ids, mask, max_new_tokens=8)
    state.graphs = G.GraphSteps(model, state, capture=False, compile=True)
    assert len(state.graphs.parts) == 3 * 2 + 1  # 2 layers x (2 norms + MLP) + the final norm
    seen, toks = [], []
    with hf.use_splitkv(model):
        for _ in range(8):
            seen.append(logits)
            toks.append(logits.argmax(-1))
            logits = hf.decode_step(model, state, toks[-1])
    assert torch.equal(torch.stack(toks, 1), ref.sequences[:, S:])
    assert (torch.stack(seen, 1) - torch.stack(ref.logits, 1)).abs().max() < 1e-4
    assert counters["stats"]["unique_graphs"] == 2  # one per class (RMSNorm, MLP), shared by every instance
    assert all("forward" not in m.__dict__ for m in model.modules())  # the model is left as it was


def test_engine_with_fixed_shape_steps_gives_solo_tokens():
    model = _model(tf)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (37, 300, 5, 130, 64)]
    new = [10, 6, 12, 3, 9]
    eng = E.Engine(model, num_pages=64, page_size=16, prefill_chunk=64)
    _fixed_shape(model, eng._state)
    rids = [eng.add_request(p, n, eos_token_id=None) for p, n in zip(prompts, new, strict=True)]
    outs = eng.run()
    for rid, p, n in zip(rids, prompts, new, strict=True):
        assert outs[rid] == hf.generate(model, p[None], n, eos_token_id=None)[0, p.numel():].tolist(), rid
    assert len({k[0] for k in eng._state.graphs.steps}) >= 3  # batches of 1..5 ran in several buckets
    assert eng.cache.num_free_pages == eng.cache.num_pages


def test_engine_sharing_prompt_prefixes_gives_the_same_tokens():
    """n samples of two prompts (and a request alone) with share_prefix: each group's prompt pages
    attended once (group_prefix_decode) and merged with each sample's own keys give the tokens of
    the engine that attends every sample's whole cache; greedy and seeded sampling. The greedy
    samples and the lone request get transformers' own greedy tokens (fp32)."""
    model = _model(tf)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (37, 300, 50)]
    outs = []
    for share in (True, False):
        eng = E.Engine(model, num_pages=96, page_size=16, prefill_chunk=128, share_prefix=share)
        _fixed_shape(model, eng._state)
        rids = [*eng.add_request(prompts[0], 9, eos_token_id=None, n=3),
                *eng.add_request(prompts[1], 7, eos_token_id=None, n=2, temperature=0.8, seed=1),
                eng.add_request(prompts[2], 6, eos_token_id=None)]
        got = eng.run()
        outs.append([got[r] for r in rids])
        assert eng.cache.num_free_pages == eng.cache.num_pages
        groups = {k[2] for k in eng._state.graphs.steps}
        assert (max(groups) > 1) == share  # the grouped steps ran only when asked for
    assert outs[0] == outs[1]
    for p, n, got in ((prompts[0], 9, outs[0][:3]), (prompts[2], 6, outs[0][5:])):
        want = model.generate(p[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert all(g == want[0, p.numel():].tolist() for g in got)


def test_engine_sharing_an_added_prefix_gives_the_same_tokens():
    """Requests on one add_prefix prefix (and one alone) with share_prefix: the prefix's pages
    attended once per step for the group give the tokens of the whole prompts (fp32 greedy)."""
    model = _model(tf)
    g = torch.Generator().manual_seed(11)
    pre, alone = torch.randint(3, 128, (50,), generator=g), torch.randint(3, 128, (20,), generator=g)
    sufs = [torch.randint(3, 128, (n,), generator=g) for n in (10, 40, 3)]
    outs = []
    for share in (True, False):
        eng = E.Engine(model, num_pages=64, page_size=16, prefill_chunk=64, share_prefix=share)
        _fixed_shape(model, eng._state)
        h = eng.add_prefix(pre)
        rids = [eng.add_request(s, 7, eos_token_id=None, prefix=h) for s in sufs]
        rids.append(eng.add_request(alone, 5, eos_token_id=None))
        got = eng.run()
        outs.append([got[r] for r in rids])
        assert (max(k[2] for k in eng._state.graphs.steps) > 1) == share  # grouped steps only when asked
        eng.remove_prefix(h)
        assert eng.cache.num_free_pages == eng.cache.num_pages
    assert outs[0] == outs[1]
    for p, n, got in [*((torch.cat([pre, s]), 7, o) for s, o in zip(sufs, outs[0], strict=False)),
                      (alone, 5, outs[0][3])]:
        assert got == hf.generate(model, p[None], n, eos_token_id=None)[0, p.numel():].tolist()


def test_cuda_graph_must_be_a_bool():
    model = _model(tf)
    with pytest.raises(TypeError, match="cuda_graph"):
        hf.generate(model, _prompt()[0][:1], 2, cuda_graph="yes")
    with pytest.raises(TypeError, match="cuda_graph"):
        E.Engine(model, num_pages=8, cuda_graph=1)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_graph_steps_replay_the_eager_step(kv_cache_dtype):
    """50 steps, batch membership changing (requests leave), on the same tokens: the graph steps'
    logits are no further from the eager step's than the eager Triton / CuTe kernels are from the
    torch backend's (a random bf16 model amplifies any rounding difference, and the graph runs a
    padded batch whose splits may differ), and every shape was captured (no eager fallback)."""
    model = _model(tf, torch.bfloat16, head_dim=128, device="cuda", layers=4, hq=32, hkv=8, hidden=1024,
                   vocab=1000)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1000, (6, 900), generator=g).cuda()
    mask = torch.ones_like(ids)
    for b in range(6):
        mask[b, :100 * b] = 0  # prompts of 900 .. 400 tokens
    kw = dict(max_new_tokens=60, page_size=16, kv_cache_dtype=kv_cache_dtype)
    graph, logits = hf.prefill(model, ids, mask, **kw)
    eager, _ = hf.prefill(model, ids, mask, cuda_graph=False, **kw)
    ref, _ = hf.prefill(model, ids, mask, backend="torch", **kw)
    assert graph.graphs is not None and eager.graphs is None and ref.graphs is None
    d_graph = d_kernels = 0.0
    with hf.use_splitkv(model):
        tok = logits.argmax(-1)
        for step in range(50):
            if step in (10, 25, 40):  # a request leaves: the batch shrinks, into another bucket at 25
                for st in (graph, eager, ref):
                    st.cache.free(st.seq_ids.pop(1))
                    st.positions = torch.cat((st.positions[:1], st.positions[2:]))
                tok = torch.cat((tok[:1], tok[2:]))
            a, b, c = (hf.decode_step(model, st, tok).float() for st in (graph, eager, ref))
            d_graph = max(d_graph, float((a - b).abs().max() / b.abs().max()))
            d_kernels = max(d_kernels, float((b - c).abs().max() / c.abs().max()))
            tok = c.argmax(-1)
    steps = graph.graphs.steps
    print(f"{kv_cache_dtype}: max relative logit difference graph vs eager {d_graph:.2e}, eager vs torch "
          f"backend {d_kernels:.2e}; shapes {sorted(steps)}")
    assert all(io.graph is not None for io in steps.values()), "a shape fell back to eager"
    assert len({k[0] for k in steps}) >= 2  # 6, 5 requests in bucket 8; 4, 3 in bucket 4
    assert d_graph <= d_kernels


@pytest.mark.gpu
def test_gpu_a_failed_capture_falls_back_to_the_eager_step(monkeypatch, caplog):
    """torch.cuda.graph raising at capture: the log says so, the shape is marked eager, and its steps
    (the capture attempt's warm-up run included) give the logits of the same fixed-shape steps run
    without graphs."""
    model = _model(tf, torch.bfloat16, head_dim=128, device="cuda", layers=2, hq=32, hkv=8, hidden=1024,
                   vocab=1000)
    ids = torch.randint(3, 1000, (3, 300), generator=torch.Generator().manual_seed(4)).cuda()
    graph, logits = hf.prefill(model, ids, max_new_tokens=8, page_size=16)
    eager, _ = hf.prefill(model, ids, max_new_tokens=8, page_size=16, cuda_graph=False)
    _fixed_shape(model, eager)  # the same fixed-shape steps, never captured

    def no_capture(*a, **k):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "graph", no_capture)
    with caplog.at_level("WARNING", logger="splitkv"), hf.use_splitkv(model):
        tok = logits.argmax(-1)
        for _ in range(5):
            a, b = (hf.decode_step(model, st, tok).float() for st in (graph, eager))
            assert (a - b).abs().max() <= 1e-2 * b.abs().max()  # the same kernels on the same shapes
            tok = b.argmax(-1)
    assert any("capture refused" in r.getMessage() and "runs eagerly" in r.getMessage() for r in caplog.records)
    assert graph.graphs.steps and all(io.eager and io.graph is None for io in graph.graphs.steps.values())


@pytest.mark.gpu
def test_gpu_engine_with_graph_steps_matches_the_eager_engine():
    """Continuous batching on the GPU: requests joining mid-run and leaving at different steps, the
    engine's CUDA-graph steps against the same engine stepping eagerly: the same tokens per request
    (up to bf16 near-ties late in a request), every shape captured, every page back."""
    model = _model(tf, torch.bfloat16, head_dim=128, device="cuda", layers=4, hq=32, hkv=8, hidden=1024,
                   vocab=1000)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=g) for n in (700, 3000, 64, 1500, 9, 2048)]
    new = [40, 12, 33, 25, 50, 8]
    outs = []
    for graphs in (True, False):
        eng = E.Engine(model, num_pages=1024, page_size=16, prefill_chunk=1024, cuda_graph=graphs)
        rids = [eng.add_request(p, n, eos_token_id=None) for p, n in zip(prompts[:3], new[:3], strict=True)]
        got: dict[int, list[int]] = {}
        for step in range(400):
            if step == 5:
                rids += [eng.add_request(p, n, eos_token_id=None) for p, n in zip(prompts[3:], new[3:], strict=True)]
            if not eng.pending:
                break
            for rid, tok, _ in eng.step():
                got.setdefault(rid, []).append(tok)
        assert [len(got[r]) for r in rids] == new
        assert eng.cache.num_free_pages == eng.cache.num_pages
        if graphs:
            steps = eng._state.graphs.steps
            assert steps and all(io.graph is not None for io in steps.values()), "a shape fell back to eager"
        outs.append([got[r] for r in rids])
    # bf16 greedy tokens of a random model part at near-ties once the padded graph batch and the
    # eager batch split a request's keys differently (seen on the H200: 5 of 6 identical, the 6th
    # from its 42nd token); a wrong slot or table would garble the first tokens after a join
    same = sum(a == b for a, b in zip(*outs, strict=True))
    print(f"engine graph vs eager: {same}/{len(new)} requests with identical tokens")
    assert all(a[:8] == b[:8] for a, b in zip(*outs, strict=True))
    assert same >= len(new) - 1


@pytest.mark.gpu
def test_gpu_shared_prefix_steps_are_as_exact_as_the_plain_steps():
    """On the GPU, with CUDA-graph steps, teacher-forced (greedy tokens of a random bf16 model part
    at near-ties, which the prefix + suffix merge's rounding moves: measured 0/7 identical token
    streams share vs plain on the H200, while on the CPU the torch backend in bf16 gives 7/7 and
    the interpreted Triton kernels match it per call): two groups of samples (4 of a 3000-token
    prompt, 3 of a 700-token one) whose prompt pages are read once per group, against the plain
    step reading every row's whole cache; both against the torch backend. The shared step's logits
    are no further from the torch backend's than 2x the plain step's, and grouped graphs were
    captured."""
    model = _model(tf, torch.bfloat16, head_dim=128, device="cuda", layers=4, hq=32, hkv=8, hidden=1024,
                   vocab=1000)
    g = torch.Generator().manual_seed(11)
    long, short = (torch.randint(3, 1000, (n,), generator=g) for n in (3000, 700))
    ids = torch.zeros(7, 3000, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:4], mask[:4] = long, 1
    ids[4:, -700:], mask[4:, -700:] = short, 1
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=30, page_size=16)
    shared, logits = hf.prefill(model, ids, mask, **kw)
    plain, _ = hf.prefill(model, ids, mask, **kw)
    ref, _ = hf.prefill(model, ids, mask, backend="torch", cuda_graph=False, **kw)
    shared.groups = [([0, 1, 2, 3], 3000 // 16), ([4, 5, 6], 700 // 16)]  # whole prompt pages, held by every row
    d_shared = d_plain = 0.0
    with hf.use_splitkv(model):
        tok = logits.argmax(-1)
        for _ in range(25):
            a, b, c = (hf.decode_step(model, st, tok).float() for st in (shared, plain, ref))
            d_shared = max(d_shared, float((a - c).abs().max() / c.abs().max()))
            d_plain = max(d_plain, float((b - c).abs().max() / c.abs().max()))
            tok = c.argmax(-1)
    steps = shared.graphs.steps
    print(f"max relative logit difference from the torch backend: shared prefix {d_shared:.2e}, plain "
          f"{d_plain:.2e}; shapes {sorted(steps)}")
    assert all(io.graph is not None for io in steps.values()), "a shape fell back to eager"
    assert max(k[2] for k in steps) == 4  # 4-member groups: the grouped step ran
    assert d_shared <= 2 * d_plain


@pytest.mark.gpu
def test_gpu_engine_sharing_prompt_prefixes_runs_grouped_graphs():
    """The engine with share_prefix on the GPU: grouped CUDA-graph steps captured, every request
    finished with its token count, every page back (token equality with the plain engine is not
    asserted: see the teacher-forced test above)."""
    model = _model(tf, torch.bfloat16, head_dim=128, device="cuda", layers=4, hq=32, hkv=8, hidden=1024,
                   vocab=1000)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1000, (n,), generator=g) for n in (3000, 700)]
    eng = E.Engine(model, num_pages=1024, page_size=16, prefill_chunk=1024, share_prefix=True)
    rids = [*eng.add_request(prompts[0], 24, eos_token_id=None, n=4),
            *eng.add_request(prompts[1], 16, eos_token_id=None, n=3)]
    got = eng.run()
    assert [len(got[r]) for r in rids] == [24] * 4 + [16] * 3
    assert eng.cache.num_free_pages == eng.cache.num_pages
    steps = eng._state.graphs.steps
    assert all(io.graph is not None for io in steps.values()), "a shape fell back to eager"
    assert max(k[2] for k in steps) > 1
