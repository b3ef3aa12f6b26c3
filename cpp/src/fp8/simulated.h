// The simulated FP8 path (simulated.cu): E4M3 inputs on a fused kernel without FP8 math.
#pragma once

#include <cstdint>

#include "sdpa/sdpa.h"

namespace sdpa {

// Workspace bytes for the 16-bit copies of Q, K and V.
int64_t simulated_workspace_bytes(const FwdArgs& a);

// Dequantizes Q, K, V (a.ops.dtype E4M3, with scales) into a.scratch.workspace as a.out.dtype, then
// runs `kernel`'s 16-bit instantiation on the copies, all on `stream` of the device `dev`
// describes.
void simulated_forward(Kernel kernel, const FwdArgs& a, const DeviceInfo& dev, void* stream);

}  // namespace sdpa
