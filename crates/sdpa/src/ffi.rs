//! The crate's side of the C++ boundary: how its types cross into `sdpa_sys::ffi` (the one cxx
//! bridge). Everything that calls into the core goes through sdpa-sys; this module only says
//! how values are spelled there.

use crate::problem::{DType, Mask};
use sdpa_sys::ffi::Dtype;

/// The core's spelling of an element type.
pub(crate) fn dtype(d: DType) -> Dtype {
    match d {
        DType::F16 => Dtype::F16,
        DType::Bf16 => Dtype::BF16,
        DType::E4m3 => Dtype::E4M3,
    }
}

/// The core's spelling of a mask.
pub(crate) fn mask(m: Mask) -> sdpa_sys::ffi::Mask {
    match m {
        Mask::None => sdpa_sys::ffi::Mask::NoMask,
        Mask::CausalBottomRight => sdpa_sys::ffi::Mask::CausalBottomRight,
    }
}
