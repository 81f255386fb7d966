"""Preallocated fp32 workspace for split partials: partial O and partial LSE.

Layouts (split axis leads, so one split's rows are contiguous and the merge strides over it):
    o_part   [max_splits, B, Hq, Sq, D]  fp32, each split's *normalised* output
    lse_part [max_splits, B, Hq, Sq]     fp32, natural-log LSE of that split (-inf when empty)

Every plan owns its buffer (allocated once, when the plan is made, carved into 128-byte aligned
views): a graph replays fixed addresses, and two streams or threads never share partials (decode()
without a plan keeps one plan per input signature and stream, or thread on the CPU).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

ALIGN = 128


def outside_graph_pools(make, device: torch.device):
    """make() (which allocates and initialises a plan's tensors), run so that its memory comes from
    the ordinary caching allocator, not from a CUDA-graph pool the calling thread may be allocating
    to: torch.compile's cudagraph trees warm a step up eagerly with every allocation of the thread
    routed to the graph's pool, and refuse to record while a tensor they do not track lives there
    (a plan outlives the step). So on CUDA, outside a capture, make() runs on a helper thread (the
    pool routing is per thread) and the current stream waits for its work (no host sync). Inside a
    capture it runs here: the capture's pool holds the plan, whose initialising kernels the graph
    records. The helper thread lives as long as the process: a new thread per plan paid thread
    start and CUDA's per-thread setup each time (H200: splitkv.plan() 713-957 us of host time).
    On the device's default stream make() runs here too, without the hand-off: cudagraph trees
    route a thread to their pool only while it runs on their own side stream
    (torch._inductor.cudagraph_trees._use_cuda_memory_pool_manager)."""
    if (device.type != "cuda" or torch.cuda.is_current_stream_capturing()
            or torch.cuda.current_stream(device) == torch.cuda.default_stream(device)):
        return make()

    def work():
        with torch.cuda.device(device):
            value = make()
            done = torch.cuda.Event()
            done.record()
            return value, done

    value, done = _helper().submit(work).result()
    torch.cuda.current_stream(device).wait_event(done)
    return value


_HELPER: tuple[int, ThreadPoolExecutor] | None = None
_HELPER_LOCK = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    """The process's plan-allocation thread (made again in a forked child, which has no threads)."""
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None or _HELPER[0] != os.getpid():
            _HELPER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitkv-plan-alloc"))
        return _HELPER[1]


def _round_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def partial_sizes(max_splits: int, batch: int, num_q_heads: int, q_len: int, head_dim: int):
    o_shape = (max_splits, batch, num_q_heads, q_len, head_dim)
    lse_shape = (max_splits, batch, num_q_heads, q_len)
    o_bytes = _round_up(4 * max_splits * batch * num_q_heads * q_len * head_dim)
    lse_bytes = _round_up(4 * max_splits * batch * num_q_heads * q_len)
    return o_shape, lse_shape, o_bytes + lse_bytes


def allocate(nbytes: int, device) -> torch.Tensor:
    """A fresh byte buffer whose data pointer is 128-byte aligned."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift:shift + nbytes]


def carve(buf: torch.Tensor, o_shape, lse_shape):
    """Aligned fp32 views (o_part, lse_part) at the head of buf."""
    o_numel = 1
    for s in o_shape:
        o_numel *= s
    lse_numel = 1
    for s in lse_shape:
        lse_numel *= s
    o_off = _round_up(4 * o_numel)
    o_part = buf[: 4 * o_numel].view(torch.float32).view(o_shape)
    lse_part = buf[o_off: o_off + 4 * lse_numel].view(torch.float32).view(lse_shape)
    return o_part, lse_part
