//! What the cuBLAS backend keeps per stream: held by each `Device`, used only by this backend.

use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaSlice;

/// The cuBLAS handle and the workspace (S, P, causal: V's finite copy) of one `Device` (one
/// stream), reused across calls and grown when a larger problem arrives.
pub(crate) struct BlasState {
    pub(crate) blas: CudaBlas,
    pub(crate) workspace: Option<CudaSlice<u8>>,
}
