"""Reference timings of open MLA decode kernels (DeepSeek's absorbed MLA) on the GPU machine.

Run it in the same device call as the project's own bench, so both sets of figures come from one
machine in one run. FlashMLA comes from scripts/mla-anchor-pack (unpack the archive, put the
folder on PYTHONPATH):

    mkdir -p /tmp/mla && tar -C /tmp/mla -xf .gpu/mla.txz
    PYTHONPATH=/tmp/mla python3 scripts/mla_anchor.py \\
        --problems mla-decode-b64-k4k,mla-decode-b16-k16k --dtype bf16 --json $OUT/mla.json

Problem: b sequences, 1 query token, 128 query heads, one latent KV head of 576 columns (the first
512 are also V), seq_k keys per sequence in a paged cache of 64-token pages scattered by a random
block table; out [b, 1, 128, 512]. Softmax scale 1/sqrt(576) (FlashMLA's default, passed to every
backend explicitly). Inputs N(0, 1).
Backends: flashmla (sgl-flash-mla / FlashMLA: SM90 dense decode; the sgl fork reaches it with
use_legacy=True), flashinfer (BatchMLAPagedAttentionWrapper with separate ckv 512 / kpe 64 caches;
only if an importable flashinfer is on the path: its SM90 kernels are JIT-built with nvcc at plan),
torch (opt-in: two batched matmuls over a contiguous cache; a floor, not an anchor).
Each record (JSON lines): backend, problem, us (median us per call of --replays calls captured in one
CUDA graph, as `sdpa bench`'s us_graph; null if capture fails), us_sustained (median us per call of plain back-to-back
launches, Python dispatch included), tflops (2*b*128*seq_k*(576+512) flops / us), gbps (latent
cache bytes b*seq_k*576*2 / us; both from us_sustained where us is null),
max_err (max |out - ref| on the first 2 sequences against a float32 torch reference; rel_err is
it over max |ref|).
A backend that fails to import or run prints why and the others go on; exit 0 if any ran.
"""
import argparse, inspect, json, math, sys, traceback
import torch

from anchor_timing import time_events, time_graph

H_Q, D_QK, D_V, PAGE = 128, 576, 512, 64
PROBLEMS = {  # name: (batch, seq_k)
    "mla-decode-b64-k4k": (64, 4096),
    "mla-decode-b16-k16k": (16, 16384),
}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
REF_SEQS = 2  # sequences checked against the float32 reference
TOL = 2e-2  # max_err / max|ref| above which a result is flagged (outputs here are only ~0.1)


def why(ex):
    """One line for a failure: the exception type and its first message line."""
    msg = str(ex).strip().splitlines()
    return f"{type(ex).__name__}: {msg[0] if msg else ''}"[:300]


def time_plain(fn, calls, rounds):
    """Median us per call of plain launches back to back (host dispatch included)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    return time_events(fn, calls, rounds)


class Inputs:
    """One problem's tensors: the logical latent cache, its paged copy and the block table."""

    def __init__(self, b, sk, dt):
        assert sk % PAGE == 0
        self.b, self.sk, self.dt = b, sk, dt
        self.npg = sk // PAGE
        self.scale = 1.0 / math.sqrt(D_QK)
        self.q = torch.randn(b, 1, H_Q, D_QK, device="cuda", dtype=dt)
        kv = torch.randn(b, sk, D_QK, device="cuda", dtype=dt)  # logical cache, sequence-major
        # page p of sequence i lives at physical page table[i, p]; pages of all sequences shuffled
        self.table = torch.randperm(b * self.npg, device="cuda").to(torch.int32).reshape(b, self.npg)
        self.kcache = torch.empty(b * self.npg, PAGE, 1, D_QK, device="cuda", dtype=dt)
        self.kcache[self.table.flatten().long()] = kv.reshape(b * self.npg, PAGE, 1, D_QK)
        self.seqlens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        self.ref = self.reference(kv[:REF_SEQS])
        del kv

    def reference(self, kv):
        """float32 attention of the first sequences, from the logical (unpaged) cache."""
        n = kv.shape[0]
        q = self.q[:n, 0].float()                       # [n, 128, 576]
        k = kv.float()                                  # [n, sk, 576]
        p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * self.scale, dim=-1)
        return torch.bmm(p, k[..., :D_V]).unsqueeze(1)  # [n, 1, 128, 512]

    def dense(self):
        """The logical cache back from the pages: [b, sk, 576]."""
        return self.kcache[self.table.long()].reshape(self.b, self.sk, D_QK)


def make_flashmla(x):
    import flash_mla
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    sig = inspect.signature(flash_mla_with_kvcache).parameters
    kw = dict(softmax_scale=x.scale, causal=False)
    if "use_legacy" in sig:
        # sgl-flash-mla: the dense (non-sparse) decode and all SM90 kernels sit in its legacy half
        has_legacy = getattr(flash_mla, "has_legacy", lambda: True)
        if not has_legacy():
            raise RuntimeError("sgl-flash-mla was built without its legacy (SM90 / dense) kernels")
        kw["use_legacy"] = True
    iface = sys.modules.get("flash_mla.flash_mla_interface")
    if iface is not None and hasattr(iface, "FlashMLASchedMeta"):
        # current interface: an empty FlashMLASchedMeta, filled by the first call
        meta, splits = get_mla_metadata()
    else:
        # older interface: the split scheduler runs up front on the sequence lengths
        meta, splits = get_mla_metadata(x.seqlens, 1 * H_Q // 1, 1)
    ver = getattr(flash_mla, "__version__", "?")

    def fn():
        return flash_mla_with_kvcache(x.q, x.kcache, x.table, x.seqlens, D_V, meta, splits, **kw)[0]
    return fn, f"flash_mla {ver}"


def make_flashinfer(x):
    import flashinfer
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except ImportError:
        from flashinfer import BatchMLAPagedAttentionWrapper
    b, dt = x.b, x.dt
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    try:
        w = BatchMLAPagedAttentionWrapper(ws, backend="auto")
    except TypeError:  # releases before the backend argument
        w = BatchMLAPagedAttentionWrapper(ws)
    qo_indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32)         # one query token each
    kv_indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * x.npg  # pages per sequence
    kv_indices = x.table.flatten().contiguous()
    kv_len = x.seqlens.clone()
    w.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len,
           num_heads=H_Q, head_dim_ckv=D_V, head_dim_kpe=D_QK - D_V, page_size=PAGE, causal=False,
           sm_scale=x.scale, q_data_type=dt, kv_data_type=dt)
    q_nope = x.q[:, 0, :, :D_V].contiguous()   # [b, 128, 512]
    q_pe = x.q[:, 0, :, D_V:].contiguous()     # [b, 128, 64]
    ckv = x.kcache[:, :, 0, :D_V].contiguous()  # [pages, 64, 512]
    kpe = x.kcache[:, :, 0, D_V:].contiguous()  # [pages, 64, 64]
    out = torch.empty(b, H_Q, D_V, device="cuda", dtype=dt)
    keep = (ws, qo_indptr, kv_indptr, kv_indices, kv_len)  # the plan may hold pointers into these

    def fn():
        w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out)
        _ = keep
        return out.unsqueeze(1)
    name = getattr(w, "_planned_backend_name", None) or getattr(w, "_backend", None)
    return fn, f"flashinfer {getattr(flashinfer, '__version__', '?')}" + (f" ({name})" if name else "")


def make_torch(x):
    kv = x.dense()  # contiguous [b, sk, 576]; gathering it back is not timed

    def fn():
        s = torch.bmm(x.q[:, 0], kv.transpose(1, 2)).float() * x.scale
        p = torch.softmax(s, dim=-1).to(x.dt)
        return torch.bmm(p, kv[..., :D_V]).unsqueeze(1)
    return fn, f"torch {torch.__version__} bmm+softmax+bmm (contiguous cache)"


BACKENDS = {"flashmla": make_flashmla, "flashinfer": make_flashinfer, "torch": make_torch}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--backends", default="flashmla,flashinfer", help=f"of {','.join(BACKENDS)}")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--json", help="write one JSON line per (backend, problem) here")
    ap.add_argument("--replays", type=int, default=150, help="calls in the graph (or plain calls) per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dt = DTYPES[args.dtype]
    probs = [p for p in args.problems.split(",") if p]
    bad = [p for p in probs if p not in PROBLEMS]
    if bad:
        sys.exit(f"unknown problems {bad}; known: {', '.join(PROBLEMS)}")
    backends = [n for n in args.backends.split(",") if n]
    if any(n not in BACKENDS for n in backends):
        sys.exit(f"unknown backends in {backends}; known: {', '.join(BACKENDS)}")
    dev = torch.cuda.get_device_name()
    print(f"# torch {torch.__version__} cuda {torch.version.cuda} on {dev}", flush=True)
    jf = open(args.json, "w") if args.json else None
    ran, rows = 0, []
    broken = {}  # backend -> reason it cannot run at all (import or setup failure)
    dead = False  # a sticky CUDA error: nothing more can run in this process
    for name in probs:
        b, sk = PROBLEMS[name]
        torch.manual_seed(0)
        x = Inputs(b, sk, dt)
        flops = 2.0 * b * H_Q * sk * (D_QK + D_V)
        cache_bytes = b * sk * D_QK * 2
        for bn in backends:
            if bn in broken:
                continue
            stage = "setup"
            try:
                fn, lib = BACKENDS[bn](x)
                stage = "run"
                out = fn()
                torch.cuda.synchronize()
                if tuple(out.shape) != (b, 1, H_Q, D_V):
                    raise RuntimeError(f"output shape {tuple(out.shape)}, expected {(b, 1, H_Q, D_V)}")
                err = (out[:REF_SEQS].float() - x.ref).abs().max().item()
                rel = err / x.ref.abs().max().item()
                del out
                stage = "plain timing"
                us_plain = time_plain(fn, args.replays, args.rounds)
                stage = "graph timing"
                try:
                    us = time_graph(fn, args.replays, args.rounds)
                except Exception as ex:  # noqa: BLE001 - not capturable: keep the plain figure
                    print(f"{bn} {name}: CUDA-graph timing failed ({why(ex)}); us is null, "
                          f"rates use us_sustained", flush=True)
                    torch.cuda.synchronize()
                    us = None
            except ImportError as ex:
                print(f"{bn}: not importable ({why(ex)}); put its unpacked archive on PYTHONPATH "
                      f"(scripts/mla-anchor-pack)", flush=True)
                broken[bn] = why(ex)
                continue
            except Exception as ex:  # noqa: BLE001 - report and go on to the next backend
                print(f"{bn} {name}: failed at {stage}: {why(ex)}", flush=True)
                traceback.print_exc(limit=3, file=sys.stdout)
                if stage == "setup":  # (plan / JIT / load failures): do not retry on later problems
                    broken[bn] = why(ex)
                try:
                    torch.cuda.synchronize()
                except Exception as ex2:  # noqa: BLE001 - a sticky CUDA error ends every backend
                    print(f"CUDA context is unusable after {bn}: {why(ex2)}", flush=True)
                    dead = True
                    break
                continue
            t = us if us is not None else us_plain
            rec = dict(backend=bn, problem=name, us=None if us is None else round(us, 2),
                       us_sustained=round(us_plain, 2), tflops=round(flops / t / 1e6, 2),
                       gbps=round(cache_bytes / t / 1e3, 1), max_err=float(f"{err:.3g}"),
                       rel_err=float(f"{rel:.3g}"), dtype=args.dtype, b=b, seq_k=sk, h_q=H_Q,
                       d_qk=D_QK, d_v=D_V, page=PAGE, scale=x.scale, lib=lib, device=dev)
            if not rel <= TOL:
                print(f"{bn} {name}: MISMATCH, max_err {err:.3g} is {rel:.3g} of max|ref| (> {TOL})", flush=True)
            rows.append(rec)
            ran += 1
            if jf:
                jf.write(json.dumps(rec) + "\n")
                jf.flush()
        if dead:
            break
        del x
        torch.cuda.empty_cache()
    print(f"\n{'backend':11s} {'problem':22s} {'us':>9s} {'us_plain':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'max_err':>9s}  lib")
    for r in rows:
        us = f"{r['us']:9.2f}" if r["us"] is not None else f"{'-':>9s}"
        print(f"{r['backend']:11s} {r['problem']:22s} {us} {r['us_sustained']:9.2f} "
              f"{r['tflops']:8.1f} {r['gbps']:7.0f} {r['max_err']:9.3g}  {r['lib']}")
    for bn, reason in broken.items():
        print(f"{bn:11s} {'-':22s} did not run: {reason}")
    if jf:
        jf.close()
    sys.exit(0 if ran else 1)


if __name__ == "__main__":
    main()
