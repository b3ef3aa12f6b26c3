// Attention sinks (gpt-oss, FlashAttention-4's learnable_sink): one logit per query head that
// joins each row's softmax, its maximum, denominator and log-sum-exp, and weights no value. The
// sink is taken raw (natural-log units: no scale, softcap or ALiBi). A kernel folds it in once
// per row, after its last key tile (a split-KV kernel: in the combine, never per split).
#pragma once

#include <cuda_runtime.h>

namespace sdpa {

constexpr float kLog2e = 1.4426950408889634f;

// Folds the sink `sink` (natural log) into a finished row's softmax state in the log2 domain:
// m2 its largest logit (-inf where it saw no key), l = sum of 2^(x - m2). Afterwards they are
// the maximum and sum over the logits and the sink; the row's unnormalized accumulator must be
// multiplied by the returned factor (2^(old m2 - new m2)). A row that saw no key gets m2 = sink,
// l = 1 and factor 0: output 0, log-sum-exp the sink. -inf is no sink (factor 1, nothing
// changes). A NaN or +inf sink makes the row NaN: m2 NaN, l = 1 (so "l > 0" guards pass it
// through) and factor NaN.
__device__ __forceinline__ float fold_sink(float& m2, float& l, float sink) {
  if (sink == -INFINITY) return 1.f;
  if (!(sink < INFINITY)) {  // NaN or +inf
    m2 = __int_as_float(0x7fffffff);
    l = 1.f;
    return __int_as_float(0x7fffffff);
  }
  const float s2 = sink * kLog2e;
  const float m_new = fmaxf(m2, s2);  // finite
  const float alpha = exp2f(m2 - m_new);
  l = l * alpha + exp2f(s2 - m_new);
  m2 = m_new;
  return alpha;
}

}  // namespace sdpa
