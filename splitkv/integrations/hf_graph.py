"""Decode steps of a Hugging Face model through fixed-shape buffers, captured as CUDA graphs.

An eager decode step of a 32-layer model is ~a thousand small launches, each paying Python and
launch overhead: at short contexts the step's host time, not its memory traffic, sets its speed.
Here the whole step — embedding, every layer's projections, the K/V write into the paged cache,
splitkv attention, the LM head — is one CUDA graph replayed per step:

  * host, per step: `PagedKVCache.extend(seq_ids, 1)` gives every request its slot for the new
    token (page bookkeeping, which a graph cannot replay), `batch()` its block table and lengths
    (one host->device copy); both, with the tokens, are copied into the graph's static buffers;
  * graph: position = length - 1 (the paged cache holds no padding, so a request's next position is
    its cache length), `PagedKVCache.write` puts each layer's new K/V at that slot, the step's
    split table is scheduled on the device once (DecodePlan.refresh at the first layer), decode
    reads the static block table; the logits land in a static buffer.

One graph per (batch bucket, block-table width): a batch of B runs in the smallest bucket >= B with
padding rows of length 0 (they write nothing and attend to nothing: o = 0), so a continuous
batch whose size changes every step replays a handful of graphs; the width (pages per request)
doubles as requests grow, so long generations recapture O(log length) times. All graphs share one
memory pool. Capture first runs the step eagerly on a side stream (Triton compiles, the plans are
made, and that run's logits are the step's result); if capture then fails, the bucket runs the same
fixed-shape step eagerly and the log says why. generate / Engine use these steps on CUDA only;
GraphSteps(capture=False) runs the same fixed-shape step eagerly anywhere (what the CPU tests
check against transformers' generate).

Shared prompts (DecodeState.groups, set by Engine(share_prefix=True)): the step also gets each
group's member rows and shared pages; the attention then reads each group's prefix pages once
(cascade.group_prefix_decode, the members folded into the query heads) and every row's own suffix,
and merges the two states. Graphs are then keyed by the member slots per group too.

compile=True: inside the captured step, every RMSNorm and every decoder layer's MLP runs through
torch.compile (Inductor fuses a norm's ~6 kernels and the MLP's activation into one each; the
GEMMs stay cuBLAS; no CUDA graphs of its own: ours capture the compiled kernels). The modules'
forward is swapped only while a step body runs, so the user's model is untouched between steps and
prefill never compiles. Measured on the H200 (random Llama-3-8B shape, bf16, 32K context,
benchmarks/results/2026-12-02-h200-hf): graph 8.47 -> 7.60 ms per step at B=1, 15.29 -> 13.94
at B=8 (the eager step: 31.3 / 39.8 ms). Off by default all the same: the first step of each batch
bucket pays the compilation (not yet measured), which a first request should not wait for.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch

from ..cache import table_window

log = logging.getLogger("splitkv")
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH = 16  # pages per request of the narrowest graph
COMPILE_BACKEND = "inductor"  # torch.compile backend of compile=True (the CPU tests use "eager")


def compiled_parts(model) -> list:
    """(module, compiled forward) for each RMSNorm and each decoder layer's MLP of the model: one
    torch.compile of each class's forward, shared by all its instances."""
    fns, parts = {}, []
    for name, mod in model.named_modules():
        cls = type(mod)
        if cls.__name__.endswith("RMSNorm") or name.endswith(".mlp"):
            if cls not in fns:
                fns[cls] = torch.compile(cls.forward, backend=COMPILE_BACKEND)
            parts.append((mod, functools.partial(fns[cls], mod)))
    return parts


@contextlib.contextmanager
def swapped_forward(parts):
    """Within the block each module's forward is its compiled one (restored on exit)."""
    saved = [(mod, mod.__dict__.get("forward")) for mod, _ in parts]
    for mod, fwd in parts:
        mod.forward = fwd
    try:
        yield
    finally:
        for mod, old in saved:
            if old is None:
                del mod.forward
            else:
                mod.forward = old


def bucket_for(batch: int) -> int:
    """The padded batch a step of `batch` requests runs at."""
    for b in BUCKETS:
        if b >= batch:
            return b
    return -(-batch // 64) * 64


def members_for(largest_group: int) -> int:
    """Member slots per group of the graph for groups of at most `largest_group` requests (1: none)."""
    return 1 if largest_group < 2 else 1 << (largest_group - 1).bit_length()


def width_for(pages: int, num_pages: int) -> int:
    """Block-table width of the graph for a batch whose longest request holds `pages` pages."""
    return min(num_pages, max(MIN_WIDTH, 1 << max(pages - 1, 0).bit_length()))


@dataclass
class StepIO:
    """One fixed-shape step: its static inputs, derived slot tensors, output, plans and graph."""

    tokens: torch.Tensor  # int64 [Bb, 1]
    block_table: torch.Tensor  # int32 [Bb, W]
    seqlens: torch.Tensor  # int32 [Bb]: each request's length including this step's token; 0 = padding
    starts: torch.Tensor | None = None  # int32 [Bb]: the new token's position (set by the body)
    ntok: torch.Tensor | None = None  # int32 [Bb]: 1 for a request, 0 for padding
    logits: torch.Tensor | None = None  # [Bb, vocab]
    # shared prompt prefixes (DecodeState.groups): group g's member rows (Bb = empty slot), its shared
    # pages, and each row's shared pages; the body derives the suffix tables and lengths from them
    members: torch.Tensor | None = None  # int64 [Bb, n]
    group_pages: torch.Tensor | None = None  # int32 [Bb]
    row_pages: torch.Tensor | None = None  # int32 [Bb]
    prefix_lens: torch.Tensor | None = None
    suffix_lens: torch.Tensor | None = None
    suffix_table: torch.Tensor | None = None
    # this step's cascade.prefix_gather, keyed by (q_len, q heads, KV heads): made at the first layer
    gathers: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)  # the attention's plans at this shape, one per variant
    graph: object = None  # torch.cuda.CUDAGraph once captured
    eager: bool = False  # capture failed (or no CUDA): run the body eagerly


class GraphSteps:
    """Fixed-shape (and, on CUDA, graph-captured) decode steps over one DecodeState's cache; see
    the module doc. `capture=False` runs the same steps without graphs; `compile=True` runs the
    norms and MLPs through torch.compile inside them."""

    def __init__(self, model, state, *, capture: bool = True, compile: bool = False) -> None:
        self.model, self.state = model, state
        self.capture = capture and state.cache.device.type == "cuda"
        self.parts = compiled_parts(model) if compile else []
        self.steps: dict[tuple[int, int, int], StepIO] = {}  # (batch bucket, pages/request, members/group)
        self.pool = None
        self._kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per request (tokens [B]) -> next-token logits [B, vocab]."""
        from . import hf

        st, cache = self.state, self.state.cache
        B = len(st.seq_ids)
        cache.extend(st.seq_ids, 1)
        table, lens = cache.batch(st.seq_ids)
        groups = st.groups or []
        key = (bucket_for(B), width_for(table.shape[1], cache.num_pages),
               members_for(max((len(rows) for rows, _ in groups), default=1)))
        io = self.steps.get(key)
        if io is None:
            io = self.steps[key] = self._make(*key)
        io.tokens[:B].copy_(tokens.reshape(B, 1))
        io.block_table[:B, :table.shape[1]].copy_(table)
        io.seqlens[:B].copy_(lens)
        io.seqlens[B:].zero_()
        if io.members is not None:
            self._fill_groups(io, groups)
        with hf.use_splitkv(self.model) if self.model.config._attn_implementation != hf.ATTN_NAME \
                else contextlib.nullcontext():
            if io.graph is not None:
                io.graph.replay()
            elif io.eager or not self.capture:
                self._body(io)
            else:
                self._capture(io, key)
        st.positions += 1
        return io.logits[:B].clone()

    def _make(self, bucket: int, width: int, members: int) -> StepIO:
        dev = self.state.cache.device
        io = StepIO(tokens=torch.zeros(bucket, 1, dtype=torch.long, device=dev),
                    block_table=torch.zeros(bucket, width, dtype=torch.int32, device=dev),
                    seqlens=torch.zeros(bucket, dtype=torch.int32, device=dev))
        if members > 1:
            io.members = torch.full((bucket, members), bucket, dtype=torch.long, device=dev)
            io.group_pages = torch.zeros(bucket, dtype=torch.int32, device=dev)
            io.row_pages = torch.zeros(bucket, dtype=torch.int32, device=dev)
        return io

    @staticmethod
    def _fill_groups(io: StepIO, groups) -> None:
        """The step's groups into io's buffers (one host->device copy)."""
        Bb, n = io.members.shape
        members = torch.full((Bb, n), Bb, dtype=torch.long)
        group_pages = torch.zeros(Bb, dtype=torch.long)
        row_pages = torch.zeros(Bb, dtype=torch.long)
        for g, (rows, pages) in enumerate(groups):
            members[g, :len(rows)] = torch.tensor(rows)
            group_pages[g] = pages
            row_pages[rows] = pages
        flat = torch.cat((members.reshape(-1), group_pages, row_pages)).to(io.members.device)
        io.members.copy_(flat[:Bb * n].view(Bb, n))
        io.group_pages.copy_(flat[Bb * n:Bb * n + Bb])
        io.row_pages.copy_(flat[Bb * n + Bb:])

    def _body(self, io: StepIO) -> None:
        """The step on io's buffers: what the graph records."""
        from . import hf

        io.starts = (io.seqlens - 1).clamp(min=0)
        io.ntok = (io.seqlens > 0).to(torch.int32)
        if io.members is not None:  # each row's keys = its group's prefix pages, then its own suffix
            ps, W = self.state.cache.page_size, io.block_table.shape[1]
            io.suffix_table = table_window(io.block_table, io.row_pages, W)
            io.suffix_lens = io.seqlens - io.row_pages * ps
            io.prefix_lens = io.group_pages * ps
            io.gathers.clear()  # remade in this body, so that a capture records them
        st = self.state
        st.io = io
        st.refreshed.clear()
        token = hf._ACTIVE.set(st)
        try:
            with swapped_forward(self.parts):
                out = self.model(input_ids=io.tokens, position_ids=io.starts.long()[:, None], use_cache=False,
                                 **self._kw)
        finally:
            hf._ACTIVE.reset(token)
            st.io = None
        if io.logits is None:
            io.logits = out.logits[:, -1].clone()
        else:
            io.logits.copy_(out.logits[:, -1])

    def _capture(self, io: StepIO, key) -> None:
        # warm-up = this step's real run (kernels compile, plans are made, its logits are the result)
        side = torch.cuda.Stream(io.tokens.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(io)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self._body(io)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to the same step, eager
            log.warning("splitkv: CUDA-graph capture of the decode step (batch %d, %d pages/request) failed: "
                        "%s: %s; that shape runs eagerly", key[0], key[1], type(e).__name__, e)
            io.eager = True
            return
        io.graph = graph
        self.pool = graph.pool()
        log.info("splitkv: captured the decode step for batch %d, %d pages/request, %d-member groups", *key)
