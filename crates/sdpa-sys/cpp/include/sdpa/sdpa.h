// The C++ core's whole public surface: plain structs and functions, no CUDA types, so the Rust
// bridge (crates/sdpa-sys/src/bridge.cc) can include it with a host compiler alone. The
// argument blocks are declared once, in crates/sdpa-sys/src/args.rs, from which cxx generates
// sdpa/args.h; the kernel list (sdpa/kernels.h) comes from cpp/kernels.txt. Both are generated
// by the build (crates/sdpa-sys/build.rs). Every function throws sdpa::Error (a
// std::runtime_error) on failure; nothing aborts.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "sdpa/args.h"
#include "sdpa/kernels.h"

namespace sdpa {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#if defined(__CUDACC__)
#define SDPA_HOST_DEVICE __host__ __device__
#else
#define SDPA_HOST_DEVICE
#endif

// A device address of an argument block (sdpa/args.h) as the pointer the code reads it through.
template <class T>
SDPA_HOST_DEVICE inline T* device_ptr(uint64_t address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// Whether `dev` describes a device (all zero: a question asked without a GPU).
inline bool known(const DeviceInfo& dev) { return dev.cc_major > 0; }

// The cuBLAS backend's softmax step (SoftmaxArgs).
void masked_softmax(const SoftmaxArgs& args, void* stream);

// Before the P·V GEMM: writes v_finite and first_keys.
void sanitize_v(const NonFiniteVArgs& args, void* stream);

// After it: adds to each O element (row r, column d) what V's non-finite values contribute in
// the reference over the keys k <= r + seq_k - seq_q: NaN (a NaN, or both infinities), +Inf or
// -Inf. Rows that see no key keep their zeros.
void add_nonfinite_v(const NonFiniteVArgs& args, void* stream);

// Resource use of one compiled kernel on the current device (cudaFuncGetAttributes).
struct KernelAttr {
  std::string backend, name;
  int32_t registers, static_smem, dynamic_smem, local_bytes, max_threads;
};

// Why `kernel` cannot run `args` on `dev`, or "" where it can: that it is instantiated for
// args.dtype and args.head_dim, and what the kernel itself requires (its device, its shared
// memory against dev.smem_optin_per_block, its 32-bit and grid limits, TMA addressing), each
// stated next to the kernel (its header's can_implement). The pointers of `args` may be null
// (a question asked before any buffer exists; `alibi`, `sinks` and `has_lse` say what the call
// will pass); the ones set are checked for what the kernel needs of them. Device requirements are
// skipped for an unknown `dev`.
std::string can_implement(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev);

// What `kernel` runs for the problem of `args` on the device `dev` describes, decided once: the
// instantiation, whether e4m3 inputs go through the simulated path, the scratch bytes every
// run needs in args.scratch.workspace. The pointers of `args` may be 0. Throws can_implement's
// reason where it is not empty.
KernelPlan plan(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev);

// Runs the planned kernel on `args` (the problem `plan` was made for, with this call's
// buffers), enqueued on `stream` (a CUstream / cudaStream_t) of the device `dev` describes. The
// choice is the plan's; what the kernel needs of the buffers (alignment, TMA addressing, the
// pointers the problem asks for) is checked again, and refused with the kernel's reason.
void forward(const KernelPlan& plan, const FwdArgs& args, const DeviceInfo& dev, void* stream);

// The backward (BwdArgs): why `kernel` cannot run it on `dev` ("" where it can), as
// can_implement for the forward; what it runs, decided once (the instance of the backward's
// table, the workspace bytes a run needs in args.grads.workspace); and a run, enqueued on
// `stream`: dQ, dK, dV (and dsinks) written from Q, K, V, O, dO and the LSE.
std::string can_implement_backward(Kernel kernel, const BwdArgs& args, const DeviceInfo& dev);
KernelPlan plan_backward(Kernel kernel, const BwdArgs& args, const DeviceInfo& dev);
void backward(const KernelPlan& plan, const BwdArgs& args, const DeviceInfo& dev, void* stream);

// Writes new key and value rows into a paged cache, at the cache's strides (NHD or HND pages):
// row i to slot slots[i] (page slot / page_size, offset slot % page_size; vLLM's slot_mapping),
// or, without slots, to its sequence's next positions (FlashAttention's flash_attn_with_kvcache
// append; FlashInfer's append_paged_kv_cache with cu_new): row i of sequence b goes to position
// seqused_k[b] + (i - first row of b), key j living at offset j % page_size of page
// block_table[b * pages_per_seq + j / page_size]; then seqused_k[b] grows by its rows, up to
// pages_per_seq · page_size. Slots outside the cache and positions outside a sequence's pages
// are dropped, table entries outside [0, pages) clamped into it. One or two launches on
// `stream` (programmatic where `dev` is sm_90 or later), nothing on the host: capturable in a
// CUDA graph.
void kv_write(const KvWriteArgs& args, const DeviceInfo& dev, void* stream);

// y[i] = E4M3(x[i] * inv_scale), saturating to +-448, round to nearest even (the GPU's own
// conversion). x: f32 device buffer, y: byte device buffer, both n long.
void e4m3_encode(const float* x, uint8_t* y, int64_t n, float inv_scale, void* stream);

// amax[g] = max |x[i]| over the elements of group g (NaN ignored), for `groups` groups; x holds
// f32 when `x_is_f32`, else elements of `dtype` (F16 or BF16). amax must be zeroed first.
void absmax(const void* x, bool x_is_f32, Dtype dtype, int64_t n, ScaleMap map, float* amax,
            int64_t groups, void* stream);

// y[i] = E4M3(x[i] / scale[group(i)]), saturating to +-448, round to nearest even.
void e4m3_quantize(const void* x, bool x_is_f32, Dtype dtype, uint8_t* y, int64_t n, ScaleMap map,
                   const float* scale, void* stream);

// y[i] = out_dtype(decode(x[i]) * scale[group(i)]), round to nearest even.
void e4m3_dequantize(const uint8_t* x, void* y, Dtype out_dtype, int64_t n, ScaleMap map,
                     const float* scale, void* stream);

// Runs an empty kernel on `blocks` CTAs: the launch floor every timing is read against.
void empty_kernel(int32_t blocks, void* stream);

// The kernels forward() launches on the current device, which `dev` describes.
std::vector<KernelAttr> kernel_attributes(const DeviceInfo& dev);

// Whether the CUTLASS kernels were compiled in (CUTLASS headers found at build time).
bool built_with_cutlass();

}  // namespace sdpa
