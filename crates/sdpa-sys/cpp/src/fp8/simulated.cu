// The simulated FP8 path of the fused kernels without FP8 math (scalar, wmma, cutlass-sm80): Q, K
// and V dequantized to the output dtype in one launch into the caller's workspace, then the
// kernel's 16-bit instantiation on those copies. The copies keep the e4m3 tensors' element
// positions, so the strides carry over unchanged. One launch and no allocation per call: a launch
// and a fresh buffer per tensor are fixed costs that dominate small problems (measured:
// docs/log/2026-11-notebook.md, "final figures and checks").
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.cuh"
#include "fp8/codec.cuh"
#include "fp8/simulated.h"

namespace sdpa {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kAlign = 256;  // bytes; every kernel's loads want at most 16

struct Segment {
  const uint8_t* x;  // codes
  int64_t n;         // elements, from element 0 to the last the strides address
  ScaleMap map;
  const float* scale;
};

// Elements from 0 through the last one a (batch, head, seq, head_dim) tensor addresses.
int64_t extent(int64_t batch, int64_t heads, int64_t seq, int64_t d, const Strides& s) {
  return (batch - 1) * s.batch + (heads - 1) * s.head + (seq - 1) * s.seq + d;
}

// Scale groups as FwdArgs defines them: one per tensor, or one per (batch, head) pair, found
// from the element index through the batch and head strides.
ScaleMap scale_map(bool per_head, int64_t heads, int64_t n, const Strides& s) {
  if (!per_head) return {1, n, n};
  return {heads, s.head, s.batch};
}

int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

using fp8::decode;
using fp8::from_float;

// y_t[i] = code_t[i] * scale_t[group(i)], rounded once, for the three tensors t = blockIdx.y in one
// grid (grid-stride along x). Elements between heads that the strides skip are converted too:
// harmless bytes of the copies, never read by the kernel. The segment's fields are picked by value:
// a pointer to one of the by-value parameters makes ptxas copy all three to a stack frame in every
// thread, local-memory traffic that undoes what the single launch saves (measured:
// docs/log/2026-11-notebook.md, "final figures and checks").
template <typename Out>
__global__ void __launch_bounds__(kThreads)
    dequantize3(Segment s0, Segment s1, Segment s2, Out* y0, Out* y1, Out* y2, bool vec) {
  const int t = blockIdx.y;
  const uint8_t* __restrict__ x = t == 0 ? s0.x : t == 1 ? s1.x : s2.x;
  const float* __restrict__ scale = t == 0 ? s0.scale : t == 1 ? s1.scale : s2.scale;
  Out* __restrict__ y = t == 0 ? y0 : t == 1 ? y1 : y2;
  const int64_t n = t == 0 ? s0.n : t == 1 ? s1.n : s2.n;
  const int64_t heads = t == 0 ? s0.map.heads : t == 1 ? s1.map.heads : s2.map.heads;
  const int64_t inner = t == 0 ? s0.map.inner : t == 1 ? s1.map.inner : s2.map.inner;
  const int64_t per_batch = t == 0   ? s0.map.per_batch
                            : t == 1 ? s1.map.per_batch
                                     : s2.map.per_batch;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const auto group = [&](int64_t j) { return (j / per_batch) * heads + (j / inner) % heads; };
  if (vec) {
    // 8 codes a thread: one 8-byte load, one 16-byte store, and one scale lookup (its 64-bit
    // divisions cost more than the memory traffic when done per element).
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < n / 8; c += stride) {
      const int64_t j = c * 8;
      const float sc = scale[group(j)];
      const uint2 codes = *reinterpret_cast<const uint2*>(x + j);
      alignas(16) Out o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        o[k] = from_float<Out>(decode(uint8_t((k < 4 ? codes.x : codes.y) >> (8 * (k & 3)))) * sc);
      *reinterpret_cast<uint4*>(y + j) = *reinterpret_cast<const uint4*>(o);
    }
    return;
  }
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride)
    y[j] = from_float<Out>(decode(x[j]) * scale[group(j)]);
}

struct Plan {
  Segment seg[3];
  int64_t offset[3];  // byte offsets of the copies in the workspace
  int64_t bytes;
};

Plan plan(const FwdArgs& a) {
  Plan p{};
  const int64_t nq =
      extent(a.dims.batch, a.dims.heads, a.dims.seq_q, a.dims.head_dim, a.ops.q_stride);
  const int64_t nk =
      extent(a.dims.batch, a.dims.kv_heads, a.dims.seq_k, a.dims.head_dim, a.ops.k_stride);
  const int64_t nv =
      extent(a.dims.batch, a.dims.kv_heads, a.dims.seq_k, a.dims.head_dim, a.ops.v_stride);
  p.seg[0] = {device_ptr<const uint8_t>(a.ops.q), nq,
              scale_map(a.fp8.per_head_scales, a.dims.heads, nq, a.ops.q_stride),
              device_ptr<const float>(a.fp8.q_scale)};
  p.seg[1] = {device_ptr<const uint8_t>(a.ops.k), nk,
              scale_map(a.fp8.per_head_scales, a.dims.kv_heads, nk, a.ops.k_stride),
              device_ptr<const float>(a.fp8.k_scale)};
  p.seg[2] = {device_ptr<const uint8_t>(a.ops.v), nv,
              scale_map(a.fp8.per_head_scales, a.dims.kv_heads, nv, a.ops.v_stride),
              device_ptr<const float>(a.fp8.v_scale)};
  int64_t at = 0;
  for (int t = 0; t < 3; ++t) {
    p.offset[t] = at;
    at += aligned(p.seg[t].n * 2);  // f16 or bf16
  }
  p.bytes = at;
  return p;
}

// An e4m3 K/V cache under 16-bit Q: K and V alone, into copies of Q's dtype. Packed and paged
// caches are one sequence dimension of kv_rows rows, their scales one a K/V head.
Plan kv_plan(const FwdArgs& a) {
  Plan p{};
  const bool one_seq = a.seqs.page_size > 0 || a.seqs.packed_kv;
  const int64_t batch = one_seq ? 1 : a.dims.batch;
  const int64_t rows = one_seq ? a.seqs.kv_rows : a.dims.seq_k;
  const auto map = [&](int64_t n, const Strides& s) -> ScaleMap {
    if (!a.fp8.per_head_scales) return {1, n, n};
    // One group per kv head across the whole sequence dimension: a per-batch step no index
    // reaches (a multiple of 8, for the 8-code chunks).
    return {a.dims.kv_heads, s.head, one_seq ? int64_t(1) << 62 : s.batch};
  };
  const int64_t nk = extent(batch, a.dims.kv_heads, rows, a.dims.head_dim, a.ops.k_stride);
  const int64_t nv = extent(batch, a.dims.kv_heads, rows, a.dims.head_dim_v, a.ops.v_stride);
  p.seg[0] = {device_ptr<const uint8_t>(a.ops.k), nk, map(nk, a.ops.k_stride),
              device_ptr<const float>(a.fp8.k_scale)};
  p.seg[1] = {device_ptr<const uint8_t>(a.ops.v), nv, map(nv, a.ops.v_stride),
              device_ptr<const float>(a.fp8.v_scale)};
  p.seg[2] = {p.seg[0].x, 0, p.seg[0].map, p.seg[0].scale};  // none
  p.offset[0] = 0;
  p.offset[1] = aligned(nk * 2);
  p.offset[2] = p.offset[1] + aligned(nv * 2);
  p.bytes = p.offset[2];
  return p;
}

// Launches the dequantization of `tensors` of p's segments into `y` (Out of the 16-bit type).
void dequantize(const Plan& p, void* const (&y)[3], int tensors, Dtype out, cudaStream_t s) {
  // Whole 8-code chunks share one scale group where the group boundaries (multiples of inner
  // and per_batch), the lengths and the addresses all fall on multiples of 8.
  bool vec = true;
  int64_t most = 0;
  for (int t = 0; t < tensors; ++t) {
    const Segment& g = p.seg[t];
    vec = vec && g.n % 8 == 0 && g.map.inner % 8 == 0 && g.map.per_batch % 8 == 0 &&
          reinterpret_cast<uintptr_t>(g.x) % 8 == 0 && reinterpret_cast<uintptr_t>(y[t]) % 16 == 0;
    most = std::max(most, g.n);
  }
  most /= vec ? 8 : 1;
  const int64_t blocks = (most + kThreads - 1) / kThreads;
  const dim3 grid(unsigned(blocks < 2048 ? blocks : 2048), unsigned(tensors));  // grid-stride
  if (out == Dtype::F16)
    dequantize3<__half>
        <<<grid, kThreads, 0, s>>>(p.seg[0], p.seg[1], p.seg[2], static_cast<__half*>(y[0]),
                                   static_cast<__half*>(y[1]), static_cast<__half*>(y[2]), vec);
  else
    dequantize3<__nv_bfloat16><<<grid, kThreads, 0, s>>>(
        p.seg[0], p.seg[1], p.seg[2], static_cast<__nv_bfloat16*>(y[0]),
        static_cast<__nv_bfloat16*>(y[1]), static_cast<__nv_bfloat16*>(y[2]), vec);
  SDPA_LAUNCH_CHECK("e4m3 dequantize launch");
}

}  // namespace

int64_t widened_kv_bytes(const FwdArgs& a) { return kv_plan(a).bytes; }

FwdArgs widened_kv(const FwdArgs& a, void* stream) {
  if (!a.fp8.k_scale || !a.fp8.v_scale) throw Error("an e4m3 K/V cache needs k_scale and v_scale");
  const Plan p = kv_plan(a);
  if (a.scratch.workspace == 0)
    throw Error(
        "an e4m3 K/V cache outside the decode kernels needs a workspace of "
        "workspace_bytes() >= " +
        std::to_string(p.bytes) + " bytes");
  auto* ws = device_ptr<uint8_t>(a.scratch.workspace);
  void* const y[3] = {ws + p.offset[0], ws + p.offset[1], ws + p.offset[2]};
  dequantize(p, y, 2, a.ops.dtype, static_cast<cudaStream_t>(stream));
  FwdArgs b = a;
  b.ops.k = reinterpret_cast<uintptr_t>(y[0]);
  b.ops.v = reinterpret_cast<uintptr_t>(y[1]);
  b.ops.kv_dtype = a.ops.dtype;
  b.fp8 = FwdFp8{};
  b.scratch.workspace = reinterpret_cast<uintptr_t>(ws + p.bytes);  // the kernel's own
  return b;
}

int64_t simulated_workspace_bytes(const FwdArgs& a) { return plan(a).bytes; }

FwdArgs simulated_inputs(const FwdArgs& a, void* stream) {
  if (a.out.dtype != Dtype::F16 && a.out.dtype != Dtype::BF16)
    throw Error("e4m3 (simulated): out_dtype must be f16 or bf16");
  if (!a.fp8.q_scale || !a.fp8.k_scale || !a.fp8.v_scale)
    throw Error("e4m3 (simulated): q, k and v scales are required");
  const Plan p = plan(a);
  if (a.scratch.workspace == 0)
    throw Error("e4m3 (simulated): needs a workspace of workspace_bytes() = " +
                std::to_string(p.bytes) + " bytes");
  auto* ws = device_ptr<uint8_t>(a.scratch.workspace);
  void* const y[3] = {ws + p.offset[0], ws + p.offset[1], ws + p.offset[2]};
  dequantize(p, y, 3, a.out.dtype, static_cast<cudaStream_t>(stream));
  FwdArgs b = a;
  b.ops.q = reinterpret_cast<uintptr_t>(y[0]);
  b.ops.k = reinterpret_cast<uintptr_t>(y[1]);
  b.ops.v = reinterpret_cast<uintptr_t>(y[2]);
  b.ops.dtype = a.out.dtype;
  b.ops.kv_dtype = a.out.dtype;
  b.fp8 = FwdFp8{};
  b.scratch.workspace = 0;
  return b;
}

}  // namespace sdpa
