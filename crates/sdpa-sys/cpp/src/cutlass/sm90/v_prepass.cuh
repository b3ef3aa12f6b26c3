// The e4m3 kernels' pre-passes over V, which the attention grid overlaps (programmatic launch:
// it waits before its first V load), and the workspace they write:
//   accurate mode (D >= 128) convert_v: V's codes as f16, exactly, [batch][kv_head][seq_k][D];
//   fast mode                transpose_v: V^T's codes, [batch][kv_head][D][keys], for the K-major
//                            B operand of the e4m3 P·V, keys reordered within each group of 32
//                            as the P fragment holds them (p_key_of), and for masked kernels
//                            NaN codes taken out and recorded (nan_table_words).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch.cuh"
#include "cutlass/sm90/nonfinite_v.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "sdpa/sdpa.h"

namespace sdpa::cutlass_sm90 {

// Accurate mode: V's codes as f16 (exact), packed [batch][kv_head][seq_k][D]. 16 codes a thread
// and step: one 16-byte load, two 16-byte stores.
template <int D>
__global__ void __launch_bounds__(256)
    convert_v(const uint8_t* __restrict__ v, Strides vs, int seq_k, int kv_heads, int64_t chunks,
              uint4* __restrict__ out) {
#ifdef SDPA_SM90_DEVICE
  // The attention grid may launch now: it waits (griddepcontrol.wait) before its first V load.
  pdl_launch_dependents();
  constexpr int kChunks = D / 16;  // 16-code chunks per row
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += step) {
    const int64_t row = i / kChunks, bk = row / seq_k;  // bk = b * kv_heads + hk
    const int64_t key = row - bk * seq_k, b = bk / kv_heads, hk = bk - b * kv_heads;
    const uint4 x = *reinterpret_cast<const uint4*>(v + b * vs.batch + hk * vs.head + key * vs.seq +
                                                    16 * (i % kChunks));
    out[2 * i] = f16x8_of_e4m3x8(make_uint2(x.x, x.y));
    out[2 * i + 1] = f16x8_of_e4m3x8(make_uint2(x.z, x.w));
  }
#endif
}

// Fast mode, the key order within a group of 32. The e4m3 P·V's A fragment gives a thread, for
// each 32-key step, columns 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 (t = lane % 4); the S
// accumulator it is packed from (convert_p) holds keys 2t, 2t + 1, 8 + 2t, 9 + 2t, and 16 more of
// each. Rather than move P between threads, the pre-pass writes V^T's keys in the fragment's
// order: position L of a group holds key p_key_of(L).
__host__ __device__ constexpr int p_key_of(int L) {
  const int half = L & 16, q = (L & 15) >> 2, i = L & 3;
  return half + 2 * q + (i & 1) + 4 * (i & 2);
}

// Fast mode's masked kernels: per (batch, kv_head), the first key holding a NaN code in any
// column (word 0), then in each column d (word 1 + d); all ones where none. transpose_v writes
// those codes as zero (0 · NaN in the P·V would reach rows that do not see the key) and records
// them here; the kernel sets O to NaN where a row sees that key (VSide::add_nan_columns).
__host__ __device__ constexpr int64_t nan_table_words(int64_t head_dim) { return 1 + head_dim; }

// Fast mode: V^T into `out`, [batch][kv_head][D][keys_pad], keys_pad a multiple of 32, keys past
// seq_k zero. A CTA transposes 32 keys at a time through shared memory: 16-byte loads along V's
// rows, 16-byte stores along V^T's. nan_first: NanColumns's table (set to all ones before), or
// null to keep NaN codes (the unmasked kernel: every row sees every key).
template <int D>
__global__ void __launch_bounds__(256)
    transpose_v(const uint8_t* __restrict__ v, Strides vs, int seq_k, int kv_heads, int keys_pad,
                int64_t groups, uint8_t* __restrict__ out, uint32_t* __restrict__ nan_first) {
#ifdef SDPA_SM90_DEVICE
  pdl_launch_dependents();
  __shared__ alignas(16) uint8_t tile[32][D];
  constexpr int kRowChunks = D / 16;  // 16-byte chunks of a V row
  const int per_head = keys_pad / 32;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t bk = g / per_head, b = bk / kv_heads, hk = bk - b * kv_heads;
    const int key0 = int(g - bk * per_head) * 32;
    for (int c = threadIdx.x; c < 32 * kRowChunks; c += blockDim.x) {
      const int r = c / kRowChunks, col = (c % kRowChunks) * 16, key = key0 + r;
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (key < seq_k)
        x = __ldg(reinterpret_cast<const uint4*>(v + b * vs.batch + hk * vs.head +
                                                 int64_t(key) * vs.seq + col));
      if (nan_first != nullptr) {
        uint32_t* w = &x.x;
        for (int j = 0; j < 4; ++j) {
          const uint32_t nan = __vcmpeq4(w[j] & 0x7f7f7f7fu, 0x7f7f7f7fu);  // 0xff per NaN byte
          if (nan == 0u) continue;
          w[j] &= ~nan;
          uint32_t* table = nan_first + bk * nan_table_words(D);
          atomicMin(table, uint32_t(key));
          for (int byte = 0; byte < 4; ++byte)
            if ((nan >> (8 * byte)) & 1u) atomicMin(table + 1 + col + 4 * j + byte, uint32_t(key));
        }
      }
      *reinterpret_cast<uint4*>(&tile[r][col]) = x;
    }
    __syncthreads();
    // Thread c writes 16 keys (half c % 2 of the group) of V^T's row d = c / 2.
    for (int c = threadIdx.x; c < 2 * D; c += blockDim.x) {
      const int d = c >> 1, half = 16 * (c & 1);
      uint32_t w[4];
      for (int q = 0; q < 4; ++q) {
        w[q] = 0u;
        for (int i = 0; i < 4; ++i)
          w[q] |= uint32_t(tile[p_key_of(half + 4 * q + i)][d]) << (8 * i);
      }
      st_global_128(out + (bk * D + d) * keys_pad + key0 + half,
                    make_uint4(w[0], w[1], w[2], w[3]));
    }
    __syncthreads();
  }
#endif
}

// Host side ----------------------------------------------------------------------------------

// Fast mode: V^T's keys a row.
inline int64_t transposed_keys(const FwdArgs& a) { return (a.dims.seq_k + 31) / 32 * 32; }

// The workspace: accurate mode at D >= 128, convert_v's f16 V; fast mode, V^T and after it (at a
// 16-byte boundary) the NanColumns table of masked calls.
inline Strides packed_v_strides(const FwdArgs& a) {
  return {a.dims.kv_heads * a.dims.seq_k * a.dims.head_dim, a.dims.seq_k * a.dims.head_dim,
          a.dims.head_dim};
}
inline int64_t transposed_v_bytes(const FwdArgs& a) {
  return (a.dims.batch * a.dims.kv_heads * a.dims.head_dim * transposed_keys(a) + 15) / 16 * 16;
}
inline int64_t nan_table_bytes(const FwdArgs& a) {
  return a.mask.kind == Mask::NoMask
             ? 0
             : a.dims.batch * a.dims.kv_heads * nan_table_words(a.dims.head_dim) * 4;
}
// The head dims with a fast-mode kernel: up to 128. At D = 256 the two-level accumulation's
// fresh accumulator of a whole tile does not fit the registers beside O; in chunks of O's
// columns it serializes P·V and loses to accurate mode (measured: docs/log/2026-11-perf-history.md,
// "FP8 at head_dim 256").
constexpr bool has_fast_kernel(int64_t head_dim) { return head_dim <= 128; }

// Whether an e4m3 call asking for fast mode gets it, which it may not where accurate mode takes
// less time (fast mode permits it): at D = 256 (no fast kernel), and at D = 64 below 2^23 scores
// (batch x heads x seq_q x seq_k), where accurate mode converts V inside the kernel and fast
// mode's pre-pass launch costs more than its e4m3 P·V saves (measured:
// docs/log/2026-11-perf-history.md, "FP8 at head_dim 256" and "FP8 fast mode: P·V on e4m3 tensor
// cores").
template <int D>
bool fast_mode_runs(const FwdArgs& a) {
  if constexpr (!has_fast_kernel(D)) return false;
  if (!a.fp8.fast) return false;
  return D != 64 || a.dims.batch * a.dims.heads * a.dims.seq_q * a.dims.seq_k >= (1 << 23);
}

// The scratch of the e4m3 kernel at head dim D: fast mode's transposed V and NaN table, else
// the V copy of the accurate kernel's pre-pass where its configuration has one.
template <int D>
int64_t workspace_e4m3_bytes(const FwdArgs& a) {
  if (fast_mode_runs<D>(a)) return transposed_v_bytes(a) + nan_table_bytes(a);
  if constexpr (E4m3<cute::half_t, D>::kPrepass)
    return a.dims.batch * a.dims.kv_heads * a.dims.seq_k * a.dims.head_dim *
           int64_t(sizeof(cute::half_t));
  return 0;
}

// Enqueues the pre-pass of E's kernel (none without one) on `stream`, into a.scratch.workspace.
template <class E, int D>
void launch_v_prepass(const FwdArgs& a, int sms, cudaStream_t stream) {
  if constexpr (E::kPrepass) {
    if (a.scratch.workspace == 0 || a.scratch.workspace % 16 != 0)
      throw Error("cutlass-sm90 e4m3: needs a 16-byte aligned workspace of workspace_bytes()");
    // Launched the ordinary way: it starts once everything before it on the stream is done,
    // which is what lets the attention grid read Q and K before its own wait.
    if constexpr (E::kFp8PV) {
      auto* out = device_ptr<uint8_t>(a.scratch.workspace);
      uint32_t* table = nullptr;
      if (nan_table_bytes(a) > 0) {
        table = reinterpret_cast<uint32_t*>(out + transposed_v_bytes(a));
        SDPA_CUDA_CHECK(cudaMemsetAsync(table, 0xff, size_t(nan_table_bytes(a)), stream));
      }
      const int64_t groups = a.dims.batch * a.dims.kv_heads * (transposed_keys(a) / 32);
      // A 32-key group a CTA step; at most 8 CTAs an SM, a stride loop beyond.
      const int64_t blocks = std::min<int64_t>(groups, 8 * int64_t(sms));
      transpose_v<D><<<unsigned(blocks), 256, 0, stream>>>(
          device_ptr<const uint8_t>(a.ops.v), a.ops.v_stride, int(a.dims.seq_k),
          int(a.dims.kv_heads), int(transposed_keys(a)), groups, out, table);
      SDPA_LAUNCH_CHECK("cutlass-sm90 e4m3 transpose_v launch");
    } else {
      const int64_t chunks = a.dims.batch * a.dims.kv_heads * a.dims.seq_k * (D / 16);
      // At most 8 CTAs of 256 threads per SM (the SM's 2048 threads), a stride loop beyond.
      const int64_t blocks = std::min<int64_t>((chunks + 255) / 256, 8 * int64_t(sms));
      convert_v<D><<<unsigned(blocks), 256, 0, stream>>>(
          device_ptr<const uint8_t>(a.ops.v), a.ops.v_stride, int(a.dims.seq_k),
          int(a.dims.kv_heads), chunks, device_ptr<uint4>(a.scratch.workspace));
      SDPA_LAUNCH_CHECK("cutlass-sm90 e4m3 convert_v launch");
    }
  }
}

}  // namespace sdpa::cutlass_sm90
