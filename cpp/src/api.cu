// Host-side dispatch: the one switch from (backend, dtype, head_dim) to an instantiation.
// Arguments arrive validated by the Rust layer; the default branches are a second line of
// defence that throws instead of launching anything.
#include <string>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {
namespace scalar {
void forward_f16_d64(const FwdArgs&, cudaStream_t);
void forward_f16_d128(const FwdArgs&, cudaStream_t);
void forward_bf16_d64(const FwdArgs&, cudaStream_t);
void forward_bf16_d128(const FwdArgs&, cudaStream_t);
void attributes_f16_d64(std::vector<KernelAttr>&);
void attributes_f16_d128(std::vector<KernelAttr>&);
void attributes_bf16_d64(std::vector<KernelAttr>&);
void attributes_bf16_d128(std::vector<KernelAttr>&);
}  // namespace scalar

void scalar_forward(const FwdArgs& a, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const bool f16 = a.dtype == Dtype::F16;
  if (a.dtype != Dtype::F16 && a.dtype != Dtype::BF16)
    throw Error("scalar: unsupported dtype code " + std::to_string(int(a.dtype)));
  switch (a.head_dim) {
    case 64:
      return f16 ? scalar::forward_f16_d64(a, s) : scalar::forward_bf16_d64(a, s);
    case 128:
      return f16 ? scalar::forward_f16_d128(a, s) : scalar::forward_bf16_d128(a, s);
    default:
      throw Error("scalar: head_dim " + std::to_string(a.head_dim) + " not instantiated");
  }
}

__global__ void empty() {}

void empty_kernel(int32_t blocks, void* stream) {
  empty<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>();
  SDPA_LAUNCH_CHECK("empty kernel launch");
}

std::vector<KernelAttr> kernel_attributes() {
  std::vector<KernelAttr> out;
  scalar::attributes_f16_d64(out);
  scalar::attributes_f16_d128(out);
  scalar::attributes_bf16_d64(out);
  scalar::attributes_bf16_d128(out);
  return out;
}

}  // namespace sdpa
