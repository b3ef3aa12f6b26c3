#include "sdpa-sys/src/bridge.h"

#include "sdpa-sys/src/lib.rs.h"
#include "sdpa/sdpa.h"

namespace sdpa_bridge {

rust::String can_implement(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev) {
  return sdpa::can_implement(kernel, args, dev);
}

KernelPlan plan(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev) {
  return sdpa::plan(kernel, args, dev);
}

void forward(const KernelPlan& plan, const FwdArgs& args, const DeviceInfo& dev,
             std::size_t stream) {
  sdpa::forward(plan, args, dev, reinterpret_cast<void*>(stream));
}

rust::String can_implement_backward(Kernel kernel, const BwdArgs& args, const DeviceInfo& dev) {
  return sdpa::can_implement_backward(kernel, args, dev);
}

KernelPlan plan_backward(Kernel kernel, const BwdArgs& args, const DeviceInfo& dev) {
  return sdpa::plan_backward(kernel, args, dev);
}

void backward(const KernelPlan& plan, const BwdArgs& args, const DeviceInfo& dev,
              std::size_t stream) {
  sdpa::backward(plan, args, dev, reinterpret_cast<void*>(stream));
}

void absmax(uint64_t x, bool x_is_f32, Dtype dtype, int64_t n, ScaleMap m, uint64_t amax,
            int64_t groups, std::size_t stream) {
  sdpa::absmax(reinterpret_cast<const void*>(x), x_is_f32, dtype, n, m,
               reinterpret_cast<float*>(amax), groups, reinterpret_cast<void*>(stream));
}

void e4m3_quantize(uint64_t x, bool x_is_f32, Dtype dtype, uint64_t y, int64_t n, ScaleMap m,
                   uint64_t scale, std::size_t stream) {
  sdpa::e4m3_quantize(reinterpret_cast<const void*>(x), x_is_f32, dtype,
                      reinterpret_cast<uint8_t*>(y), n, m, reinterpret_cast<const float*>(scale),
                      reinterpret_cast<void*>(stream));
}

void e4m3_dequantize(uint64_t x, uint64_t y, Dtype out_dtype, int64_t n, ScaleMap m, uint64_t scale,
                     std::size_t stream) {
  sdpa::e4m3_dequantize(reinterpret_cast<const uint8_t*>(x), reinterpret_cast<void*>(y), out_dtype,
                        n, m, reinterpret_cast<const float*>(scale),
                        reinterpret_cast<void*>(stream));
}

void masked_softmax(const SoftmaxArgs& a, std::size_t stream) {
  sdpa::masked_softmax(a, reinterpret_cast<void*>(stream));
}

void sanitize_v(const NonFiniteVArgs& a, std::size_t stream) {
  sdpa::sanitize_v(a, reinterpret_cast<void*>(stream));
}

void add_nonfinite_v(const NonFiniteVArgs& a, std::size_t stream) {
  sdpa::add_nonfinite_v(a, reinterpret_cast<void*>(stream));
}

void kv_write(const KvWriteArgs& a, const DeviceInfo& dev, std::size_t stream) {
  sdpa::kv_write(a, dev, reinterpret_cast<void*>(stream));
}

void e4m3_encode(uint64_t x, uint64_t y, int64_t n, float inv_scale, std::size_t stream) {
  sdpa::e4m3_encode(reinterpret_cast<const float*>(x), reinterpret_cast<uint8_t*>(y), n, inv_scale,
                    reinterpret_cast<void*>(stream));
}

void empty_kernel(int32_t blocks, std::size_t stream) {
  sdpa::empty_kernel(blocks, reinterpret_cast<void*>(stream));
}

void merge_init(uint64_t acc_o, uint64_t acc_lse, int64_t rows, int64_t head_dim,
                std::size_t stream) {
  sdpa::merge_init(reinterpret_cast<float*>(acc_o), reinterpret_cast<float*>(acc_lse), rows,
                   head_dim, reinterpret_cast<void*>(stream));
}

void merge_partial(const MergeArgs& a, std::size_t stream) {
  sdpa::merge_partial(a, reinterpret_cast<void*>(stream));
}

void merge_finish(const MergeFinishArgs& a, std::size_t stream) {
  sdpa::merge_finish(a, reinterpret_cast<void*>(stream));
}

bool built_with_cutlass() { return sdpa::built_with_cutlass(); }

std::size_t tile_counters() { return std::size_t(sdpa::kTileCounters); }

rust::Vec<KernelAttr> kernel_attributes(const DeviceInfo& dev) {
  rust::Vec<KernelAttr> out;
  for (const auto& k : sdpa::kernel_attributes(dev)) {
    out.push_back(KernelAttr{k.backend, k.name, k.registers, k.static_smem, k.dynamic_smem,
                             k.local_bytes, k.max_threads});
  }
  return out;
}
}  // namespace sdpa_bridge
