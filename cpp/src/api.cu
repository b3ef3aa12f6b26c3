// Host-side dispatch: the one switch from (kernel, dtype, head_dim) to an instantiation.
// Arguments arrive validated by the Rust layer; the default branches are a second line of
// defence that throws instead of launching anything.
#include <string>

#include "common/check.cuh"
#include "fp8/simulated.h"
#include "sdpa/sdpa.h"

// Each backend folder defines forward_<dtype>_d<D> and attributes_<dtype>_d<D> per
// instantiation file (cpp/src/<backend>/fwd_<dtype>_d<D>.cu).
#define SDPA_DECLARE_INSTANTIATIONS(ns)                 \
  namespace ns {                                        \
  void forward_f16_d64(const FwdArgs&, cudaStream_t);   \
  void forward_f16_d128(const FwdArgs&, cudaStream_t);  \
  void forward_bf16_d64(const FwdArgs&, cudaStream_t);  \
  void forward_bf16_d128(const FwdArgs&, cudaStream_t); \
  void attributes_f16_d64(std::vector<KernelAttr>&);    \
  void attributes_f16_d128(std::vector<KernelAttr>&);   \
  void attributes_bf16_d64(std::vector<KernelAttr>&);   \
  void attributes_bf16_d128(std::vector<KernelAttr>&);  \
  }

namespace sdpa {
SDPA_DECLARE_INSTANTIATIONS(scalar)
SDPA_DECLARE_INSTANTIATIONS(wmma_backend)
#if defined(SDPA_HAVE_CUTLASS)
SDPA_DECLARE_INSTANTIATIONS(cutlass_sm90)
SDPA_DECLARE_INSTANTIATIONS(cutlass_sm80)
// The native FP8 kernels (cpp/src/cutlass/sm90/fwd_e4m3_d*.cu): E4M3 Q, K, V with scales, output
// args.out_dtype. Every other fused kernel takes E4M3 inputs through the simulated path
// (dequantized into the workspace first, fp8/simulated.cu).
namespace cutlass_sm90 {
void forward_e4m3_d64(const FwdArgs&, cudaStream_t);
void forward_e4m3_d128(const FwdArgs&, cudaStream_t);
void attributes_e4m3_d64(std::vector<KernelAttr>&);
void attributes_e4m3_d128(std::vector<KernelAttr>&);
int64_t workspace_e4m3(const FwdArgs&);
}  // namespace cutlass_sm90
#endif

namespace {
using ForwardFn = void (*)(const FwdArgs&, cudaStream_t);

// [dtype][head_dim 64, 128]
template <ForwardFn F16_64, ForwardFn F16_128, ForwardFn BF16_64, ForwardFn BF16_128>
void dispatch(const char* name, const FwdArgs& a, cudaStream_t s) {
  if (a.dtype != Dtype::F16 && a.dtype != Dtype::BF16)
    throw Error(std::string(name) + ": unsupported dtype code " + std::to_string(int(a.dtype)));
  const bool f16 = a.dtype == Dtype::F16;
  switch (a.head_dim) {
    case 64:
      return f16 ? F16_64(a, s) : BF16_64(a, s);
    case 128:
      return f16 ? F16_128(a, s) : BF16_128(a, s);
    default:
      throw Error(std::string(name) + ": head_dim " + std::to_string(a.head_dim) +
                  " not instantiated");
  }
}

// Kernels without FP8 math take E4M3 inputs through the simulated path (fp8/simulated.cu).
bool simulated(Kernel kernel, const FwdArgs& a) {
  return a.dtype == Dtype::E4M3 && kernel != Kernel::Cutlass;
}
}  // namespace

void forward(Kernel kernel, const FwdArgs& a, void* stream) {
  if (simulated(kernel, a)) return simulated_forward(kernel, a, stream);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (kernel) {
    case Kernel::Scalar:
      return dispatch<scalar::forward_f16_d64, scalar::forward_f16_d128, scalar::forward_bf16_d64,
                      scalar::forward_bf16_d128>("scalar", a, s);
    case Kernel::Wmma:
      return dispatch<wmma_backend::forward_f16_d64, wmma_backend::forward_f16_d128,
                      wmma_backend::forward_bf16_d64, wmma_backend::forward_bf16_d128>("wmma", a,
                                                                                       s);
    case Kernel::Cutlass:
#if defined(SDPA_HAVE_CUTLASS)
      if (a.dtype == Dtype::E4M3) {
        if (a.head_dim == 64) return cutlass_sm90::forward_e4m3_d64(a, s);
        if (a.head_dim == 128) return cutlass_sm90::forward_e4m3_d128(a, s);
        throw Error("cutlass-sm90 e4m3: head_dim " + std::to_string(a.head_dim) +
                    " not instantiated");
      }
      return dispatch<cutlass_sm90::forward_f16_d64, cutlass_sm90::forward_f16_d128,
                      cutlass_sm90::forward_bf16_d64, cutlass_sm90::forward_bf16_d128>(
          "cutlass-sm90", a, s);
#else
      throw Error("cutlass-sm90: this build has no CUTLASS headers (set CUTLASS_DIR)");
#endif
    case Kernel::CutlassSm80:
#if defined(SDPA_HAVE_CUTLASS)
      return dispatch<cutlass_sm80::forward_f16_d64, cutlass_sm80::forward_f16_d128,
                      cutlass_sm80::forward_bf16_d64, cutlass_sm80::forward_bf16_d128>(
          "cutlass-sm80", a, s);
#else
      throw Error("cutlass-sm80: this build has no CUTLASS headers (set CUTLASS_DIR)");
#endif
  }
  throw Error("unknown kernel code " + std::to_string(int(kernel)));
}

int64_t workspace_bytes(Kernel kernel, const FwdArgs& a) {
  if (simulated(kernel, a)) return simulated_workspace_bytes(a);
#if defined(SDPA_HAVE_CUTLASS)
  if (kernel == Kernel::Cutlass && a.dtype == Dtype::E4M3) return cutlass_sm90::workspace_e4m3(a);
#endif
  (void)kernel;
  (void)a;
  return 0;
}

__global__ void empty() {}

void empty_kernel(int32_t blocks, void* stream) {
  empty<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>();
  SDPA_LAUNCH_CHECK("empty kernel launch");
}

std::vector<KernelAttr> kernel_attributes() {
  std::vector<KernelAttr> out;
  for (auto f : {scalar::attributes_f16_d64, scalar::attributes_f16_d128,
                 scalar::attributes_bf16_d64, scalar::attributes_bf16_d128,
                 wmma_backend::attributes_f16_d64, wmma_backend::attributes_f16_d128,
                 wmma_backend::attributes_bf16_d64, wmma_backend::attributes_bf16_d128})
    f(out);
#if defined(SDPA_HAVE_CUTLASS)
  for (auto f : {cutlass_sm90::attributes_f16_d64, cutlass_sm90::attributes_f16_d128,
                 cutlass_sm90::attributes_bf16_d64, cutlass_sm90::attributes_bf16_d128,
                 cutlass_sm80::attributes_f16_d64, cutlass_sm80::attributes_f16_d128,
                 cutlass_sm80::attributes_bf16_d64, cutlass_sm80::attributes_bf16_d128,
                 cutlass_sm90::attributes_e4m3_d64, cutlass_sm90::attributes_e4m3_d128})
    f(out);
#endif
  return out;
}

bool built_with_cutlass() {
#if defined(SDPA_HAVE_CUTLASS)
  return true;
#else
  return false;
#endif
}

}  // namespace sdpa
