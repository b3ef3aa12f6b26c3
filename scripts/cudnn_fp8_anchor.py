"""Reference timings of cuDNN's FP8 (e4m3) attention forward on the GPU machine.

Run it in the same device call as the project's own bench (figures from different runs or machines
are not comparable). The Python cuDNN frontend comes from scripts/cudnn-fp8-pack (unpack the
archive, put the folder on PYTHONPATH); cuDNN itself is torch's (nvidia-cudnn-cu13):

    mkdir -p /tmp/cudnnfe && tar -C /tmp/cudnnfe -xf .gpu/cudnnfe.txz
    PYTHONPATH=/tmp/cudnnfe python3 scripts/cudnn_fp8_anchor.py \\
        --shapes s8k-d128,s16k-d128-causal,s8k-d256,s8k-d256-causal,s1k-d64,mission --json $OUT/cudnn-fp8.json

Shapes: the names of shared/anchors/sdpa_anchor.py's SHAPES, or B,H,S,D[,causal]. Q, K, V are
N(0, 1) values rounded to e4m3 (descale 1) in BSHD memory (cuDNN sees BHSD dims with BSHD strides).
One cuDNN graph per shape: sdpa_fp8, attn_scale 1/sqrt(D), causal = the frontend's use_causal_mask
(top-left; the same as bottom-right on these square problems), inference (no softmax stats).
P is rounded to e4m3 as P * scale_s with scale_s 256 (P, before the row sum, lies in (0, 1]; as the
project's fast mode does); the output is bf16 where cuDNN allows it (Blackwell, cuDNN >= 9.13),
else e4m3 with a power-of-two scale_o from the reference's amax (Hopper: FP8 output only).
Each record (a JSON list, like sdpa_anchor.py's): name, batch, heads, seq_q, seq_k, head_dim,
causal, dtype "e4m3", out_dtype, backend "cudnn-fp8", us_graph (median us per call over CUDA-graph
replays of many calls; the us_event figure where capture fails, timing says which), us_event
(median us per call of plain execute() calls back to back between CUDA events, Python included),
us (= us_graph), tflops (4*B*H*S*S*D, halved when causal, over us), rel_err (||O - ref|| / ||ref||
against torch's float32 SDPA on the dequantized inputs), max_rel (max |O - ref| / max |ref|),
cudnn (backend version), frontend (its version), device.
Exit status: 2 if the frontend cannot be loaded, 1 if any shape could not be built or run.
"""
import argparse, glob, json, math, os, sys, traceback
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

from anchor_timing import time_events

SHAPES = {  # name: (batch, heads, seq, head_dim, causal), as in shared/anchors/sdpa_anchor.py
    "mission": (2, 8, 256, 64, False),
    "mission-causal": (2, 8, 256, 64, True),
    "s1k-d64": (4, 16, 1024, 64, False),
    "s2k-d128": (4, 16, 2048, 128, False),
    "s4k-d128-causal": (2, 16, 4096, 128, True),
    "s8k-d128": (1, 16, 8192, 128, False),
    "s16k-d128-causal": (1, 16, 16384, 128, True),
    "s8k-d256": (1, 16, 8192, 256, False),
    "s8k-d256-causal": (1, 16, 8192, 256, True),
}
SCALE_S = 256.0  # P in (0, 1] -> (0, 256]: e4m3 normal range, power of two (exact descale)
TOL = 0.1  # rel_err above which a result is flagged (e4m3 P and output give ~2-4e-2)


def why(ex):
    msg = str(ex).strip().splitlines()
    return f"{type(ex).__name__}: {msg[0] if msg else ''}"[:300]


def parse_shapes(text):
    """[(name, (batch, heads, seq, head_dim, causal))] from names and B,H,S,D[,causal] groups
    in one comma-separated list (four numbers start a custom shape; 'causal' may follow them)."""
    toks, out = [t for t in text.split(",") if t], []
    while toks:
        t = toks.pop(0)
        if t in SHAPES:
            out.append((t, SHAPES[t]))
            continue
        if not (t.isdigit() and len(toks) >= 3 and all(x.isdigit() for x in toks[:3])):
            sys.exit(f"unknown shape {t!r}: a name of {', '.join(SHAPES)} or B,H,S,D[,causal]")
        b, h, n, d = int(t), *map(int, toks[:3])
        del toks[:3]
        causal = bool(toks) and toks[0] == "causal"
        if causal:
            toks.pop(0)
        out.append((f"b{b}-h{h}-s{n}-d{d}" + ("-causal" if causal else ""), (b, h, n, d, causal)))
    return out


def loaded(prefix):
    """Path of an already mapped shared library whose file name starts with prefix, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if os.path.basename(p).startswith(prefix):
                return p
    return None


def load_frontend():
    """Import the frontend so that it binds the cuDNN torch uses (not whatever dlopen finds first):
    the frontend takes the first libcudnn.so.9 in a folder of LD_LIBRARY_PATH, read at import."""
    torch.backends.cudnn.version()  # makes torch load its libcudnn
    # else where nvidia-cudnn-cu13 puts it next to torch (cuDNN then finds NVRTC and cuBLAS itself:
    # its libraries carry RUNPATH $ORIGIN/../../cu13/lib and the like)
    site = os.path.dirname(os.path.dirname(torch.__file__))
    lib = loaded("libcudnn.so") or next(iter(glob.glob(os.path.join(site, "nvidia/cudnn/lib/libcudnn.so.9"))), None)
    if lib:
        os.environ["LD_LIBRARY_PATH"] = os.path.dirname(lib) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    try:
        import cudnn
    except ImportError as ex:
        print(f"cannot import the cuDNN frontend ({why(ex)}): unpack scripts/cudnn-fp8-pack's archive "
              f"and put its folder on PYTHONPATH", file=sys.stderr)
        sys.exit(2)
    try:
        ver = cudnn.backend_version()
    except Exception as ex:  # noqa: BLE001 - RuntimeError when the frontend found no libcudnn
        print(f"the cuDNN frontend found no usable libcudnn ({why(ex)}); torch's: {lib}; "
              f"LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')}", file=sys.stderr)
        sys.exit(2)
    print(f"# cudnn frontend {cudnn.__version__} from {os.path.dirname(cudnn.__file__)}, backend {ver} "
          f"({loaded('libcudnn.so') or lib}), torch's cudnn {torch.backends.cudnn.version()}", flush=True)
    if ver != torch.backends.cudnn.version():
        print(f"# warning: the frontend bound cuDNN {ver}, torch uses {torch.backends.cudnn.version()}", flush=True)
    return cudnn


def pow2_scale(amax, target=64.0):
    """Power of two bringing amax to (target/2, target]: e4m3 (max 448) with headroom, exact inverse."""
    return 2.0 ** math.floor(math.log2(target / max(amax, 1e-30)))


class Fp8Sdpa:
    """One built cuDNN sdpa_fp8 graph with its buffers; calling it runs the forward once."""

    def __init__(self, cudnn, handle, q, k, v, causal, out_dtype, scale_o):
        b, s, h, d = q.shape
        dims, strides = (b, h, s, d), (s * h * d, d, h * d, 1)  # BHSD dims over BSHD memory
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        tq, tk, tv = (g.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
        one = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        ts = {n: g.tensor(name=n, **one) for n in names}
        o, _, amax_s, amax_o = g.sdpa_fp8(q=tq, k=tk, v=tv, **ts, generate_stats=False,
                                          attn_scale=1.0 / math.sqrt(d), use_causal_mask=causal, name="sdpa_fp8")
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(
            cudnn.data_type.BFLOAT16 if out_dtype == torch.bfloat16 else e4m3)
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.out = torch.empty(b, s, h, d, device="cuda", dtype=out_dtype)
        scalar = lambda x: torch.full((1, 1, 1, 1), x, device="cuda", dtype=torch.float32)
        vals = dict(descale_q=1.0, descale_k=1.0, descale_v=1.0, descale_s=1.0 / SCALE_S, scale_s=SCALE_S,
                    scale_o=scale_o)
        self.amax = (scalar(0.0), scalar(0.0))
        self.pack = {tq: q, tk: k, tv: v, o: self.out, amax_s: self.amax[0], amax_o: self.amax[1]}
        self.pack.update({ts[n]: scalar(vals[n]) for n in names})
        self.ws = torch.empty(max(g.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
        self.graph, self.handle, self.cudnn = g, handle, cudnn

    def __call__(self):
        self.graph.execute(self.pack, self.ws, handle=self.handle)


def time_graph(op, calls, rounds):
    """Median us per call: `calls` calls captured in one CUDA graph (cuDNN's handle on the capture
    stream), the graph replayed `rounds` times."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    op.cudnn.set_stream(op.handle, side.cuda_stream)
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                op()
        side.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for _ in range(calls):
                op()
    finally:
        op.cudnn.set_stream(op.handle, main.cuda_stream)
    g.replay()
    torch.cuda.synchronize()
    us = time_events(g.replay, 1, rounds) / calls
    del g
    return us


def run_shape(cudnn, handle, name, shape, out_pref, rounds, dev, log):
    b, h, n, d, causal = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)),
                                             is_causal=causal).transpose(1, 2)
    ref_amax = ref.abs().max().item()
    tries = {"auto": [torch.bfloat16, torch.float8_e4m3fn], "bf16": [torch.bfloat16], "e4m3": [torch.float8_e4m3fn]}[out_pref]
    for i, dt in enumerate(tries):
        scale_o = 1.0 if dt == torch.bfloat16 else pow2_scale(ref_amax)
        try:
            op = Fp8Sdpa(cudnn, handle, q, k, v, causal, dt, scale_o)
            break
        except Exception as ex:  # noqa: BLE001 - cudnnGraphNotSupportedError or RuntimeError
            if i == len(tries) - 1:
                raise
            if "bf16" not in log:  # said once per run
                log.add("bf16")
                print(f"# bf16 output not supported here ({why(ex)}); timing e4m3 output", flush=True)
    od = "bf16" if dt == torch.bfloat16 else "e4m3"
    op()
    torch.cuda.synchronize()
    o = op.out.float() / scale_o
    diff = o - ref
    rel = (diff.norm() / ref.norm()).item()
    max_rel = (diff.abs().max() / ref_amax).item()
    del o, diff, ref
    for _ in range(5):
        op()
    torch.cuda.synchronize()
    one = time_events(op, 1, 3)
    calls = max(1, min(200, int(3000 / max(one, 1e-3))))  # ~3 ms of work per timed round
    us_event = time_events(op, calls, rounds)
    timing = "graph"
    try:
        us_graph = time_graph(op, calls, rounds)
    except Exception as ex:  # noqa: BLE001 - not capturable: keep the event figure
        print(f"{name}: CUDA-graph capture of execute() failed ({why(ex)}); us_graph is the event time", flush=True)
        torch.cuda.synchronize()
        us_graph, timing = us_event, "event"
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    tf = flops / (us_graph * 1e-6) / 1e12
    flag = "  MISMATCH" if not rel <= TOL else ""
    print(f"{name:18s} B{b} H{h} S{n} D{d}{' causal' if causal else '':7s} out {od:4s}  graph {us_graph:9.2f} us"
          f"  event {us_event:9.2f} us  {tf:6.1f} TFLOP/s  rel_err {rel:.2e}  max_rel {max_rel:.2e}{flag}", flush=True)
    return dict(name=name, batch=b, heads=h, seq_q=n, seq_k=n, seq=n, head_dim=d, causal=causal, dtype="e4m3",
                out_dtype=od, backend="cudnn-fp8", us_graph=us_graph, us_event=us_event, us=us_graph, timing=timing,
                calls=calls, tflops=tf, rel_err=rel, max_rel=max_rel, scale_s=SCALE_S, scale_o=scale_o,
                cudnn=cudnn.backend_version(), frontend=cudnn.__version__, device=dev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mission,s1k-d64,s8k-d128,s16k-d128-causal,s8k-d256,s8k-d256-causal",
                    help="comma-separated names (" + ",".join(SHAPES) + ") and B,H,S,D[,causal] groups")
    ap.add_argument("--out", default="auto", choices=["auto", "bf16", "e4m3"],
                    help="output type: auto = bf16 where cuDNN supports it, else e4m3")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    shapes = parse_shapes(a.shapes)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.cuda.get_device_name()
    print(f"# torch {torch.__version__} cuda {torch.version.cuda} on {dev} "
          f"(sm_{''.join(map(str, torch.cuda.get_device_capability()))})", flush=True)
    cudnn = load_frontend()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    rows, failed, log = [], [], set()
    for name, shape in shapes:
        try:
            rows.append(run_shape(cudnn, handle, name, shape, a.out, a.rounds, dev, log))
        except Exception as ex:  # noqa: BLE001 - report, go on with the next shape
            print(f"{name}: not run: {why(ex)}", flush=True)
            traceback.print_exc(limit=2, file=sys.stdout)
            failed.append(name)
            try:
                torch.cuda.synchronize()
            except Exception as ex2:  # noqa: BLE001 - a sticky CUDA error ends the run
                print(f"CUDA context unusable: {why(ex2)}", flush=True)
                break
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        print(f"# not run: {', '.join(failed)}" + ("" if rows else " (cuDNN FP8 SDPA ran on no shape on this GPU)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
