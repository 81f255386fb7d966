"""Which CUDA-graph capture, if any, the current stream is recording into.

decode() without a plan records its split-table launch (the schedule) ahead of its split launch,
and skips it when the lengths are the very tensor of the plan's last schedule, unmodified
(DecodePlan.schedule_if_new): the layers of one step share one schedule. Under capture the same
holds within one capture, and only there: a schedule recorded earlier in this capture replays
before every later call of the capture on that stream, while one that ran eagerly, or was recorded
into another graph, does not run when this graph replays. So a plan remembers where its last
schedule went: None (eagerly), or the capture's id (cudaStreamGetCaptureInfo's, unique over the
process). Where the id cannot be read (no cuda-python, which the CuTe DSL brings), a fresh token
that equals nothing stands in, and every captured call records its own schedule, as it always may.

A graph of a whole model step made of plain decode calls thus replays one schedule per step, not
one per layer.
"""

from __future__ import annotations

import torch

_runtime: list = []  # [cuda.bindings.runtime or None], imported on the first capture


def _capture_id(stream_handle: int) -> int | None:
    if not _runtime:
        try:
            from cuda.bindings import runtime
        except ImportError:
            runtime = None
        _runtime.append(runtime)
    rt = _runtime[0]
    if rt is None:
        return None
    try:  # (err, status, id, ...) in every cuda-python release; anything unexpected: no id
        res = rt.cudaStreamGetCaptureInfo(rt.cudaStream_t(init_value=stream_handle))
        if res[0] != rt.cudaError_t.cudaSuccess or res[1] != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
            return None
        return int(res[2])
    except Exception:  # noqa: BLE001 - a binding that differs costs one schedule per captured call, never an error
        return None


def token(device: torch.device):
    """None outside a capture; in one, its id, or a fresh object (equal to nothing) where the id
    cannot be read."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    cid = _capture_id(torch.cuda.current_stream(device).cuda_stream)
    return object() if cid is None else cid
