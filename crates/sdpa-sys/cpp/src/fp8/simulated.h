// The simulated FP8 path (simulated.cu): E4M3 inputs on a fused kernel without FP8 math; and an
// e4m3 K/V cache widened to 16-bit copies for the kernels that do not read its codes.
#pragma once

#include <cstdint>

#include "sdpa/sdpa.h"

namespace sdpa {

// Workspace bytes for the 16-bit copies of Q, K and V.
int64_t simulated_workspace_bytes(const FwdArgs& a);

// Enqueues on `stream` the dequantization of Q, K, V (a.ops.dtype E4M3, with scales) into
// a.scratch.workspace as a.out.dtype, and returns the arguments of the 16-bit kernel that runs
// on the copies (after it, on the same stream).
FwdArgs simulated_inputs(const FwdArgs& a, void* stream);

// Workspace bytes for the 16-bit copies of an e4m3 K/V cache (16-bit Q).
int64_t widened_kv_bytes(const FwdArgs& a);

// Enqueues on `stream` the dequantization of an e4m3 K/V cache into a.scratch.workspace as Q's
// dtype, and returns the arguments of the 16-bit problem on the copies, its workspace the rest
// of a's.
FwdArgs widened_kv(const FwdArgs& a, void* stream);

}  // namespace sdpa
