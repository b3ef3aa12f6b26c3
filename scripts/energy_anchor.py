"""Energy per call under sustained load for the anchors (FlashAttention-4, torch's cuDNN), measured
the way `sdpa bench --energy-s` measures ours, to sit next to it in one device call:

    bash .gpu/run bin sdpa bench --backend cutlass --problem s8k-d128 --dtype bf16 --energy-s 8
    bash .gpu/run shell "python3 $PWD/scripts/energy_anchor.py --anchors $PWD/.gpu \\
        --shapes s8k-d128 --dtypes bf16 --backends fa4,cudnn --seconds 8"

Each problem is captured into a CUDA graph of calls lasting about 2 ms and replayed back to back in
batches of 8 for `--seconds`; the first quarter warms the GPU up to the clock and power it holds
under load, and over the rest the board's energy counter (NVML) gives energy per call, with the mean
power and the SM clock sampled every 50 ms. Dense problems (the anchor script's SHAPES) only.
"""
import argparse, importlib.util, json, time
import pynvml
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend


def load_anchor(directory):
    spec = importlib.util.spec_from_file_location("sdpa_anchor", f"{directory}/sdpa_anchor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def problem_fn(anchor, name, dtype, backend):
    """The call to time and the context it is captured in, for a dense problem."""
    b, h, s, d, causal = anchor.SHAPES[name]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    if backend == "fa4":
        from flash_attn.cute import flash_attn_func
        return (lambda: flash_attn_func(q, k, v, causal=causal)[0]), torch.no_grad()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)), \
        sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def nvml_handle():
    pynvml.nvmlInit()
    p = torch.cuda.get_device_properties(0)
    try:
        return pynvml.nvmlDeviceGetHandleByPciBusId(f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0")
    except AttributeError:  # a torch without the PCI fields
        return pynvml.nvmlDeviceGetHandleByIndex(0)


def sustain(fn, seconds, nv):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fn(); e.record(); e.synchronize()
    call_us = max(s.elapsed_time(e) * 1e3, 1.0)
    calls = min(max(int(2000 / call_us), 2), 200)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()

    def run_for(secs, clocks):
        t0, replays, last = time.perf_counter(), 0, 0.0
        while replays == 0 or time.perf_counter() - t0 < secs:
            for _ in range(8):
                g.replay()
            replays += 8
            if clocks is not None and time.perf_counter() - last >= 0.05:
                last = time.perf_counter()
                clocks.append(pynvml.nvmlDeviceGetClockInfo(nv, pynvml.NVML_CLOCK_SM))
            torch.cuda.synchronize()
        return replays

    run_for(seconds / 4, None)
    clocks = []
    e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(nv), time.perf_counter()
    replays = run_for(seconds * 3 / 4, clocks)
    t1, e1 = time.perf_counter(), pynvml.nvmlDeviceGetTotalEnergyConsumption(nv)
    n = replays * calls
    joules = (e1 - e0) * 1e-3
    return dict(sustained_us=(t1 - t0) * 1e6 / n, mj_per_call=joules * 1e3 / n, sustained_watts=joules / (t1 - t0),
                sustained_sm_mhz=sum(clocks) / len(clocks) if clocks else float("nan"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", required=True, help="directory holding sdpa_anchor.py (.gpu/ after staging)")
    ap.add_argument("--shapes", default="s8k-d128")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--backends", default="fa4,cudnn")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    anchor = load_anchor(a.anchors)
    nv = nvml_handle()
    torch.manual_seed(0)
    rows = []
    print(f"{'problem':18s} {'dtype':5s} {'backend':12s} {'us per call':>12s} {'mJ per call':>12s} {'W':>7s} {'SM MHz':>7s}")
    for name in a.shapes.split(","):
        for dn in a.dtypes.split(","):
            for bn in a.backends.split(","):
                fn, ctx = problem_fn(anchor, name, anchor.DTYPES[dn], bn)
                with ctx:
                    r = sustain(fn, a.seconds, nv)
                bname = bn if bn == "fa4" else "torch-" + bn
                rows.append(dict(name=name, dtype=dn, backend=bname, seconds=a.seconds, **r))
                print(f"{name:18s} {dn:5s} {bname:12s} {r['sustained_us']:12.2f} {r['mj_per_call']:12.3f} "
                      f"{r['sustained_watts']:7.1f} {r['sustained_sm_mhz']:7.0f}", flush=True)
                del fn
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
