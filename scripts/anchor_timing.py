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
