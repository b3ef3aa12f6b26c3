// The log-sum-exp merge of partial attention results (sdpa/merge.h). Memory-bound: one warp a
// row, each lane a pair of head_dim values at a time (32-bit loads of a 16-bit part, 64-bit of an
// f32 part and of the f32 accumulator); the row's weights are computed once per lane from two
// floats.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/check.cuh"
#include "common/dtype.cuh"
#include "sdpa/merge.h"

namespace sdpa {
namespace {

constexpr int kRowsPerBlock = 8;  // warps of a 256-thread block, one row each
constexpr int kThreads = 32 * kRowsPerBlock;

unsigned blocks_for(int64_t rows) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > INT32_MAX) throw Error("merge: more rows than one grid covers");
  return unsigned(blocks);
}

// A type as a value, for a generic lambda to instantiate a kernel with.
template <typename T>
struct Type {
  using type = T;
};

// The host side both row kernels share: head_dim even (lanes take pairs), nothing launched for
// no rows, `launch(Type<T>{}, blocks, stream)` with T the 16-bit type of `dtype`, or float where
// kF32 allows it (`what` names the tensor of that dtype), then the launch checked under `name`.
template <bool kF32, typename Launch>
void launch_rows(const char* name, const char* what, int64_t rows, int64_t head_dim, Dtype dtype,
                 void* stream, Launch launch) {
  if (head_dim % 2 != 0) throw Error("merge: head_dim must be even");
  if (rows == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::F16:
      launch(Type<__half>{}, blocks_for(rows), st);
      break;
    case Dtype::BF16:
      launch(Type<__nv_bfloat16>{}, blocks_for(rows), st);
      break;
    case Dtype::F32:
      if constexpr (kF32) {
        launch(Type<float>{}, blocks_for(rows), st);
        break;
      }
      [[fallthrough]];
    default:
      throw Error(std::string("merge: ") + what +
                  (kF32 ? " are f16, bf16 or f32" : " are f16 or bf16"));
  }
  SDPA_LAUNCH_CHECK(name);
}

__global__ void fill_no_key(float* lse, int64_t rows) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < rows) lse[i] = -INFINITY;
}

// Elements 2i and 2i + 1 of a row of T as f32.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* row, int64_t i) {
  if constexpr (std::is_same_v<T, float>)
    return reinterpret_cast<const float2*>(row)[i];
  else
    return Pair<T>::to_float2(reinterpret_cast<const uint32_t*>(row)[i]);
}

template <typename T>
__global__ void merge_rows(const MergeArgs a) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.batch * a.heads * a.rows) return;
  const int64_t s = row % a.rows, bh = row / a.rows, h = bh % a.heads, b = bh / a.heads;
  const int64_t acc_row = bh * a.acc_seq + a.row0 + s;
  float* acc_lse = device_ptr<float>(a.acc_lse);
  const float l1 = acc_lse[acc_row], l2 = device_ptr<const float>(a.part_lse)[row];
  if (l2 == -INFINITY) return;  // the part saw no key for this row: nothing to add
  const float m = fmaxf(l1, l2);
  const float w1 = expf(l1 - m), w2 = expf(l2 - m);  // w1 = 0 while the row has seen no key
  const float sum = w1 + w2, c1 = w1 / sum, c2 = w2 / sum;
  float2* o = reinterpret_cast<float2*>(device_ptr<float>(a.acc_o) + acc_row * a.head_dim);
  const T* p_row = device_ptr<const T>(a.part_o) + b * a.part_stride.batch +
                   h * a.part_stride.head + s * a.part_stride.seq;
  for (int64_t i = lane; i < a.head_dim / 2; i += 32) {
    const float2 x = o[i], y = load_pair(p_row, i);
    o[i] = make_float2(c1 * x.x + c2 * y.x, c1 * x.y + c2 * y.y);
  }
  __syncwarp();
  if (lane == 0) acc_lse[acc_row] = m + logf(sum);
}

template <typename T>
__global__ void finish_rows(const MergeFinishArgs a) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.batch * a.heads * a.seq) return;
  const int64_t s = row % a.seq, bh = row / a.seq, h = bh % a.heads, b = bh / a.heads;
  const float2* o =
      reinterpret_cast<const float2*>(device_ptr<const float>(a.acc_o) + row * a.head_dim);
  T* out_row =
      device_ptr<T>(a.out) + b * a.out_stride.batch + h * a.out_stride.head + s * a.out_stride.seq;
  uint32_t* out = reinterpret_cast<uint32_t*>(out_row);
  for (int64_t i = lane; i < a.head_dim / 2; i += 32) {
    const float2 x = o[i];
    out[i] = Pair<T>::from_float2(x.x, x.y);
  }
}

}  // namespace

void merge_init(float* acc_o, float* acc_lse, int64_t rows, int64_t head_dim, void* stream) {
  if (rows == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  SDPA_CUDA_CHECK(cudaMemsetAsync(acc_o, 0, size_t(rows * head_dim) * sizeof(float), st));
  const int64_t blocks = (rows + 255) / 256;
  if (blocks > INT32_MAX) throw Error("merge_init: more rows than one grid covers");
  fill_no_key<<<unsigned(blocks), 256, 0, st>>>(acc_lse, rows);
  SDPA_LAUNCH_CHECK("merge_init launch");
}

void merge_partial(const MergeArgs& a, void* stream) {
  launch_rows<true>("merge_partial launch", "partial outputs", a.batch * a.heads * a.rows,
                    a.head_dim, a.dtype, stream, [&](auto t, unsigned blocks, cudaStream_t st) {
                      merge_rows<typename decltype(t)::type><<<blocks, kThreads, 0, st>>>(a);
                    });
}

void merge_finish(const MergeFinishArgs& a, void* stream) {
  launch_rows<false>("merge_finish launch", "outputs", a.batch * a.heads * a.seq, a.head_dim,
                     a.dtype, stream, [&](auto t, unsigned blocks, cudaStream_t st) {
                       finish_rows<typename decltype(t)::type><<<blocks, kThreads, 0, st>>>(a);
                     });
}

}  // namespace sdpa
