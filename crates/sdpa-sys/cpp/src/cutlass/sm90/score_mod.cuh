// What the sm_90a kernel does to raw scores before the mask: a policy the consumers ask.
// NoScoreMod: nothing (the softmax scales the raw scores). CapAlibiMod: softcap and ALiBi as the
// call asks for them at run time (common/score_mods.cuh), either possibly off.
#pragma once

#include "common/score_mods.cuh"
#include "cutlass/sm90/tile_scheduler.cuh"

namespace sdpa::cutlass_sm90 {

struct NoScoreMod {
  // Whether the call has mods.
  template <class P>
  __device__ __forceinline__ static bool on(const P& /*p*/) {
    return false;
  }
  // Work tile w's mods, for a sequence of seq_k - seq_q = diagonal and softmax scale sl2.
  template <class P>
  __device__ __forceinline__ static NoScoreMod of(const P& /*p*/, const WorkTile& /*w*/,
                                                  int /*diagonal*/, float /*sl2*/) {
    return {};
  }
  // The scale the softmax steps take.
  template <class P>
  __device__ __forceinline__ static float step_scale(const P& /*p*/, float sl2) {
    return sl2;
  }
  // The mods applied to a tile of scores of the rows from m0 and the keys from n0.
  template <class Tile>
  __device__ __forceinline__ void apply(const Tile& /*t*/, int /*m0*/, int /*n0*/) const {}
};

struct CapAlibiMod {
  ScoreMods m;

  // Whether the call asks for softcap or ALiBi.
  template <class P>
  __device__ __forceinline__ static bool on(const P& p) {
    return p.cap2 > 0.f || p.alibi != nullptr;
  }

  // The slope of w's (batch, head). Made where used, from the parameters (constant memory),
  // rather than held in registers across the main loop.
  template <class P>
  __device__ __forceinline__ static CapAlibiMod of(const P& p, const WorkTile& w, int diagonal,
                                                   float sl2) {
    ScoreMods m{false, sl2, 0.f, false, 0.f, diagonal};
    m.cap2 = p.cap2;
    m.alibi = p.alibi != nullptr;
    if (m.alibi) m.slope2 = __ldg(p.alibi + w.b * p.alibi_bstride + w.h) * 1.4426950408889634f;
    m.on = m.cap2 > 0.f || m.alibi;
    return {m};
  }
  // 1 where the mods turn the scores into log2-domain logits (ALiBi), the cap where they turn
  // them into tanh values (softcap alone), else the softmax scale.
  template <class P>
  __device__ __forceinline__ static float step_scale(const P& p, float sl2) {
    return p.alibi != nullptr ? 1.f : p.cap2 > 0.f ? p.cap2 : sl2;
  }
  template <class Tile>
  __device__ __forceinline__ void apply(const Tile& t, int m0, int n0) const {
    m.apply(t, m0, n0);
  }
};

}  // namespace sdpa::cutlass_sm90
