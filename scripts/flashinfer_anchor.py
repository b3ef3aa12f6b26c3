"""Reference timings of FlashInfer's decode kernels on the GPU machine.

Run it in the same device call as the project's own bench and the fa4 / cuDNN anchors, so all
figures come from one machine in one run. FlashInfer comes from scripts/flashinfer-pack (unpack
the archive, put the folder on PYTHONPATH); its SM90 decode kernels are JIT-compiled with the
machine's nvcc at first use (tens of seconds, timed and printed apart), then cached:

    mkdir -p /tmp/flashinfer && tar -C /tmp/flashinfer -xf .gpu-fi/flashinfer.txz
    PYTHONPATH=/tmp/flashinfer python3 scripts/flashinfer_anchor.py --dtype bf16 --json $OUT/flashinfer.json

Environment, set here before flashinfer is imported, each only where unset: FLASHINFER_WORKSPACE_BASE
=/tmp/flashinfer-jit (the JIT's sources, objects and modules), CUDA_HOME=/usr/local/cuda (the nvcc,
headers and libcudart the JIT uses), TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache; the pack's bin/ (ninja)
goes at the end of PATH. FLASHINFER_CUDA_ARCH_LIST is flashinfer's to pick (sm_90a on Hopper).

Problems: the decode problems of sdpa-harness's problems.rs and sdpa_anchor.py (32 query heads on 8
K/V heads, head_dim 128, one query token per sequence, no mask, softmax scale 1/sqrt(128)):
decode-b1-k32k, decode-b16-k8k, decode-b64-k4k, decode-b16-k8k-paged, decode-b1-k1k, decode-b1-k4k,
decode-b8-k2k. Inputs N(0, 1) in NHD layout. Each runs through BatchDecodeWithPagedKVCacheWrapper
(plan once, then run; backend "auto", which on SM90 is the fa2 CUDA-core decode kernel) at page
sizes 16 and 128 (names suffixed /page16, /page128): the dense problems' K/V are the [batch,
seq_k, kv_heads, 128] tensors seen as pages in order; decode-b16-k8k-paged's pages are scattered by
a random block table, as in the project's paged problem. The batch-1 problems also run through
single_decode_with_kv_cache on the contiguous [seq_k, kv_heads, 128] K/V (suffix /single).
decode-b16-k8k-fp8kv and decode-b64-k4k-fp8kv read an e4m3 cache (codes of N(0, 1) / scale, one
scale a tensor: flashinfer's k_scale and v_scale, the latter an elementwise multiply of O after the
kernel) under bf16 Q. gptoss-decode-b32-k8k-sink is skipped with its reason: the decode wrapper
takes sinks= only on backends that do not run on SM90 (its fa2/fa3 paths drop them).
Each record (a JSON list, like sdpa_anchor.py's): name (problem/variant), problem, backend
(flashinfer-page16, flashinfer-page128, flashinfer-single), api, page, page_order, batch, heads,
kv_heads, seq_q, seq_k, head_dim, causal, dtype, kv_dtype, us_graph (median us per call over CUDA-graph
replays of --graph-calls run() calls captured after plan(); the us_event figure where capture
fails, timing says which), us_event (median us per call of plain run() calls back to back between
CUDA events, Python dispatch included), us (= us_graph), tflops
(4*b*h*seq_k*d / us_graph), kv_gbps (K and V bytes / us_graph; past HBM's rate where K/V fit in
L2, as for every anchor timed this way), rel_err (||O - ref|| / ||ref|| on the first sequence
against a float64 torch reference), max_rel (max |O - ref| / max |ref|), jit_s (seconds the
module's JIT build or cached load took in this process), resolved (the wrapper's backend), lib,
device.
Exit status: 2 if flashinfer cannot be imported, 1 if any variant failed, else 0.
"""
import argparse, importlib.util, json, math, os, subprocess, sys, time, traceback
from pathlib import Path

import torch

from anchor_timing import time_events, time_graph

PROBLEMS = {  # name: dims, as in sdpa_anchor.py's VARIANTS and sdpa-harness's problems.rs
    "decode-b1-k32k": dict(b=1, h=32, hkv=8, sk=32768, d=128),
    "decode-b16-k8k": dict(b=16, h=32, hkv=8, sk=8192, d=128),
    "decode-b64-k4k": dict(b=64, h=32, hkv=8, sk=4096, d=128),
    "decode-b16-k8k-paged": dict(b=16, h=32, hkv=8, sk=8192, d=128, random_pages=True),
    "decode-b1-k1k": dict(b=1, h=32, hkv=8, sk=1024, d=128),
    "decode-b1-k4k": dict(b=1, h=32, hkv=8, sk=4096, d=128),
    "decode-b8-k2k": dict(b=8, h=32, hkv=8, sk=2048, d=128),
    "gptoss-decode-b32-k8k-sink": dict(b=32, h=64, hkv=8, sk=8192, d=64, sink=True),
    # An e4m3 K/V cache under 16-bit Q (one scale a tensor: flashinfer's k_scale / v_scale floats;
    # the project's problems default to a scale per K/V head, the same bytes read).
    "decode-b16-k8k-fp8kv": dict(b=16, h=32, hkv=8, sk=8192, d=128, kv8=True),
    "decode-b64-k4k-fp8kv": dict(b=64, h=32, hkv=8, sk=4096, d=128, kv8=True),
}
SINK_SKIP = ("BatchDecodeWithPagedKVCacheWrapper.run takes sinks= only on its trtllm-gen and cute-dsl "
             "(SM100+) and cudnn (cudnn-frontend >= 1.30 FROST engines) backends; its SM90 paths (fa2 "
             "CUDA-core decode, fa2/fa3 tensor-core decode) pass no sinks to the kernel, so the result "
             "would be attention without sinks")
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace
TOL = 2e-2  # rel_err above which a result is flagged (bf16 output: ~4e-3)


def why(ex):
    msg = str(ex).strip().splitlines()
    return f"{type(ex).__name__}: {msg[0] if msg else ''}"[:300]


def setup_env():
    """The JIT's environment, before flashinfer's import reads it (each only where unset)."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-jit")
    os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/tvm-ffi-cache")
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        for d in ("/usr/local/cuda", "/usr/local/cuda-13.0"):
            if os.path.exists(os.path.join(d, "bin", "nvcc")):
                os.environ["CUDA_HOME"] = d
                break
    spec = importlib.util.find_spec("flashinfer")
    if spec is not None and spec.origin:
        pack_bin = Path(spec.origin).resolve().parents[1] / "bin"  # the pack's ninja, after the image's
        if (pack_bin / "ninja").exists():
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + str(pack_bin)


def nvcc_version():
    nvcc = os.path.join(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda", "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        return f"{nvcc}: " + next((l.strip() for l in out.splitlines() if "release" in l), out.strip() or "?")
    except Exception as ex:  # noqa: BLE001 - reported, the JIT then fails with its own message
        return f"{nvcc}: not runnable ({why(ex)})"


class Inputs:
    """One problem's tensors: q [b, h, d] and the logical K/V [b, sk, hkv, d], and the float64
    reference output of the first sequence."""

    def __init__(self, p, dt):
        self.p, self.dt = p, dt
        b, h, hkv, sk, d = p["b"], p["h"], p["hkv"], p["sk"], p["d"]
        self.scale = 1.0 / math.sqrt(d)
        self.q = torch.randn(b, h, d, device="cuda", dtype=dt)
        self.k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
        self.v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
        self.kv_dt, self.k_scale, self.v_scale = dt, None, None
        if p.get("kv8"):  # e4m3 codes of x / scale, the scale a tensor's amax / 448
            self.kv_dt = torch.float8_e4m3fn
            self.k_scale = self.k.abs().max().item() / 448.0
            self.v_scale = self.v.abs().max().item() / 448.0
            self.k = (self.k.float() / self.k_scale).to(self.kv_dt)
            self.v = (self.v.float() / self.v_scale).to(self.kv_dt)
        q0 = self.q[0].double().reshape(hkv, h // hkv, d)              # query heads grouped by K/V head
        k0, v0 = self.k[0].double(), self.v[0].double()                 # [sk, hkv, d]
        if p.get("kv8"):  # the reference sees the values the codes stand for
            k0, v0 = k0 * self.k_scale, v0 * self.v_scale
        s = torch.einsum("kgd,skd->kgs", q0, k0) * self.scale
        self.ref = torch.einsum("kgs,skd->kgd", s.softmax(-1), v0).reshape(h, d)
        del q0, k0, v0, s

    def errors(self, out0):
        diff = out0.double() - self.ref
        return (diff.norm() / self.ref.norm()).item(), (diff.abs().max() / self.ref.abs().max()).item()


_WS = {}


def workspace():
    if "ws" not in _WS:  # zeroed before its first use, as flashinfer asks; shared by every wrapper
        _WS["ws"] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    return _WS["ws"]


def jit_module(kind, x, log):
    """Builds (or loads from the JIT cache) the module a plan() / single decode call of this dtype
    and head_dim will use, timed on its own; flashinfer caches it for the call that follows."""
    import flashinfer.decode as fd
    dt, kv, d = x.dt, x.kv_dt, x.p["d"]
    key = (kind, dt, kv, d)
    if key in log:
        return log[key]
    t = time.perf_counter()
    try:
        if kind == "batch":  # plan(): (q, kv, o dtypes, indptr dtype, d_qk, d_vo, posenc NONE, no window, no cap)
            fd.get_batch_decode_module(dt, kv, dt, torch.int32, d, d, 0, False, False)
        else:
            fd.get_single_decode_module(dt, kv, dt, d, d, 0, False, False)
    except (AttributeError, TypeError) as ex:  # another flashinfer: the first call builds it, untimed
        print(f"# jit: could not build the {kind} module ahead ({why(ex)}); its first call builds it", flush=True)
        log[key] = None
        return None
    log[key] = time.perf_counter() - t
    print(f"# jit: {kind}_decode {str(dt).split('.')[-1]} kv {str(kv).split('.')[-1]} d{d}: {log[key]:.1f} s (build, or load from "
          f"{os.environ['FLASHINFER_WORKSPACE_BASE']})", flush=True)
    return log[key]


def make_batch(x, page, fi_cuda_graph):
    """BatchDecodeWithPagedKVCacheWrapper over the K/V seen as pages of `page` keys; returns the run
    call, its output buffer (first sequence = row 0), what it holds on to, and the page order."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper
    p, dt = x.p, x.dt
    b, h, hkv, sk, d = p["b"], p["h"], p["hkv"], p["sk"], p["d"]
    assert sk % page == 0
    npg = sk // page
    if p.get("random_pages"):
        table = torch.randperm(b * npg, device="cuda", dtype=torch.int32).reshape(b, npg)
        kc = torch.empty(b * npg, page, hkv, d, device="cuda", dtype=x.kv_dt)
        vc = torch.empty_like(kc)
        kc[table.flatten().long()] = x.k.reshape(b * npg, page, hkv, d)
        vc[table.flatten().long()] = x.v.reshape(b * npg, page, hkv, d)
        order = "random"
    else:  # the dense cache itself, page after page
        table = torch.arange(b * npg, device="cuda", dtype=torch.int32).reshape(b, npg)
        kc, vc = x.k.view(b * npg, page, hkv, d), x.v.view(b * npg, page, hkv, d)
        order = "in-order"
    indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * npg
    indices = table.flatten().contiguous()
    last = torch.full((b,), page, device="cuda", dtype=torch.int32)  # every page full
    if fi_cuda_graph:  # flashinfer's own CUDA-graph mode: fixed metadata buffers, padded schedule
        bufs = (torch.empty_like(indptr), torch.empty_like(indices), torch.empty_like(last))
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                               paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    else:
        bufs = ()
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(indptr, indices, last, h, hkv, d, page, q_data_type=dt, kv_data_type=x.kv_dt, sm_scale=x.scale)
    out = torch.empty(b, h, d, device="cuda", dtype=dt)
    q = x.q

    def fn():  # an e4m3 cache: flashinfer folds k_scale into sm_scale and multiplies O by v_scale
        return w.run(q, (kc, vc), out=out, k_scale=x.k_scale, v_scale=x.v_scale)
    keep = (w, kc, vc, indptr, indices, last, bufs)
    return fn, out, keep, order, getattr(w, "resolved_backend", "?")


def make_single(x):
    from flashinfer import single_decode_with_kv_cache
    q0, k0, v0 = x.q[0], x.k[0], x.v[0]  # [h, d], [sk, hkv, d] (NHD), contiguous
    box = {}

    def fn():
        box["out"] = single_decode_with_kv_cache(q0, k0, v0, kv_layout="NHD", sm_scale=x.scale,
                                                 k_scale=x.k_scale, v_scale=x.v_scale)
        return box["out"]
    return fn, box


def run_variant(name, x, variant, a, dev, lib, jit_log):
    p = x.p
    b, h, hkv, sk, d = p["b"], p["h"], p["hkv"], p["sk"], p["d"]
    if variant == "single":
        jit_s = jit_module("single", x, jit_log)
        fn, box = make_single(x)
        fn()
        torch.cuda.synchronize()
        out0, page, order, resolved = box["out"], None, None, "fa2 (single decode)"
    else:
        page = int(variant[4:])
        jit_s = jit_module("batch", x, jit_log)
        fn, out, keep, order, resolved = make_batch(x, page, a.fi_cuda_graph)
        fn()
        torch.cuda.synchronize()
        out0 = out[0]
    rel, max_rel = x.errors(out0)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    us_event = time_events(fn, a.graph_calls, a.rounds)
    timing = "graph"
    try:
        us_graph = time_graph(fn, a.graph_calls, a.rounds)
    except Exception as ex:  # noqa: BLE001 - not capturable: keep the event figure
        print(f"{name}/{variant}: CUDA-graph capture of the call failed ({why(ex)}); us_graph is the event time",
              flush=True)
        torch.cuda.synchronize()
        us_graph, timing = us_event, "event"
    kv_bytes = 2 * b * sk * hkv * d * x.k.element_size()
    tf = 4.0 * b * h * sk * d / (us_graph * 1e-6) / 1e12
    gbs = kv_bytes / (us_graph * 1e-6) / 1e9
    full = f"{name}/{variant}"
    flag = "  MISMATCH" if not rel <= TOL else ""
    print(f"{full:32s} {a.dtype:4s} graph {us_graph:9.2f} us  event {us_event:9.2f} us  K/V {gbs:7.0f} GB/s"
          f"  rel_err {rel:.2e}  max_rel {max_rel:.2e}  ({resolved}){flag}", flush=True)
    return dict(name=full, problem=name, backend=f"flashinfer-{variant}",
                api="single_decode_with_kv_cache" if variant == "single" else "BatchDecodeWithPagedKVCacheWrapper",
                page=page, page_order=order, fi_cuda_graph=bool(a.fi_cuda_graph) if page else None,
                batch=b, heads=h, kv_heads=hkv, seq_q=1, seq_k=sk, head_dim=d, head_dim_v=d, causal=False,
                window=None, softcap=None, varlen=None, sink=False, dtype=a.dtype,
                kv_dtype="e4m3" if p.get("kv8") else a.dtype,
                us_graph=us_graph, us_event=us_event, us=us_graph, timing=timing, calls=a.graph_calls, tflops=tf,
                kv_gbps=gbs,
                rel_err=rel, max_rel=max_rel, jit_s=jit_s, resolved=resolved, lib=lib, device=dev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default=",".join(PROBLEMS), help="of " + ",".join(PROBLEMS))
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--pages", default="16,128", help="page sizes for BatchDecodeWithPagedKVCacheWrapper")
    ap.add_argument("--no-single", action="store_true", help="skip single_decode_with_kv_cache on batch-1 problems")
    ap.add_argument("--fi-cuda-graph", action="store_true",
                    help="plan the wrappers in flashinfer's CUDA-graph mode (use_cuda_graph=True, fixed buffers)")
    ap.add_argument("--graph-calls", type=int, default=50, help="calls captured per graph (and per event round)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", help="write the records here, a JSON list")
    a = ap.parse_args()
    probs = [n for n in a.problems.split(",") if n]
    bad = [n for n in probs if n not in PROBLEMS]
    if bad:
        sys.exit(f"unknown problems {bad}; known: {', '.join(PROBLEMS)}")
    pages = [int(s) for s in a.pages.split(",") if s]
    setup_env()
    dev = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    print(f"# torch {torch.__version__} cuda {torch.version.cuda} on {dev} (sm_{cc[0]}{cc[1]})", flush=True)
    try:
        import flashinfer
    except Exception as ex:  # noqa: BLE001 - ImportError, or tvm_ffi failing to load
        traceback.print_exc(limit=4)
        print(f"cannot import flashinfer ({why(ex)}): unpack scripts/flashinfer-pack's archive and put its "
              f"folder on PYTHONPATH", file=sys.stderr)
        return 2
    lib = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
    print(f"# {lib} from {os.path.dirname(flashinfer.__file__)}; JIT: CUDA_HOME={os.environ.get('CUDA_HOME')}, "
          f"{nvcc_version()}; workspace {os.environ['FLASHINFER_WORKSPACE_BASE']}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, failed, jit_log = [], [], {}
    for name in probs:
        p = PROBLEMS[name]
        if p.get("sink"):
            print(f"{name}: skipped: {SINK_SKIP}", flush=True)
            continue
        torch.manual_seed(0)
        x = Inputs(p, DTYPES[a.dtype])
        variants = [f"page{s}" for s in pages if p["sk"] % s == 0]
        if p["b"] == 1 and not a.no_single:
            variants.append("single")
        dead = False
        for variant in variants:
            try:
                rows.append(run_variant(name, x, variant, a, dev, lib, jit_log))
            except Exception as ex:  # noqa: BLE001 - report and go on with the next variant
                print(f"{name}/{variant}: failed: {why(ex)}", flush=True)
                traceback.print_exc(limit=4, file=sys.stdout)
                failed.append(f"{name}/{variant}")
                try:
                    torch.cuda.synchronize()
                except Exception as ex2:  # noqa: BLE001 - a sticky CUDA error ends the run
                    print(f"CUDA context unusable: {why(ex2)}", flush=True)
                    dead = True
                    break
            torch.cuda.empty_cache()
        del x
        torch.cuda.empty_cache()
        if dead:
            break
    print(f"\n{'name':32s} {'us_graph':>9s} {'us_event':>9s} {'K/V GB/s':>8s} {'rel_err':>8s}  jit_s")
    for r in rows:
        js = f"{r['jit_s']:.1f}" if r["jit_s"] is not None else "-"
        print(f"{r['name']:32s} {r['us_graph']:9.2f} {r['us_event']:9.2f} {r['kv_gbps']:8.0f} {r['rel_err']:8.1e}  {js}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        print(f"# failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
