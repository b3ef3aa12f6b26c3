"""The anchor for ring attention: PyTorch's context parallelism
(`torch.distributed.tensor.experimental.context_parallel`) on the problems of `sdpa ring bench`,
timed the way that command times ours, to run in the same device call:

    torchrun --nproc-per-node 2 scripts/ring_anchor.py --problem s128k-d128-causal --json cp.json
    python3 scripts/ring_anchor.py --problem s128k-d128-causal     # one GPU: plain SDPA

Every rank makes the whole Q, K and V from the same seed (context_parallel shards them in place,
with its head-tail load balancing where the mask is causal), then times each (SDPA backend, K/V
rotation) pair: a barrier, a call, a device synchronisation, wall clock around the last two,
median of --iters calls after one warm-up. Rank 0 prints a line per pair and writes the records;
the peak memory is the most any rank allocated through torch during the calls.
"""
import argparse, json, os, time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (batch, heads, kv_heads, seq, head_dim, causal), bf16: the bench problems of `sdpa ring`
# (crates/sdpa-cli/src/ring.rs), whose K/V heads equal their query heads.
PROBLEMS = {
    "s32k-d128-causal": (1, 32, 32, 32768, 128, True),
    "s128k-d128": (1, 32, 32, 131072, 128, False),
    "s128k-d128-causal": (1, 32, 32, 131072, 128, True),
    "s512k-d128-causal": (1, 32, 32, 524288, 128, True),
}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def cp_module():
    """The module holding context parallelism's options (moved between torch releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        from torch.distributed.tensor.experimental import _attention
    return _attention


def flops(b, h, s, d, causal):
    full = 4.0 * b * h * s * s * d
    return full / 2 if causal else full


def time_calls(call, iters, world):
    times = []
    for i in range(iters + 1):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run_one(name, backend, rotate, iters, world, mesh):
    """Seconds per call and the peak bytes torch allocated on this rank, for one pair."""
    b, h, hk, s, d, causal = PROBLEMS[name]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel([BACKENDS[backend]]):
        if world == 1:
            t = time_calls(call, iters, world)
        else:
            from torch.distributed.tensor.experimental import context_parallel
            cp = cp_module()
            cp._cp_options.enable_load_balance = causal  # it refuses to balance without a mask
            cp.set_rotate_method(rotate)
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                                  no_restore_buffers={q, k, v}):
                t = time_calls(call, iters, world)
    peak = torch.cuda.max_memory_allocated()
    del q, k, v
    torch.cuda.empty_cache()
    return t, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problem", default="s128k-d128-causal",
                    help="comma-separated: " + ", ".join(PROBLEMS))
    ap.add_argument("--backends", default="flash,cudnn", help="comma-separated: " + ", ".join(BACKENDS))
    ap.add_argument("--rotate", default="alltoall,allgather",
                    help="K/V rotations to time (comma-separated: alltoall = a ring of sends, allgather)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", help="write the records here (rank 0)")
    a = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        mesh = init_device_mesh("cuda", (world,))
    rotations = a.rotate.split(",") if world > 1 else ["none"]
    records = []
    for name in a.problem.split(","):
        b, h, hk, s, d, causal = PROBLEMS[name]
        for backend in a.backends.split(","):
            for rotate in rotations:
                label = f"torch-cp-{backend}-{rotate}-x{world}" if world > 1 else f"torch-{backend}"
                try:
                    t, peak = run_one(name, backend, rotate, a.iters, world, mesh)
                except Exception as e:  # a backend or rotation this torch cannot run here
                    if rank == 0:
                        print(f"{name}: {label} not run: {type(e).__name__}: {e}".splitlines()[0],
                              flush=True)
                    continue
                peaks = torch.tensor([peak], device="cuda")
                if world > 1:
                    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
                tflops = flops(b, h, s, d, causal) / t / 1e12
                if rank == 0:
                    print(f"{name}: {label} {t * 1e3:.2f} ms/call ({tflops:.1f} TFLOP/s, "
                          f"{tflops / world:.1f} a GPU), peak {peaks.item() / 2**30:.2f} GiB a GPU",
                          flush=True)
                records.append({
                    "name": name, "batch": b, "heads": h, "kv_heads": hk, "seq_q": s, "seq_k": s,
                    "head_dim": d, "causal": causal, "dtype": "bf16", "backend": label,
                    "ranks": world, "us_event": t * 1e6, "tflops": tflops,
                    "peak_bytes_a_gpu": int(peaks.item()),
                })
    if a.json and rank == 0:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
