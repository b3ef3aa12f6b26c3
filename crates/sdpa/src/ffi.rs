//! The crate's side of the C++ boundary: how its types cross into `sdpa_sys::ffi` (the one cxx
//! bridge). Everything that calls into the core goes through sdpa-sys; this module only says
//! how values are spelled there.

use crate::problem::{DType, Mask};
use sdpa_sys::args::Dtype;

/// The core's spelling of an element type.
pub(crate) fn dtype(d: DType) -> Dtype {
    match d {
        DType::F16 => Dtype::F16,
        DType::Bf16 => Dtype::BF16,
        DType::E4m3 => Dtype::E4M3,
        DType::F32 => Dtype::F32,
    }
}

/// The core's spelling of a mask (in its canonical form): its kind, window sides (-1:
/// unbounded, and for masks without a window) and chunk (0 for masks without chunks).
pub(crate) fn mask(m: Mask) -> sdpa_sys::args::FwdMask {
    use sdpa_sys::args::{FwdMask, Mask as M};
    let side = |x: Option<usize>| x.map_or(-1, |n| n.min(i64::MAX as usize) as i64);
    let (kind, window_left, window_right, chunk) = match m.canonical() {
        Mask::None => (M::NoMask, -1, -1, 0),
        Mask::CausalBottomRight => (M::CausalBottomRight, -1, -1, 0),
        Mask::CausalTopLeft => (M::CausalTopLeft, -1, -1, 0),
        Mask::Window { left, right } => (M::Window, side(left), side(right), 0),
        Mask::Chunked { size } => (M::Chunked, -1, -1, size.min(i64::MAX as usize) as i64),
    };
    FwdMask {
        kind,
        window_left,
        window_right,
        chunk,
    }
}
