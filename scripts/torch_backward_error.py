"""torch's own backward error, the basis of the backward's bars: dQ, dK and dV from torch's
scaled_dot_product_attention (cuDNN and flash backends) against a float64 reference gradient on
the same rounded inputs, as rel_err = ||g - ref|| / ||ref|| (sdpa_harness::check's measure), in
units of the dtype's unit roundoff u. Inputs and dO are N(0, 1), as sdpa's checks draw them.

On the GPU machine (torch is there):

    python3 scripts/torch_backward_error.py --shapes mission,mission-causal,s1k-d64,s2k-d128

Compare with `sdpa validate --backward` on the same problems (its rel_err column).
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (batch, heads, seq, head_dim, causal), BHSD, seq_q == seq_k
    "mission": (2, 8, 256, 64, False),
    "mission-causal": (2, 8, 256, 64, True),
    "s1k-d64": (4, 16, 1024, 64, False),
    "s1k-d64-causal": (4, 16, 1024, 64, True),
    "s2k-d128": (4, 16, 2048, 128, False),
    "s2k-d128-causal": (4, 16, 2048, 128, True),
}
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def reference_grads(q, k, v, d_out, causal):
    """dQ, dK, dV in float64 by autograd through the attention's definition."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    out.backward(d_out.double())
    return q.grad, k.grad, v.grad


def rel_err(g, ref):
    return ((g.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mission,mission-causal,s1k-d64,s2k-d128")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16}
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}, "
          f"cudnn {torch.backends.cudnn.version()}")
    print(f"{'problem':18} {'dtype':5} {'backend':7} {'dq':>14} {'dk':>14} {'dv':>14}  (rel_err, /u)")
    for name in args.shapes.split(","):
        b, h, n, d, causal = SHAPES[name]
        for dname in args.dtypes.split(","):
            dtype = dtypes[dname]
            gen = torch.Generator(device="cuda").manual_seed(args.seed)
            q, k, v, d_out = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                              for _ in range(4))
            ref = reference_grads(q, k, v, d_out, causal)
            for bname, backend in BACKENDS.items():
                qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
                try:
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                        out.backward(d_out)
                except RuntimeError as e:
                    print(f"{name:18} {dname:5} {bname:7} not run: {str(e).splitlines()[0]}")
                    continue
                u = UNIT_ROUNDOFF[dtype]
                cols = [rel_err(g, r) for g, r in zip((qs.grad, ks.grad, vs.grad), ref)]
                print(f"{name:18} {dname:5} {bname:7} "
                      + " ".join(f"{e:.2e} ({e / u:.2f}u)" for e in cols))
            del ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
