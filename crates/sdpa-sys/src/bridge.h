// Declarations cxx binds to; definitions in bridge.cc. Converts between the cxx shared structs
// and the core's own (cpp/include/sdpa/sdpa.h), so the CMake build never sees cxx.
#pragma once

#include <cstdint>

#include "rust/cxx.h"
#include "sdpa/merge.h"
#include "sdpa/sdpa.h"

namespace sdpa_bridge {
struct DeviceInfo;
struct FwdArgs;
struct KernelAttr;
struct SoftmaxArgs;
struct NonFiniteVArgs;
struct KvAppendArgs;
struct MergeArgs;
struct MergeFinishArgs;
struct ScaleMap;
using sdpa::Dtype;
using sdpa::Kernel;
using sdpa::Mask;

rust::String can_implement(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev);
void forward(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev, std::size_t stream);
void masked_softmax(const SoftmaxArgs& args, std::size_t stream);
void kv_append(const KvAppendArgs& args, std::size_t stream);
void sanitize_v(const NonFiniteVArgs& args, std::size_t stream);
void add_nonfinite_v(const NonFiniteVArgs& args, std::size_t stream);
void e4m3_encode(uint64_t x, uint64_t y, int64_t n, float inv_scale, std::size_t stream);
int64_t workspace_bytes(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev);
void absmax(uint64_t x, bool x_is_f32, Dtype dtype, int64_t n, ScaleMap map, uint64_t amax,
            int64_t groups, std::size_t stream);
void e4m3_quantize(uint64_t x, bool x_is_f32, Dtype dtype, uint64_t y, int64_t n, ScaleMap map,
                   uint64_t scale, std::size_t stream);
void e4m3_dequantize(uint64_t x, uint64_t y, Dtype out_dtype, int64_t n, ScaleMap map,
                     uint64_t scale, std::size_t stream);
void empty_kernel(int32_t blocks, std::size_t stream);
void merge_init(uint64_t acc_o, uint64_t acc_lse, int64_t rows, int64_t head_dim,
                std::size_t stream);
void merge_partial(const MergeArgs& args, std::size_t stream);
void merge_finish(const MergeFinishArgs& args, std::size_t stream);
rust::Vec<KernelAttr> kernel_attributes(const DeviceInfo& dev);
bool built_with_cutlass();
}  // namespace sdpa_bridge
