"""Timing shared by the anchor scripts that run on the GPU machine (mla_anchor.py,
cudnn_fp8_anchor.py, flashinfer_anchor.py): CUDA events around calls made back to back, the median
over rounds."""
import statistics

import torch


def time_events(fn, calls, rounds):
    """Median us per call: `calls` calls of fn back to back between two CUDA events, `rounds`
    times (no warm-up: the caller's)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(rounds):
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(ts)


def time_graph(fn, calls, rounds):
    """Median us per call: `calls` calls of fn captured in one CUDA graph (after three warm-up
    calls on a side stream), the graph replayed `rounds` times: the kernels without launch gaps,
    as `sdpa bench`'s us_graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    us = time_events(g.replay, 1, rounds) / calls
    del g
    return us
