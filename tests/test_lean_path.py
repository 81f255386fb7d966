"""The lean decode path: the plan decides once and checks each call; the split table is computed on
the device (no host read of cache_seqlens); batch-invariant mode; thread safety; strided int inputs."""

import threading

import numpy as np
import pytest
import torch
from helpers import assert_close_to_reference, make_inputs, to_paged

import splitkv
from splitkv import backends, heuristics
from splitkv.reference import decode_reference

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
GPU_BACKENDS = ["triton"] + (["cutlass"] if backends.cutlass_available() else [])


# --- the plan checks every call against what it was made for ---------------------------------------

def test_plan_call_mismatches_are_named():
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], BF16)
    p = splitkv.plan(sl, 8, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="contiguous cache.*block_table"):
        kp, vp, bt = to_paged(k, v, [900, 40], 16)
        splitkv.decode(q, kp, vp, sl, block_table=bt, plan=p)
    with pytest.raises(ValueError, match=r"plan: made for \(B, Hq, Hkv, D, Sq\)"):
        q3, k3, v3, sl3 = make_inputs(3, 1, 8, 2, 64, [900, 40, 5], BF16)
        splitkv.decode(q3, k3, v3, sl3, plan=p)
    with pytest.raises(ValueError, match="float16"):
        splitkv.decode(q.half(), k.half(), v.half(), sl, plan=p)
    with pytest.raises(ValueError, match="backend 'torch'.*'triton'"):
        splitkv.decode(q, k, v, sl, plan=p, backend="triton")
    paged = splitkv.plan(sl, 8, 2, 64, paged=True)
    with pytest.raises(ValueError, match="paged cache"):
        splitkv.decode(q, k, v, sl, plan=paged)


@pytest.mark.skipif(not backends.cutlass_available(), reason="needs nvidia-cutlass-dsl")
def test_a_triton_plan_is_refused_by_a_cutlass_call():
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], BF16, DEV)
    p = splitkv.plan(sl, 8, 2, 64, backend="triton")
    with pytest.raises(ValueError, match="backend 'triton'.*'cutlass'"):
        splitkv.decode(q, k, v, sl, plan=p, backend="cutlass")


def test_plan_takes_only_what_decode_takes():
    sl = torch.tensor([100, 7], dtype=torch.int32)
    bad = [(dict(head_dim=100), ValueError, "head_dim"), (dict(q_len=17), ValueError, "q_len"),
           (dict(backend="bogus"), ValueError, "backend"), (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
           (dict(num_splits=0), ValueError, "num_splits"), (dict(max_seqlen=0), ValueError, "max_seqlen"),
           (dict(dtype=torch.int8), TypeError, "dtype"), (dict(paged=1), TypeError, "paged")]
    for over, exc, name in bad:
        kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64) | over
        with pytest.raises(exc, match=name):
            splitkv.plan(sl, kw.pop("num_q_heads"), kw.pop("num_kv_heads"), kw.pop("head_dim"), **kw)
    with pytest.raises(TypeError, match="cache_seqlens"):
        splitkv.plan(sl.long(), 8, 2, 64)
    with pytest.raises(ValueError, match="cache_seqlens"):
        splitkv.plan(torch.tensor([-5, 3], dtype=torch.int32), 8, 2, 64)
    huge = splitkv.plan(sl, 8, 2, 64, num_splits=10 ** 7)  # bounded by what a row can use: no 165 GB
    assert huge.max_splits == 2 and huge.o_part.numel() < 10 ** 6
    q, k, v, _ = make_inputs(2, 1, 8, 2, 64, [100, 7], torch.float32)
    with pytest.raises(ValueError, match="num_splits: the plan forces 2 splits .* pass num_splits to splitkv.plan"):
        splitkv.decode(q, k, v, sl, plan=huge, num_splits=10 ** 7)  # the count the plan was made with, cut
    with pytest.raises(ValueError, match="num_splits: the plan chooses its split counts"):
        splitkv.decode(q, k, v, sl, plan=splitkv.plan(sl, 8, 2, 64), num_splits=2)
    far = splitkv.plan(sl, 8, 2, 64, num_splits=10 ** 7, max_seqlen=10 ** 9)  # a graph-safe bound
    assert far.max_splits == heuristics.MAX_FORCED_SPLITS and far.o_part.numel() < 10 ** 7
    for p in (splitkv.plan(sl, 8, 2, 64), splitkv.plan(sl, 8, 2, 64, batch_invariant=True)):
        with pytest.raises(TypeError, match="batch_invariant: expected a bool"):
            splitkv.decode(q, k, v, sl, plan=p, batch_invariant="no")


def test_refresh_takes_only_the_plans_batch_and_dtype():
    p = splitkv.plan(torch.tensor([900, 40], dtype=torch.int32), 8, 2, 64, max_seqlen=1024)
    with pytest.raises(ValueError, match="cache_seqlens"):
        p.refresh(torch.tensor([900, 40, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        p.refresh(torch.tensor([900, 40], dtype=torch.int64))


def test_bad_scalars_are_named():
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 40], BF16)
    for scale in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="softmax_scale"):
            splitkv.decode(q, k, v, sl, softmax_scale=scale)
    with pytest.raises(TypeError, match="causal"):
        splitkv.decode(q, k, v, sl, causal=1)
    with pytest.raises(TypeError, match=r"causal: expected a Python bool, got .* of <class 'numpy\.bool"):
        splitkv.decode(q, k, v, sl, causal=np.bool_(True))  # the message names NumPy's type, not "bool"
    with pytest.raises(TypeError, match="batch_invariant"):
        splitkv.decode(q, k, v, sl, batch_invariant="yes")


def test_plain_decode_reschedules_when_the_lengths_change(monkeypatch):
    from splitkv import execute

    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [4000, 40], BF16, pad=200, nan_tail=False)
    calls = []
    splitkv.decode(q, k, v, sl)
    plan = next(iter(execute._PLANS.values()))
    real = plan.schedule
    object.__setattr__(plan, "schedule", lambda lens: calls.append(lens.tolist()) or real(lens))
    splitkv.decode(q, k, v, sl)  # same tensor, unmodified: the table stands (layers of one step)
    assert calls == []
    sl[1] = 4100  # in place: the version counter moves
    o, lse = splitkv.decode(q, k, v, sl, return_lse=True)
    assert calls == [[4000, 4100]] and plan.num_splits.tolist() == splitkv.heuristics.schedule(sl, plan.rule)[0].tolist()
    assert_close_to_reference(o, lse, q, k, v, sl)
    splitkv.decode(q, k, v, sl.clone())  # another tensor: rescheduled
    assert len(calls) == 2
    for _ in range(2):  # a fresh tensor each step (it may reuse the freed one's memory): rescheduled
        splitkv.decode(q, k, v, torch.tensor([5, 4100], dtype=torch.int32))
    assert len(calls) == 4


def test_schedule_is_shared_within_one_capture_only(monkeypatch):
    """The skip of schedule_if_new holds where the last schedule went: eagerly, or into this very
    capture (splitkv.capture.token: None eagerly, the capture's id, or a fresh object when no id)."""
    from splitkv import capture, execute

    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [4000, 40], BF16, pad=200, nan_tail=False)
    splitkv.decode(q, k, v, sl)
    plan = next(iter(execute._PLANS.values()))
    assert capture.token(plan.device) is None  # a CPU plan: never in a capture
    calls = []
    real = plan.schedule
    object.__setattr__(plan, "schedule", lambda lens: calls.append(1) or real(lens))
    where = [None]
    monkeypatch.setattr(capture, "token", lambda device: where[0])
    for token, records in [(None, 0), (7, 1), (7, 0), (7, 0), (8, 1), (None, 1), (None, 0)]:
        where[0] = token  # eager, capture 7 (its first call records, the rest share), capture 8, eager
        n = len(calls)
        plan.schedule_if_new(sl)
        assert len(calls) - n == records, token
    monkeypatch.setattr(capture, "token", lambda device: object())  # no readable id: always recorded
    for _ in range(2):
        n = len(calls)
        plan.schedule_if_new(sl)
        assert len(calls) == n + 1


def test_an_unreadable_capture_id_is_none_never_an_error(monkeypatch):
    """capture._capture_id: None (each captured call then records its own schedule) when the
    bindings are absent, fail, or answer in an unexpected form."""
    from splitkv import capture

    class Broken:
        def cudaStream_t(self, init_value):  # noqa: N802 - the binding's name
            raise RuntimeError("driver too old")

    for rt in (None, Broken()):
        monkeypatch.setattr(capture, "_runtime", [rt])
        assert capture._capture_id(0) is None


# --- strided int tensors -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_seqlens_and_block_table(backend, device=None):
    """A column of a 2-D lengths tensor and a column-strided block table give the contiguous
    call's result: twice per signature (the second call may take the lean path of a bound launch),
    with and without a plan."""
    lens = [900, 40, 333]
    q, k, v, sl = make_inputs(3, 2, 8, 2, 64, lens, BF16, device or (DEV if backend != "torch" else "cpu"))
    both = torch.stack([sl, torch.full_like(sl, 10 ** 6)], 1)  # a column of a 2-D tensor: stride 2
    ref = splitkv.decode(q, k, v, sl, num_splits=3, backend=backend)
    p = splitkv.plan(sl, 8, 2, 64, q_len=2, num_splits=3, backend=backend)
    for _ in range(2):
        assert torch.equal(splitkv.decode(q, k, v, both[:, 0], num_splits=3, backend=backend), ref)
        assert torch.equal(splitkv.decode(q, k, v, both[:, 0], plan=p), ref)
    kp, vp, bt = to_paged(k, v, lens, 16)
    wide = torch.full((bt.shape[0], 2 * bt.shape[1]), -1, dtype=torch.int32, device=bt.device)
    wide[:, ::2] = bt  # a column-strided view of a wider table
    ref = splitkv.decode(q, kp, vp, sl, block_table=bt, num_splits=3, backend=backend)
    p = splitkv.plan(sl, 8, 2, 64, q_len=2, num_splits=3, backend=backend, paged=True)
    for _ in range(2):
        o = splitkv.decode(q, kp, vp, both[:, 0], block_table=wide[:, ::2], num_splits=3, backend=backend)
        assert torch.equal(o, ref)
        assert torch.equal(splitkv.decode(q, kp, vp, both[:, 0], block_table=wide[:, ::2], plan=p), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_strided_seqlens_and_block_table(backend):
    test_strided_seqlens_and_block_table(backend, device="cuda")


# --- batch invariance ------------------------------------------------------------------------------------

def _in_batches(backend, device, dtype, *, narrow_alone=False, **variant):
    """The same request (one q row, its keys) alone, with 2 and with 16 other requests. narrow_alone:
    alone, its cache holds only its own keys (another capacity, so another plan bound)."""
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, D, L, Lmax = 8, 2, 64, 3000, 4100
    q0 = torch.randn(1, 1, Hq, D, generator=g).to(dtype)
    k0 = torch.randn(1, Lmax, Hkv, D, generator=g).to(dtype)
    v0 = torch.randn(1, Lmax, Hkv, D, generator=g).to(dtype)
    outs = []
    for B in (1, 3, 17):
        others = torch.randint(1, Lmax, (B - 1,), generator=g).tolist()
        q = torch.cat([q0, torch.randn(B - 1, 1, Hq, D, generator=g).to(dtype)])
        k = torch.cat([k0, torch.randn(B - 1, Lmax, Hkv, D, generator=g).to(dtype)])
        v = torch.cat([v0, torch.randn(B - 1, Lmax, Hkv, D, generator=g).to(dtype)])
        pos = B // 2  # the request sits at another index in every batch
        perm = list(range(1, B))
        perm.insert(pos, 0)
        lens = torch.tensor([L] + others, dtype=torch.int32)[perm]
        cap = L + 3 if narrow_alone and B == 1 else Lmax
        o = splitkv.decode(q[perm].to(device), k[perm][:, :cap].to(device), v[perm][:, :cap].to(device),
                           lens.to(device), backend=backend, batch_invariant=True, **variant)
        outs.append(o[pos])
    return outs


def test_batch_invariant_torch_backend():
    a, b, c = _in_batches("torch", "cpu", torch.float32)
    assert torch.equal(a, b) and torch.equal(a, c)
    with splitkv.debug.capture_partials() as recs:  # the split path (the plan's table), not ATen's kernel
        a, b, c = _in_batches("torch", "cpu", torch.float32)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert all(int(r.num_splits.max()) > 1 for r in recs)  # the request (3000 keys) was split


@pytest.mark.parametrize("variant", [dict(softcap=3.0), dict(sinks=torch.linspace(-1, 1, 8)),
                                     dict(alibi_slopes=torch.linspace(0.01, 0.1, 8)), {}], ids=str)
def test_batch_invariant_torch_backend_with_variants_and_other_capacities(variant):
    """Variants run the torch backend's split path: its padded split grid must be the request's own,
    not the batch's (a request alone in a narrower cache plans fewer splits for the grid)."""
    a, b, c = _in_batches("torch", "cpu", torch.float32, narrow_alone=True, **variant)
    assert torch.equal(a, b) and torch.equal(a, c)
    g = torch.Generator().manual_seed(0)  # a short request next to a long one (the plan's grid: 3 splits)
    k, v, q = torch.randn(2, 5003, 2, 64, generator=g), torch.randn(2, 5003, 2, 64, generator=g), \
        torch.randn(2, 1, 4, 64, generator=g)
    four = {n: t[:4] if isinstance(t, torch.Tensor) else t for n, t in variant.items()}
    alone = splitkv.decode(q[:1], k[:1, :20], v[:1, :20], torch.tensor([17], dtype=torch.int32),
                           batch_invariant=True, backend="torch", **four)
    pair = splitkv.decode(q, k, v, torch.tensor([17, 5000], dtype=torch.int32), batch_invariant=True,
                          backend="torch", **four)
    assert torch.equal(alone[0], pair[0])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_batch_invariant_gpu(backend):
    a, b, c = _in_batches(backend, "cuda", BF16)
    assert torch.equal(a, b) and torch.equal(a, c)


# --- threads and streams ---------------------------------------------------------------------------------

def _threads(device, backend, streams, same_shape=False):
    # same_shape: one cache length (Lmax 1000) for every thread, so they share one input signature
    cases = [make_inputs(2, 1, 8, 2, 64, [700 + 37 * i, 300], BF16, device, seed=i,
                         pad=300 - 37 * i if same_shape else 3) for i in range(4)]
    refs = [splitkv.decode(*c, num_splits=3, backend=backend) for c in cases]
    bad = []

    def work(i):
        ctx = torch.cuda.stream(torch.cuda.Stream()) if streams else torch.no_grad()
        with ctx:
            for _ in range(10 if device == "cpu" else 40):
                o = splitkv.decode(*cases[i], num_splits=3, backend=backend)
                if streams:
                    torch.cuda.current_stream().synchronize()
                if not torch.equal(o, refs[i]):
                    bad.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


@pytest.mark.parametrize("same_shape", [False, True])
def test_threads_get_their_own_workspace_cpu(same_shape):
    """same_shape: the threads share one input signature, so only the per-thread plan keeps their
    workspaces apart."""
    _threads("cpu", "torch", streams=False, same_shape=same_shape)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("same_shape", [False, True])
def test_streams_get_their_own_workspace(backend, same_shape):
    _threads("cuda", backend, streams=True, same_shape=same_shape)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_threads_on_one_stream_share_a_plan_safely(backend):
    """Threads on the same stream share a plan (and the lean path's bound launch): their launches
    are serialised by the stream, and the host-side argument slots by the launch's lock."""
    _threads("cuda", backend, streams=False, same_shape=True)


# --- no sync, capturable -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto"] + GPU_BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_plain_decode_never_syncs_and_replays_in_a_graph(backend, paged):
    lens = [4000, 700, 1]
    q, k, v, sl = make_inputs(3, 1, 32, 8, 128, lens, BF16, "cuda", nan_tail=False, pad=200)
    kd, vd, bt = k, v, None
    if paged:  # every page the replays' lengths reach is in the table
        k, v, bt = to_paged(k, v, [4100] * 3, 16)
    splitkv.decode(q, k, v, sl, block_table=bt, backend=backend)  # compile + plan outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, lse = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend, return_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_to_reference(o, lse, q, k, v, sl, block_table=bt, lowp_k=kd, lowp_v=vd)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm the capture stream's own plan
        splitkv.decode(q, k, v, sl, block_table=bt, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        og, lg = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend, return_lse=True)
    for new in ([4000, 700, 1], [3, 4050, 2000], [0, 17, 4100]):
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend)
        assert torch.equal(og, eager), new
        assert_close_to_reference(og, lg, q, k, v, sl, block_table=bt, lowp_k=kd, lowp_v=vd)


@pytest.mark.gpu
def test_a_captured_decode_with_strided_lengths_marks_its_plan():
    """Strided cache_seqlens are copied inside the capture (the full path's schedule, not
    schedule_if_new): the plan is still marked captured, so execute.MAX_PLANS never evicts it, and
    replays with new lengths match eager calls."""
    from splitkv import execute

    q, k, v, _ = make_inputs(3, 1, 32, 8, 128, [4100] * 3, BF16, "cuda", nan_tail=False, pad=200)
    both = torch.tensor([[4000, 1], [700, 1], [1, 1]], dtype=torch.int32, device="cuda")
    splitkv.clear_plans()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        splitkv.decode(q, k, v, both[:, 0], backend="triton")  # warm the capture stream's plan
        (plan,) = execute._PLANS.values()
    torch.cuda.current_stream().wait_stream(s)
    assert not plan.captured[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        og = splitkv.decode(q, k, v, both[:, 0], backend="triton")
    assert plan.captured[0]
    for new in ([3, 4050, 2000], [0, 17, 4100]):
        both[:, 0] = torch.tensor(new, dtype=torch.int32)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(og, splitkv.decode(q, k, v, both[:, 0].contiguous(), backend="triton")), new


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cutlass", "triton"])
def test_back_to_back_plain_decodes_with_new_lengths_are_exact(backend):
    """Plain decodes issued back to back without a sync, the lengths rewritten on the GPU between
    them: each call's schedule rewrites the plan's split table (and work list) in stream order, after
    the previous call's kernels are done with it, so every output matches the reference of its own
    lengths."""
    sets = [[4000, 700, 1], [3, 4050, 2000], [0, 17, 4100], [4100, 4100, 4100], [256, 3000, 64]] * 3
    q, k, v, sl = make_inputs(3, 1, 32, 8, 128, [4100] * 3, BF16, "cuda", nan_tail=False, pad=200)
    every = torch.tensor(sets, dtype=torch.int32, device="cuda")
    splitkv.decode(q, k, v, sl, backend=backend)  # compile + plan
    torch.cuda.synchronize()
    outs = []
    for i in range(len(sets)):
        sl.copy_(every[i])  # on the GPU, in stream order: no host sync between the calls
        outs.append(splitkv.decode(q, k, v, sl, backend=backend, return_lse=True))
    torch.cuda.synchronize()
    for lens, (o, lse) in zip(sets, outs):
        assert_close_to_reference(o, lse, q, k, v, torch.tensor(lens, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_plain_decodes_captured_together_share_one_schedule(backend):
    """Three layers' plain decode calls in one graph, one lengths tensor: one schedule recorded, and
    replays with new lengths match the fp64 reference and give what eager calls give."""
    from splitkv import execute

    lens = [4000, 700, 1]
    layers = [make_inputs(3, 1, 32, 8, 128, lens, BF16, "cuda", nan_tail=False, pad=200, seed=i) for i in range(3)]
    sl = layers[0][3]
    splitkv.clear_plans()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm the capture stream's own plan
        splitkv.decode(*layers[0][:3], sl, backend=backend)
        (plan,) = execute._PLANS.values()
    torch.cuda.current_stream().wait_stream(s)
    calls = []
    real = plan.schedule
    object.__setattr__(plan, "schedule", lambda x: calls.append(1) or real(x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        outs = [splitkv.decode(q, k, v, sl, backend=backend, return_lse=True) for q, k, v, _ in layers]
    assert len(calls) == (1 if _cuda_bindings() else 3)  # without cuda-python every call records its own
    assert plan.captured[0]  # execute.MAX_PLANS: a plan a capture ran is never evicted
    for new in ([3, 4050, 2000], [0, 17, 4100]):
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for (o, lse), (q, k, v, _) in zip(outs, layers, strict=True):
            assert_close_to_reference(o, lse, q, k, v, sl)
            assert torch.equal(o, splitkv.decode(q, k, v, sl, backend=backend)), new


def _cuda_bindings() -> bool:
    try:
        from cuda.bindings import runtime  # noqa: F401
    except ImportError:
        return False
    return True


# --- the lean path: the second call of a signature launches through the bound launcher ---------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("with_plan", [False, True])
def test_lean_path_is_taken_and_exact(backend, paged, with_plan, monkeypatch):
    import importlib

    lens = [3000, 700, 1]
    q, k, v, sl = make_inputs(3, 1, 32, 8, 128, lens, BF16, "cuda", nan_tail=False, pad=400)  # Lmax 3400
    kd, vd, bt = k, v, None
    if paged:
        k, v, bt = to_paged(k, v, [3300] * 3, 16)
    p = splitkv.plan(sl, 32, 8, 128, backend=backend, paged=paged, max_seqlen=3300) if with_plan else None
    first = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend, plan=p)  # full path: compiles, binds
    module = importlib.import_module(f"splitkv.backends.{backend}")
    full_calls = []
    run = module.run
    monkeypatch.setattr(module, "run", lambda *a: full_calls.append(1) or run(*a))
    o = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend, plan=p)
    assert not full_calls, "the second call of a signature took the full path"
    assert torch.equal(o, first)
    for new in ([5, 3290, 1200], [0, 1, 2]):  # new lengths: the lean call schedules them on the device
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        if p is not None:
            p.refresh(sl)
        o, lse = splitkv.decode(q, k, v, sl, block_table=bt, backend=backend, plan=p, return_lse=True)
        assert_close_to_reference(o, lse, q, k, v, sl, block_table=bt, lowp_k=kd, lowp_v=vd)
    assert not full_calls
    if backend == "triton":  # a misaligned q (a view one element in) is the full path's
        qq = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
        qq.copy_(q)
        o, lse = splitkv.decode(qq, k, v, sl, block_table=bt, backend=backend, plan=p, return_lse=True)
        assert full_calls
        assert_close_to_reference(o, lse, q, k, v, sl, block_table=bt, lowp_k=kd, lowp_v=vd)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("with_plan", [False, True])
@pytest.mark.parametrize("kind", ["sinks+softcap+window", "alibi", "fp8-tensor", "fp8-head"])
def test_lean_path_takes_variants_keyed_by_their_values_and_tensors(kind, paged, with_plan, monkeypatch):
    """A repeated variant call launches through its bound launch (no full-path run) and equals the
    full path bitwise, also with fresh copies of its tensors each call (their pointers are passed per
    call, so the binding is per kernel key, not per tensor); another softcap or per-tensor scale is
    another binding and the result follows the new values; results match the reference."""
    import splitkv.backends.triton as tri

    lens = [3000, 700, 1]
    q, k, v, sl = make_inputs(3, 1, 32, 8, 128, lens, BF16, "cuda", nan_tail=False, pad=400)
    g = torch.Generator().manual_seed(3)
    kw, kw2 = {}, {}
    if kind == "sinks+softcap+window":
        kw = dict(sinks=torch.randn(32, generator=g).cuda(), softcap=20.0, window_size=(1000, -1))
        kw2 = dict(kw, sinks=torch.randn(32, generator=g).cuda(), softcap=10.0)
    elif kind == "alibi":
        kw = dict(alibi_slopes=(torch.rand(32, generator=g) * 0.01).cuda())
        kw2 = dict(alibi_slopes=(torch.rand(32, generator=g) * 0.02).cuda())
    else:
        k, v = k.clamp(-400, 400).to(torch.float8_e4m3fn), v.clamp(-400, 400).to(torch.float8_e4m3fn)
        if kind == "fp8-tensor":
            kw, kw2 = dict(k_scale=0.5, v_scale=2.0), dict(k_scale=0.25, v_scale=3.0)
        else:
            kw = dict(k_scale=torch.rand(8, generator=g).cuda() + 0.5, v_scale=torch.rand(8, generator=g).cuda() + 0.5)
            kw2 = dict(k_scale=kw["k_scale"] * 2, v_scale=kw["v_scale"] * 0.5)
    kd, vd, bt = k, v, None
    if paged:
        k, v, bt = to_paged(k, v, [3300] * 3, 16)

    def plan_for(kws):
        return splitkv.plan(sl, 32, 8, 128, backend="triton", paged=paged, max_seqlen=3300, kv_dtype=k.dtype,
                            **kws) if with_plan else None

    p, p2 = plan_for(kw), plan_for(kw2)
    first = splitkv.decode(q, k, v, sl, block_table=bt, backend="triton", plan=p, **kw)  # full: compiles, binds
    other = splitkv.decode(q, k, v, sl, block_table=bt, backend="triton", plan=p2, **kw2)
    full_calls = []
    run = tri.run
    monkeypatch.setattr(tri, "run", lambda *a: full_calls.append(1) or run(*a))
    def fresh(kws):  # new tensors with the same values, at new addresses
        return {name: (val.clone() if isinstance(val, torch.Tensor) else val) for name, val in kws.items()}

    for _ in range(3):  # lean, alternating: each call gets its own variant's launch
        assert torch.equal(splitkv.decode(q, k, v, sl, block_table=bt, backend="triton", plan=p, **fresh(kw)), first)
        assert torch.equal(splitkv.decode(q, k, v, sl, block_table=bt, backend="triton", plan=p2, **fresh(kw2)),
                           other)
    assert not full_calls, "a repeated variant call took the full path"
    assert not torch.equal(first, other)
    for kws, o in ((kw, first), (kw2, other)):
        ro, _ = decode_reference(q, kd, vd, sl, **kws)
        assert (o.double() - ro).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif("cutlass" not in GPU_BACKENDS, reason="needs the CuTe DSL")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("with_plan", [False, True])
def test_cutlass_lean_path_binds_the_merge_kernel(paged, with_plan, monkeypatch):
    """A CuTe plan that merges in the merge kernel (GQA 64/8 at 4K: 8 rows x 16 splits, past
    heuristics.CUTLASS_FUSED_MERGE_MAX_PARTIALS) takes the lean path too, split and merge bound, with
    and without sinks (which the merge joins to each row); results equal the full path's bitwise."""
    import splitkv.backends.cutlass as cut

    q, k, v, sl = make_inputs(1, 1, 64, 8, 128, [4000], BF16, "cuda", nan_tail=False, pad=96)  # Lmax 4096
    kd, vd, bt = k, v, None
    if paged:
        k, v, bt = to_paged(k, v, [4096], 16)
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(5)).cuda()
    kws = ({}, {"sinks": sinks})
    plans = [splitkv.plan(sl, 64, 8, 128, backend="cutlass", paged=paged, max_seqlen=4096, **kw) if with_plan
             else None for kw in kws]
    for p in plans:
        assert p is None or (p.max_splits == 16 and not p.fuse and p.tile.block_m == 16)
    firsts = [splitkv.decode(q, k, v, sl, block_table=bt, backend="cutlass", plan=p, **kw)  # full: compiles, binds
              for p, kw in zip(plans, kws)]
    full_calls = []
    run = cut.run
    monkeypatch.setattr(cut, "run", lambda *a: full_calls.append(1) or run(*a))
    for first, p, kw in zip(firsts, plans, kws):
        assert torch.equal(splitkv.decode(q, k, v, sl, block_table=bt, backend="cutlass", plan=p, **kw), first)
        ro, _ = decode_reference(q, kd, vd, sl, **kw)
        assert (first.double() - ro).abs().max().item() < 2e-2
    assert not full_calls, "a repeated call of an unfused CuTe plan took the full path"
    assert not torch.equal(*firsts)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_batch_invariant_plan_and_call_take_the_lean_path(backend, monkeypatch):
    """batch_invariant=True passed to both plan() and decode() (the plan's own mode) binds like any
    plan; the same flag with a plan that is not batch-invariant is still refused."""
    import importlib

    q, k, v, sl = make_inputs(3, 1, 32, 8, 128, [3000, 700, 1], BF16, "cuda", nan_tail=False, pad=400)
    p = splitkv.plan(sl, 32, 8, 128, backend=backend, batch_invariant=True, max_seqlen=3400)
    first = splitkv.decode(q, k, v, sl, backend=backend, plan=p, batch_invariant=True)
    module = importlib.import_module(f"splitkv.backends.{backend}")
    full_calls = []
    run = module.run
    monkeypatch.setattr(module, "run", lambda *a: full_calls.append(1) or run(*a))
    assert torch.equal(splitkv.decode(q, k, v, sl, backend=backend, plan=p, batch_invariant=True), first)
    o, lse = splitkv.decode(q, k, v, sl, backend=backend, plan=p, return_lse=True)
    assert not full_calls, "a batch-invariant plan's call took the full path"
    assert torch.equal(o, first)
    assert_close_to_reference(o, lse, q, k, v, sl)
    with pytest.raises(ValueError, match="batch_invariant"):
        splitkv.decode(q, k, v, sl, backend=backend, plan=splitkv.plan(sl, 32, 8, 128, backend=backend,
                                                                         max_seqlen=3400), batch_invariant=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("with_plan", [False, True])
def test_lean_path_with_out(backend, with_plan, monkeypatch):
    """out= takes the lean path when it is a contiguous tensor like q, also when every call of the
    signature passes one (a plan's first call binds for it); a strided out takes the full one."""
    import importlib

    q, k, v, sl = make_inputs(2, 1, 32, 8, 128, [2500, 90], BF16, "cuda", nan_tail=False)
    p = splitkv.plan(sl, 32, 8, 128, backend=backend) if with_plan else None
    ref = splitkv.decode(q, k, v, sl, backend=backend, plan=p, out=torch.empty_like(q))  # full path: binds
    module = importlib.import_module(f"splitkv.backends.{backend}")
    full_calls = []
    run = module.run
    monkeypatch.setattr(module, "run", lambda *a: full_calls.append(1) or run(*a))
    out = torch.full_like(q, float("nan"))
    assert splitkv.decode(q, k, v, sl, backend=backend, plan=p, out=out) is out
    assert torch.equal(out, ref) and not full_calls, "a contiguous out= took the full path"
    wide = torch.full((*q.shape[:3], 2 * q.shape[3]), float("nan"), dtype=q.dtype, device="cuda")
    strided = wide[..., : q.shape[3]]
    splitkv.decode(q, k, v, sl, backend=backend, plan=p, out=strided)
    assert torch.equal(strided, ref) and full_calls


def test_clear_plans_releases_what_the_lean_path_holds():
    import gc
    import weakref

    from splitkv import execute

    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [300, 40], BF16, DEV)
    splitkv.decode(q, k, v, sl)
    splitkv.decode(q, k, v, sl)
    plans = [weakref.ref(p) for p in execute._PLANS.values()]
    assert plans
    splitkv.clear_plans()
    gc.collect()
    assert all(r() is None for r in plans)


# --- the work list: one CTA column per split of the batch, not batch x max_splits ------------------

WORK_LIST_BACKENDS = ["triton"] + ([pytest.param("cutlass", marks=pytest.mark.gpu)]
                                   if HAS_CUDA and backends.cutlass_available() else [])


@pytest.mark.parametrize("backend", WORK_LIST_BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_work_list_plan_decodes_ragged_batches(paged, backend):
    """An auto plan of a mid-size batch launches one CTA per (request, split) of its work list;
    ragged lengths (one request with no key, one long) under one plan, re-planned per call."""
    lens_a, lens_b = [700, 0, 5, 5000, 64, 900], [5000, 4999, 1, 2, 3, 4]
    q, k, v, sl = make_inputs(6, 2, 8, 2, 64, [5000] * 6, BF16, DEV, nan_tail=False)
    # SM counts at which the rule takes a list: CuTe plans aim at one split CTA per SM (two paged)
    num_sms = 64 if backend == "cutlass" and not paged else 32
    p = splitkv.plan(sl, 8, 2, 64, q_len=2, num_sms=num_sms, backend=backend, paged=paged)
    assert p.work is not None and p.work_items < 6 * p.max_splits
    for lens in (lens_a, lens_b, lens_a):  # the third call takes the lean path
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        kk, vv, bt = to_paged(k, v, [5000] * 6, 16) if paged else (k, v, None)
        o, lse = splitkv.decode(q, kk, vv, sl, block_table=bt, plan=p, return_lse=True)
        assert int(p.num_splits.sum()) > 6  # some request split
        assert_close_to_reference(o, lse, q, kk, vv, sl, block_table=bt, lowp_k=k, lowp_v=v)


def test_plan_allocation_thread_is_made_once_per_process():
    """workspace.outside_graph_pools runs a CUDA plan's allocations on one long-lived helper thread:
    a thread per plan cost its start and CUDA's per-thread setup on every splitkv.plan()."""
    import os
    import threading

    from splitkv import workspace

    first = workspace._helper()
    idents = {first.submit(threading.get_ident).result() for _ in range(3)}
    assert workspace._helper() is first and len(idents) == 1 and threading.get_ident() not in idents
    workspace._HELPER = (os.getpid() + 1, first)  # as a forked child sees its parent's helper
    try:
        assert workspace._helper() is not first
    finally:
        workspace._HELPER[1].shutdown()
        workspace._HELPER = (os.getpid(), first)


@pytest.mark.gpu
def test_plans_stay_out_of_a_graph_pool_the_thread_allocates_to():
    """A plan made while the thread's allocations go to a CUDA-graph pool on a side stream (what
    torch.compile's cudagraph trees do during warm-up) leaves that pool empty; one made on the
    default stream allocates in place (workspace.outside_graph_pools)."""
    dev = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    lens = torch.tensor([5000, 40], dtype=torch.int32, device="cuda")
    with torch.cuda.stream(side):
        torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pool)
        try:
            p = splitkv.plan(lens, 8, 2, 64, backend="triton")
            assert torch._C._cuda_checkPoolLiveAllocations(dev, pool, set())  # nothing of p in it
        finally:
            torch._C._cuda_endAllocateToPool(dev, pool)
            torch._C._cuda_releasePool(dev, pool)
    torch.cuda.synchronize()
    assert p.o_part is not None and p.num_splits.tolist()[0] > 1
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [5000, 40], BF16, DEV)
    o, lse = splitkv.decode(q, k, v, sl, plan=p, return_lse=True)
    assert_close_to_reference(o, lse, q, k, v, sl)


def test_plan_cache_is_bounded_and_keeps_captured_plans(monkeypatch):
    """A cache grown by torch.cat makes a new signature (and plan) per step: past MAX_PLANS the
    oldest plans go with their signatures, except one a CUDA-graph capture ran (it may be replayed);
    decode stays right after an eviction."""
    from splitkv import execute, validate

    monkeypatch.setattr(execute, "MAX_PLANS", 8)
    splitkv.clear_plans()
    q, k, v, _ = make_inputs(1, 1, 8, 2, 64, [600], BF16, DEV)
    splitkv.decode(q, k[:, :300], v[:, :300], torch.tensor([300], dtype=torch.int32, device=DEV))
    (first,) = execute._PLANS.values()
    first.captured[0] = True  # as DecodePlan.schedule_if_new marks a plan run under capture
    for L in range(301, 330):
        sl = torch.tensor([L], dtype=torch.int32, device=DEV)
        o, lse = splitkv.decode(q, k[:, :L], v[:, :L], sl, return_lse=True)
        assert len(execute._PLANS) <= 8
    assert_close_to_reference(o, lse, q, k[:, :329], v[:, :329], sl)
    assert first in execute._PLANS.values()  # the captured plan stayed
    assert len(validate._SEEN) <= 8 + 1  # the evicted plans' signatures went with them
    L = 400
    while len(execute._PLANS) < 8:
        L += 1
        splitkv.decode(q, k[:, :L], v[:, :L], torch.tensor([L], dtype=torch.int32, device=DEV))
    for p in execute._PLANS.values():  # every plan captured: the one a call makes still stays
        p.captured[0] = True
    sl = torch.tensor([500], dtype=torch.int32, device=DEV)
    splitkv.decode(q, k[:, :500], v[:, :500], sl)
    assert len(execute._PLANS) == 9 and list(execute._PLANS.values())[-1].max_seqlen == 500
    with pytest.raises(TypeError, match="batch_invariant: expected a bool"):
        splitkv.decode(q, k[:, :500], v[:, :500], sl, batch_invariant=0)
    splitkv.clear_plans()
