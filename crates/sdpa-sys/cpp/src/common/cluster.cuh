// Thread block clusters (sm_90), device side: the cluster's barrier in two halves, and stores
// into another CTA's shared memory (distributed shared memory). Every thread of every CTA of the
// cluster arrives once per phase (the .aligned forms: the whole warp at once); an arrival with
// release pairs with a wait with acquire, a relaxed one orders nothing (the usual first phase:
// every CTA has started before any writes into another). Compiled out below sm_90, where no
// kernel launches in clusters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sdpa {

__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// Address `addr` of this CTA's shared memory -> the same offset in cluster CTA `rank`'s.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, int rank) {
  uint32_t r = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
#endif
  return r;
}
// Stores to a cluster shared-memory address (map_rank's).
__device__ __forceinline__ void st_cluster(uint32_t addr, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(x) : "memory");
#endif
}
__device__ __forceinline__ void st_cluster2(uint32_t addr, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
#endif
}

}  // namespace sdpa
