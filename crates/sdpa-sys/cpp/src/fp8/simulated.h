// The simulated FP8 path (simulated.cu): E4M3 inputs on a fused kernel without FP8 math.
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

}  // namespace sdpa
