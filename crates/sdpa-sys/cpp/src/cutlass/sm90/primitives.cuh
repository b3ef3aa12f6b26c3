// Device primitives the sm_90a kernels share (cutlass_sm90 f16/bf16, its small-problem path,
// the native e4m3 kernel and the backward): named and mbarriers, 32-bit shared-memory
// access, cp.async, bulk reductions, a division by a per-launch constant, and the softmax base
// every kernel takes its exponents against.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ex2.cuh"
#include "common/launch.cuh"  // pdl_wait, pdl_launch_dependents
#include "common/limits.cuh"
#include "common/smem.cuh"  // ld_shared_128
#include "sdpa/sdpa.h"

namespace sdpa::cutlass_sm90 {

// Named barriers (id 0 is __syncthreads): bar.sync waits, bar.arrive only counts.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync that also ORs `pred` over the participating threads and returns it to each.
__device__ __forceinline__ bool named_or(int id, int threads, bool pred) {
  uint32_t r;
  asm volatile(
      "{ .reg .pred p, q; setp.ne.u32 p, %1, 0; bar.red.or.pred q, %2, %3, p; selp.u32 %0, 1, 0, "
      "q; }"
      : "=r"(r)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return r != 0;
}

// mbarrier.init with a run-time count (cutlass's Barrier::init asserts the count is non-zero; a
// run-time assert is a function call, and a call anywhere in the kernel makes ptxas serialize
// every wgmma).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile(
      "mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(bar))),
      "r"(count));
}

// Shared memory by 32-bit address: a generic pointer costs 64-bit address arithmetic and
// generic ST/LD instructions.
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
// A 16-byte store to global memory (p 16-byte aligned) as one instruction: a uint4 assigned
// through a pointer is split into four 4-byte stores wherever the compiler cannot prove the
// address's alignment from its arithmetic, which changes with unrelated edits.
__device__ __forceinline__ void st_global_128(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_8(uint32_t addr, uint8_t v) {
  asm volatile("st.shared.b8 [%0], %1;" ::"r"(addr), "h"(uint16_t(v)) : "memory");
}
__device__ __forceinline__ uint8_t ld_shared_8(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.b8 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return uint8_t(v);
}
__device__ __forceinline__ void st_shared_16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ uint16_t ld_shared_16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint2 ld_shared_64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared2(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ float4 ld_shared4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_shared2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// x << n for any n >= 0, 0 from n = 32 on (PTX clamps the shift; C++ leaves it undefined).
__device__ __forceinline__ uint32_t shl_clamped(uint32_t x, uint32_t n) {
  uint32_t y;
  asm("shl.b32 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(n));
  return y;
}

// Orders this thread's generic-proxy writes to shared memory (st.shared, cp.async) before the
// async proxy's reads of it (wgmma, TMA stores) that follow a barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// cp.async of 16 (through L2 only) or 4 bytes, global to shared; zeros and nothing read where
// !valid (src must still be an address of the tensor).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

// A bulk reduction (add, f32) of `bytes` of shared memory at `src` into global memory at `dst`,
// as one operation of the thread's bulk group: both 16-byte aligned, `bytes` a multiple of 16.
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, int bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits for the thread's bulk groups: until their shared memory has been read (the source may
// be written again), or (kComplete) until their writes are done and ordered before this thread's
// later global accesses.
template <bool kComplete>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (kComplete) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

// n / d for a divisor fixed per launch, 0 <= n < 2^31: a multiply-high and a shift instead of
// the ~20-instruction integer division (the tile decode sits on the critical path of the first
// TMA issue). m = ceil(2^(31+p) / d) with p = ceil(log2 d) keeps the error of n·m / 2^(31+p)
// under 2^-p <= 1/d, so the floor is exact.
struct FastDiv {
  int d = 1;
  uint32_t mul = 0, shr = 0;
  FastDiv() = default;
  explicit FastDiv(int divisor) : d(divisor) {
    uint32_t p = 0;
    while ((int64_t(1) << p) < divisor) ++p;
    if (d > 1) {
      mul = uint32_t(((uint64_t(1) << (31 + p)) + uint64_t(d) - 1) / uint64_t(d));
      shr = p - 1;
    }
  }
  __device__ __forceinline__ int div(int n) const {
    return d == 1 ? n : int(__umulhi(uint32_t(n), mul) >> shr);
  }
};

// The sizes, the GQA group divisor and the log2-domain softmax scale every sm_90a parameter block
// (the main kernel's MainloopParams, the small kernel's SmallParams) carries, from validated
// arguments (32-bit sizes: each kernel's can_implement).
template <class P>
void fill_sizes(P& p, const FwdArgs& a) {
  p.seq_q = int(a.dims.seq_q);
  p.seq_k = int(a.dims.seq_k);
  p.heads = int(a.dims.heads);
  p.kv_heads = int(a.dims.kv_heads);
  p.batch = int(a.dims.batch);
  p.scale_log2 = a.mods.scale * 1.4426950408889634f;
  p.div_group = FastDiv(int(a.dims.heads / a.dims.kv_heads));
}

// E4M3: the dequantization scales of (batch b, head h) from a parameter block's q_scale, k_scale,
// v_scale (one per tensor, or per (batch, head) where per_head): q·k's multiply the softmax
// scale sl2, v's is the output factor o_scale.
template <class P>
__device__ __forceinline__ void dequant_scales(const P& p, int b, int h, float& sl2,
                                               float& o_scale) {
  const int hk = p.div_group.div(h);
  const int qsi = p.per_head ? b * p.heads + h : 0;
  const int kvi = p.per_head ? b * p.kv_heads + hk : 0;
  sl2 *= __ldg(p.q_scale + qsi) * __ldg(p.k_scale + kvi);
  o_scale = __ldg(p.v_scale + kvi);
}

// Softmax exponents at any logit size. Each row's base is RN(m·scale) and every exponent is taken
// against it. The fast form folds the scale into one FMA, fma(x, scale, -base): its exact product
// leaves the max the base's rounding residual as exponent, at most 2^-9 while |base| < 2^15, but
// past ~2^24 whole powers of two (p of the max 0 or inf: tests/numerics.rs, logits 1e8-1e10).
// Beyond 2^15 the exact form RN(x·scale) - base is used instead: the max's exponent exactly 0, the
// others <= 0. The choice is one vote per warp and tile, so ordinary logits run exactly the
// single-FMA code (an extra FADD per score, or a branch per row, cost the sm90 kernel time, and
// the branch cost cutlass-sm80 far more; measured: docs/log/2026-11-notebook.md, "softmax exponents
// at huge logits").
constexpr float kFoldLimit = 32768.f;

__device__ __forceinline__ float scaled_base(float m, float scale) {
  // A row with nothing visible yet keeps m = -inf: base 0 keeps p = 0, not NaN.
  return m == -INFINITY ? 0.f : __fmul_rn(m, scale);
}

// wgmma, TMA, setmaxnreg and clusters as compiled for sm_90a: Hopper (H100, H200) alone.
inline std::string sm90_only(const DeviceInfo& dev) {
  if (!known(dev) || (dev.cc_major == 9 && dev.cc_minor == 0)) return "";
  return "the sm_90a kernel runs on compute capability 9.0 (H100/H200), the GPU has " +
         limits::cc(dev);
}

// TMA needs a 16-byte aligned base and 16-byte multiple strides below 2^40 bytes (and dims
// below 2^32: the shapes here are int). A null pointer is not checked (can_implement asked before
// the buffers exist).
inline std::string tma_operand(uint64_t address, const Strides& s, const char* what,
                               int elem_bytes) {
  const auto ok = [&](int64_t st) {
    return st >= 0 && (st * elem_bytes) % 16 == 0 && st * elem_bytes < (int64_t(1) << 40);
  };
  if (address % 16 != 0 || !ok(s.batch) || !ok(s.head) || !ok(s.seq))
    return std::string(what) +
           " is not TMA-addressable (16-byte aligned base and strides required)";
  return "";
}

}  // namespace sdpa::cutlass_sm90
