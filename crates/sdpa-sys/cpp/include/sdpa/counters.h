// The device counters a stream lends the fused kernels (FwdArgs::tile_counter): how many int32
// the Rust layer allocates for them (sdpa_sys::tile_counters(), from this constant), zero
// between calls. The cutlass-sm90 masked kernels hand out their work tiles with the first two;
// the decode kernel's row blocks count their finished splits with one each, up to this many a
// launch.
#pragma once

#include <cstdint>

namespace sdpa {
constexpr int64_t kTileCounters = 1024;
}  // namespace sdpa
