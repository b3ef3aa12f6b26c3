// Pieces the fused kernels' launches share: the kernel parameter block of scalar and wmma built
// from the validated FwdArgs, the once-per-device opt-in to more than 48 KB of shared memory, and
// programmatic dependent launch (the sm_90a kernels, the decode kernel's combine on sm_90), host
// and device side.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {

// Byte pointers (kernels add 2-byte-element offsets themselves) and 64-bit sizes and strides
// (scalar, wmma). A kernel's own index arithmetic may still be 32-bit in places: its limits are
// in its can_implement.
struct KernelParams {
  const uint8_t *q, *k, *v;
  uint8_t* o;
  int64_t seq_q, seq_k, heads, group;  // group = heads / kv_heads
  Strides qs, ks, vs, os;
  float scale_log2;  // scale * log2(e): scores live in the log2 domain
};

inline KernelParams make_params(const FwdArgs& a) {
  KernelParams p;
  p.q = device_ptr<const uint8_t>(a.ops.q);
  p.k = device_ptr<const uint8_t>(a.ops.k);
  p.v = device_ptr<const uint8_t>(a.ops.v);
  p.o = device_ptr<uint8_t>(a.ops.o);
  p.seq_q = a.dims.seq_q;
  p.seq_k = a.dims.seq_k;
  p.heads = a.dims.heads;
  p.group = a.dims.heads / a.dims.kv_heads;
  p.qs = a.ops.q_stride;
  p.ks = a.ops.k_stride;
  p.vs = a.ops.v_stride;
  p.os = a.ops.o_stride;
  p.scale_log2 = a.mods.scale * 1.4426950408889634f;
  return p;
}

// Dynamic shared memory above 48 KB needs cudaFuncSetAttribute, which is per function and per
// device: `configured` (one static per instantiation) keeps one bit per device already done,
// so it is one call per (instantiation, device), not one per launch.
inline void opt_in_smem(const void* kernel, int bytes, std::atomic<uint64_t>& configured) {
  int dev = 0;
  SDPA_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit != 0 && (configured.load(std::memory_order_relaxed) & bit)) return;
  SDPA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  configured.fetch_or(bit, std::memory_order_relaxed);
}

// Programmatic dependent launch for the kernels that wait for it (griddepcontrol.wait before
// their first global access): the launch, the CTAs' start-up (barrier setup, descriptor
// prefetch) and, where SMs are free, their residency overlap the tail of the grid before them
// on the stream. SDPA_PDL=0 in the environment turns it off (read once), for A/B measurement.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("SDPA_PDL");
    return !(e != nullptr && e[0] == '0');
  }();
  return on;
}

// Programmatic dependent launch, device side. A grid launched with the programmatic
// stream-serialization attribute may start while the grid before it on the stream is still
// running: it must wait (griddepcontrol.wait: the earlier grid has completed and its writes are
// visible) before its first global read or write. launch_dependents lets the next grid on the
// stream start once every CTA of this one has issued it or exited; CTAs not yet resident have
// not, so the next grid cannot take SMs this one still needs. Both are no-ops in a grid
// launched without the attribute, and compiled out below sm_90 (no such launches there).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Appends the programmatic-serialization attribute to `cfg` (whose attrs point into `attrs`,
// room for one more) when PDL is enabled.
inline void add_pdl(cudaLaunchConfig_t& cfg, cudaLaunchAttribute* attrs) {
  if (!pdl_enabled()) return;
  cudaLaunchAttribute& at = attrs[cfg.numAttrs++];
  at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
}

// Launches `kernel` on `stream` (grid, block, dynamic shared memory bytes) with `args`, in
// clusters of `cluster_x` CTAs along x (1: none; sm_90 and later, and a kernel that opted in to
// clusters of more than 8 where it takes them), programmatically where `programmatic` (the
// device is sm_90 or later, and the kernel waits with pdl_wait before its first global access)
// and PDL is enabled.
template <typename... Params, typename... Args>
void launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, bool programmatic, unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  if (cluster_x > 1) {
    cudaLaunchAttribute& at = attrs[cfg.numAttrs++];
    at.id = cudaLaunchAttributeClusterDimension;
    at.val.clusterDim.x = cluster_x;
    at.val.clusterDim.y = 1;
    at.val.clusterDim.z = 1;
    cfg.attrs = attrs;
  }
  if (programmatic) add_pdl(cfg, attrs);
  SDPA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// launch_clustered without clusters.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool programmatic, Args&&... args) {
  launch_clustered(kernel, grid, block, smem, stream, programmatic, 1, std::forward<Args>(args)...);
}

}  // namespace sdpa
