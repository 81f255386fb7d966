"""splitkv custom ops: schema/fake checks (opcheck), torch.compile(fullgraph=True) over decode with
no graph break and results equal to eager and to the fp64 reference; CUDA-graph mode on the GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_inputs, to_paged
from torch._dynamo.utils import counters

import splitkv
from splitkv import ops
from splitkv.reference import decode_reference

BF16 = torch.bfloat16


def _graphs_backend(graphs):
    """A torch.compile backend that records each FX graph dynamo hands it, then runs it as is."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def _op_targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _step(q, k, v, seqlens, block_table=None, num_splits=None, softmax_scale=None, backend="torch"):
    """A model-like step: ops before and after decode, so the decode op sits inside one graph."""
    o, lse = splitkv.decode(q * 1.5, k, v, seqlens, block_table=block_table, num_splits=num_splits,
                            softmax_scale=softmax_scale, return_lse=True, backend=backend)
    return o * 2 + 1, lse


def test_opcheck_decode_and_merge():
    q, k, v, sl = make_inputs(2, 2, 8, 2, 64, [37, 5], torch.float32)
    torch.library.opcheck(torch.ops.splitkv.decode.default, (q, k, v, sl, None, True, None, 2, "torch"))
    kp, vp, bt = to_paged(k, v, [37, 5], 16)
    torch.library.opcheck(torch.ops.splitkv.decode.default, (q, kp, vp, sl, bt, False, 0.1, None, "torch"))
    o = torch.randn(3, 2, 2, 4, 64).permute(0, 1, 3, 2, 4)  # strided [S, B, H, T, D] view of [S, B, T, H, D]
    lse = torch.randn(3, 2, 4, 2)
    n = torch.tensor([3, 1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.splitkv.merge.default, (o, lse, n))


def test_compile_inductor_fullgraph_equals_eager_and_reference():
    # inductor on CPU compiles C++ once (~25 s cold, seconds when cached): one case only
    torch._dynamo.reset()
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [300, 17], torch.float32)
    step = torch.compile(_step, fullgraph=True)
    o, lse = step(q, k, v, sl)
    eo, e_lse = _step(q, k, v, sl)
    assert torch.allclose(o, eo, atol=1e-5, rtol=0) and torch.allclose(lse, e_lse, atol=1e-5, rtol=0)
    ro, rl = decode_reference(q * 1.5, k, v, sl)
    assert torch.allclose(o.double(), ro * 2 + 1, atol=1e-4) and torch.allclose(lse.double(), rl, atol=1e-4)


def test_compile_one_graph_reused_when_lengths_change():
    torch._dynamo.reset()
    graphs = []
    step = torch.compile(_step, fullgraph=True, backend=_graphs_backend(graphs))
    q, k, v, _ = make_inputs(3, 2, 8, 2, 64, [400, 400, 400], torch.float32, nan_tail=False)
    for lens in ([400, 1, 0], [17, 399, 260], [2, 3, 113]):
        sl = torch.tensor(lens, dtype=torch.int32)
        o, lse = step(q, k, v, sl, num_splits=3)
        ro, rl = decode_reference(q * 1.5, k, v, sl)
        assert not torch.isnan(o).any()
        assert torch.allclose(o.double(), ro * 2 + 1, atol=1e-4)
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), fin) and torch.allclose(lse.double()[fin], rl[fin], atol=1e-4)
    # lengths are tensor values, never guarded on: one graph, holding the op (not a graph break)
    assert len(graphs) == 1
    assert "splitkv.decode.default" in _op_targets(graphs[0])


def test_compile_triton_capacity_plan_follows_lengths():
    # Triton backend (interpreted here): the op plans for the cache's capacity, lengths on device
    torch._dynamo.reset()
    lens = [300, 300]
    q, k, v, _ = make_inputs(2, 1, 8, 2, 64, lens, BF16, nan_tail=False)
    kp, vp, bt = to_paged(k, v, lens, 64)
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    for new, want_chunks in (([300, 1], [128, 64]), ([0, 129], [64, 64])):
        sl = torch.tensor(new, dtype=torch.int32)
        with splitkv.debug.capture_partials() as recs:
            o, lse = step(q, kp, vp, sl, block_table=bt, num_splits=3, backend="triton")
        # 3 forced splits of each request's own keys, cut on the device from the new lengths (no sync)
        assert recs[0].num_splits.tolist() == [3, 3] and recs[0].plan.chunk_lens.tolist() == want_chunks
        ro, rl = decode_reference(q * 1.5, kp, vp, sl, block_table=bt)
        assert (o.double() - (ro * 2 + 1)).abs().max() < 3e-2
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), fin) and (lse.double()[fin] - rl[fin]).abs().max() < 1e-2



def test_compile_with_a_plan_runs_its_rule_and_checks_the_call():
    """decode(..., plan=p) under torch.compile(fullgraph=True): one graph through the op, p's backend
    and forced split count run, the result is the eager call's with p; a call p was not made for is
    refused, naming the mismatch."""
    torch._dynamo.reset()
    lens = [300, 1]
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, lens, BF16)
    kp, vp, bt = to_paged(k, v, lens, 64)
    p = splitkv.plan(sl, 8, 2, 64, num_splits=3, paged=True, backend="triton")
    graphs = []
    f = torch.compile(lambda q, k, v, sl, bt: splitkv.decode(q, k, v, sl, block_table=bt, plan=p, return_lse=True),
                      fullgraph=True, backend=_graphs_backend(graphs))
    with splitkv.debug.capture_partials() as recs:
        o, lse = f(q, kp, vp, sl, bt)
    assert recs[0].num_splits.tolist() == [3, 3] and recs[0].plan.backend == "triton"
    assert len(graphs) == 1 and "splitkv.decode.default" in _op_targets(graphs[0])
    eo, else_ = splitkv.decode(q, kp, vp, sl, block_table=bt, plan=p, return_lse=True)
    assert torch.equal(o, eo) and torch.equal(lse, else_)
    g = torch.compile(lambda q, k, v, sl: splitkv.decode(q, k, v, sl, plan=p), backend="aot_eager")
    with pytest.raises(ValueError, match=r"plan: made for a paged cache \(block_table\), but the call passes a contiguous"):
        g(q, k, v, sl)
    h = torch.compile(lambda q, k, v, sl, bt: splitkv.decode(q, k, v, sl, block_table=bt, plan=p, backend="torch"),
                      backend="aot_eager")
    with pytest.raises(ValueError, match="plan: made for backend 'triton', but the call asks for 'torch'"):
        h(q, kp, vp, sl, bt)
    for kw, match in ((dict(backend="tirton"), "backend: expected one of"), (dict(num_splits=0), "num_splits: expected"),
                      (dict(num_splits=5), "num_splits: the plan forces 3 splits")):
        bad = torch.compile(lambda q, k, v, sl, bt, kw=kw: splitkv.decode(q, k, v, sl, block_table=bt, plan=p, **kw),
                            backend="aot_eager")
        with pytest.raises(ValueError, match=match):
            bad(q, kp, vp, sl, bt)



def test_compile_with_a_plan_of_another_device_is_refused():
    torch._dynamo.reset()
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [300, 1], BF16)
    p = splitkv.plan(sl, 8, 2, 64)
    elsewhere = dataclasses.replace(p, device=torch.device("cuda", 0))  # stands in for a plan made on a GPU
    moved = torch.compile(lambda q, k, v, sl: splitkv.decode(q, k, v, sl, plan=elsewhere), backend="aot_eager")
    with pytest.raises(ValueError, match="plan: made for cuda:0, but the inputs are on cpu"):
        moved(q, k, v, sl)

def test_compile_paged_scale_and_optional_args():
    torch._dynamo.reset()
    lens = [113, 0, 40]
    q, k, v, sl = make_inputs(3, 2, 8, 2, 64, lens, torch.float32)
    kp, vp, bt = to_paged(k, v, lens, 16)
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    o, lse = step(q, kp, vp, sl, block_table=bt, softmax_scale=0.07)
    ro, rl = decode_reference(q * 1.5, kp, vp, sl, block_table=bt, softmax_scale=0.07)
    assert torch.allclose(o.double(), ro * 2 + 1, atol=1e-4)
    assert torch.all(o[1] == 1) and torch.all(lse[1] == float("-inf"))  # empty request: o = 0


def test_compile_out_argument():
    torch._dynamo.reset()
    q, k, v, sl = make_inputs(2, 1, 4, 4, 64, [50, 9], torch.float32)

    def f(q, k, v, sl, out):
        return splitkv.decode(q, k, v, sl, out=out, backend="torch")

    out = torch.empty_like(q)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, sl, out)
    ro, _ = decode_reference(q, k, v, sl)
    assert torch.allclose(got.double(), ro, atol=1e-5) and torch.allclose(out.double(), ro, atol=1e-5)


def test_append_op_in_place_and_compiled():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    P, ps, H, D = 6, 4, 2, 64
    k = torch.randn(2, 3, H, D, generator=g)
    v = torch.randn(2, 3, H, D, generator=g)
    pages = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    starts = torch.tensor([2, 5], dtype=torch.int32)
    ntok = torch.tensor([3, 2], dtype=torch.int32)

    def write(kp, vp):
        ops.append_kv(kp, vp, k, v, pages, starts, ntok, backend="torch")

    for fn in (write, torch.compile(write, fullgraph=True, backend="aot_eager")):
        kp = torch.zeros(P, ps, H, D)
        vp = torch.zeros(P, ps, H, D)
        fn(kp, vp)
        # seq 0: positions 2, 3 -> page 4 slots 2, 3; position 4 -> page 1 slot 0
        assert torch.equal(kp[4, 2:4], k[0, :2]) and torch.equal(kp[1, 0], k[0, 2])
        # seq 1: positions 5, 6 -> page 0 slots 1, 2 (its first touched page is pages[1, 0])
        assert torch.equal(vp[0, 1:3], v[1, :2])
        assert kp.count_nonzero() == 5 * H * D  # nothing else written (row t=2 of seq 1 skipped)
    torch.library.opcheck(torch.ops.splitkv.append.default,
                          (kp, vp, k, v, pages, starts, ntok, None, None, True, "torch"))
    with pytest.raises(ValueError, match="backend"):
        ops.append_kv(kp, vp, k, v, pages, starts, ntok, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_gpu_compile_inductor_equals_eager(backend):
    torch._dynamo.reset()
    lens = [5000, 37, 1200]
    q, k, v, sl = make_inputs(3, 1, 32, 8, 128, lens, BF16, device="cuda")
    step = torch.compile(_step, fullgraph=True)
    o, lse = step(q, k, v, sl, backend=backend)
    eo, e_lse = _step(q, k, v, sl, backend=backend)
    # the op plans for the cache's capacity (graph-safe), eager decode for the actual lengths: the
    # split counts may differ, so the two agree to bf16 rounding, not bitwise
    assert (o.float() - eo.float()).abs().max() < 2e-2 and (lse - e_lse).abs().max() < 1e-3
    ro, _ = decode_reference(q * 1.5, k, v, sl)
    assert (o.double() - (ro * 2 + 1)).abs().max() < 5e-2


def _step_with(p):
    def step(q, k, v, seqlens, block_table=None, backend="auto"):
        o, lse = splitkv.decode(q * 1.5, k, v, seqlens, block_table=block_table, return_lse=True, plan=p,
                                backend=backend)
        return o * 2 + 1, lse
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("with_plan", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_reduce_overhead_cuda_graphs_follow_lengths(paged, with_plan):
    torch._dynamo.reset()
    Lmax = 8192
    q, k, v, _ = make_inputs(2, 1, 32, 8, 128, [Lmax - 3, Lmax - 3], BF16, device="cuda", nan_tail=False)
    bt = None
    if paged:
        k, v, bt = to_paged(k, v, [Lmax - 3, Lmax - 3], 64)
    counters.clear()
    if with_plan:  # the plan's checks and backend, through the op (fullgraph: no graph break)
        p = splitkv.plan(torch.tensor([100, 4000], dtype=torch.int32, device="cuda"), 32, 8, 128,
                         max_seqlen=Lmax, paged=paged, backend="triton")
    step = torch.compile(_step_with(p) if with_plan else _step, fullgraph=True, mode="reduce-overhead")
    # warm-up, recording and replays: the replays must follow the new lengths (device split table)
    for lens in ([100, 4000], [8000, 1], [2500, 7777], [0, 64], [4097, 300]):
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        o, lse = step(q, k, v, sl, block_table=bt, backend="triton")
        o, lse = o.clone(), lse.clone()  # graph outputs are overwritten by the next replay
        ro, rl = decode_reference(q * 1.5, k, v, sl, block_table=bt)
        assert (o.double() - (ro * 2 + 1)).abs().max() < 5e-2, lens
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (lse.double()[fin] - rl[fin]).abs().max() < 1e-2
    assert counters["inductor"]["cudagraph_skips"] == 0  # the step really ran as a CUDA graph


def test_decode_with_a_plan_under_compile_on_the_cpu():
    """decode(plan=p) inside torch.compile (through the op) equals the eager call with p, also after
    the lengths change."""
    q, k = torch.randn(2, 1, 4, 64), torch.randn(2, 80, 2, 64)
    v, sl = torch.randn_like(k), torch.tensor([70, 33], dtype=torch.int32)
    p = splitkv.plan(sl, 4, 2, 64, max_seqlen=80)
    f = torch.compile(lambda q, k, v, sl: splitkv.decode(q, k, v, sl, plan=p), backend="aot_eager")
    assert torch.equal(f(q, k, v, sl), splitkv.decode(q, k, v, sl, plan=p))
    sl2 = torch.tensor([12, 80], dtype=torch.int32)
    p.refresh(sl2)
    assert torch.equal(f(q, k, v, sl2), splitkv.decode(q, k, v, sl2, plan=p))
