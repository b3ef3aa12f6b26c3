// Declarations cxx binds to; definitions in bridge.cc. Converts between the cxx shared structs
// and the core's own (cpp/include/sdpa/sdpa.h), so the CMake build never sees cxx.
#pragma once

#include <cstdint>

#include "rust/cxx.h"

namespace sdpa_bridge {
struct FwdArgs;
struct KernelAttr;
struct SoftmaxArgs;
enum class Kernel : int32_t;

void forward(Kernel kernel, const FwdArgs& args, std::size_t stream);
void masked_softmax(const SoftmaxArgs& args, std::size_t stream);
void e4m3_encode(uint64_t x, uint64_t y, int64_t n, float inv_scale, std::size_t stream);
void empty_kernel(int32_t blocks, std::size_t stream);
rust::Vec<KernelAttr> kernel_attributes();
bool built_with_cutlass();
}  // namespace sdpa_bridge
