// What the general path of a kernel (mask::needs_band) does to each raw score Q·Kᵀ before its
// mask: the softcap cap · tanh(x / cap) of the scaled score x, then ALiBi's -slope · |distance|
// of the key from the row's diagonal key, in the log2 domain the softmax works in.
#pragma once

#include <cuda_runtime.h>

namespace sdpa {

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A kernel's score mods for one (batch, head). With `on` the kernel turns raw scores into
// log2-domain logits (or, with a softcap alone, into tanh values the softmax then scales by
// cap2); otherwise the scores stay raw and the softmax scales them as usual.
struct ScoreMods {
  bool on;
  float sl2;           // the softmax scale in the log2 domain
  float cap2;          // softcap · log2 e; 0: no softcap
  bool alibi;          // whether the call has ALiBi (a head's slope may still be 0)
  float slope2;        // ALiBi slope · log2 e
  int alibi_diagonal;  // seq_k - seq_q: ALiBi distances are from row i's key i + this

  // Applies the mods (when on) to a tile of raw scores of the rows from m0 and the keys from n0:
  // Tile as a mask's apply takes it (mask.cuh), with x(i) the tile's i-th of kSize scores (any
  // order) besides.
  template <class Tile>
  __device__ __forceinline__ void apply(const Tile& t, int m0, int n0) const {
    if (on) {
      if (cap2 > 0.f) {
        const float in = sl2 / cap2;
        // With ALiBi the bias comes after the cap: the logits themselves; else tanh alone (the
        // softmax then scales by the cap).
        if (alibi) {
#pragma unroll
          for (int i = 0; i < Tile::kSize; ++i) t.x(i) = cap2 * tanh_approx(t.x(i) * in);
        } else {
#pragma unroll
          for (int i = 0; i < Tile::kSize; ++i) t.x(i) = tanh_approx(t.x(i) * in);
        }
      } else {
#pragma unroll
        for (int i = 0; i < Tile::kSize; ++i) t.x(i) *= sl2;
      }
      if (slope2 != 0.f) {
#pragma unroll
        for (int r = 0; r < Tile::kRows; ++r) {
          const int d0 = m0 + t.row(r) + alibi_diagonal - n0;  // distance at col 0
#pragma unroll
          for (int c = 0; c < Tile::kCols; ++c)
            t.x(r, c) -= slope2 * fabsf(float(d0 - t.col(r, c)));
        }
      }
    }
  }
};

// The log2-domain logit of raw score s (mods.on) of row `row` and key `key`.
__device__ __forceinline__ float modded_logit(const ScoreMods& mods, float s, int row, int key) {
  const float x =
      mods.cap2 > 0.f ? mods.cap2 * tanh_approx(s * (mods.sl2 / mods.cap2)) : s * mods.sl2;
  return x - mods.slope2 * fabsf(float(row + mods.alibi_diagonal - key));
}

}  // namespace sdpa
