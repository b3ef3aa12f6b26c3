//! How `Backend::Auto` chooses: by measurement. `sdpa bench --json` times every backend;
//! `sdpa autotable` turns those records into `table.rs` (checked in), one row per
//! (compute capability, dtype, head_dim, causal, size class, FP8 mode) with the backends fastest
//! first.

mod row;
mod table;

pub use row::{Row, SizeClass};

use super::Backend;
use crate::problem::Problem;

/// The measured table (crates/sdpa/src/backend/auto/table.rs).
pub fn table() -> &'static [Row] {
    table::TABLE
}

/// Order used when no measured row matches: tensor-core paths first.
pub const FALLBACK: [Backend; 5] = [
    Backend::Cutlass,
    Backend::CutlassSm80,
    Backend::Wmma,
    Backend::Cublas,
    Backend::Scalar,
];

/// Every backend in the order `Auto` tries them for `p` on `sm`: [`order`], then the backends
/// the table has not measured yet (added since it was made).
pub(crate) fn candidates(sm: Option<u32>, p: &Problem) -> impl Iterator<Item = Backend> {
    let measured = order(sm, p);
    let unmeasured = FALLBACK.into_iter().filter(move |b| !measured.contains(b));
    measured.iter().copied().chain(unmeasured)
}

/// The candidate order for `p` on a device of compute capability `sm`: the exact measured row,
/// else a row measured on another device for the same kind of problem, else `FALLBACK`.
pub fn order(sm: Option<u32>, p: &Problem) -> &'static [Backend] {
    let size = SizeClass::of(p);
    let same = |r: &&Row| {
        r.dtype == p.dtype
            && r.head_dim == p.head_dim
            && r.causal == p.is_causal()
            && r.size == size
            && r.fp8_mode == p.fp8_mode
    };
    let rows = table::TABLE;
    rows.iter()
        .filter(same)
        .find(|r| Some(r.sm) == sm)
        .or_else(|| rows.iter().find(same))
        .map_or(&FALLBACK, |r| r.order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::DType;

    #[test]
    fn size_classes_split_the_named_problems() {
        // mission, s1k-d64, s2k-d128 of the named problems.
        let class = |b, h, s, d| SizeClass::of(&Problem::new(b, h, s, s, d));
        assert_eq!(class(2, 8, 256, 64), SizeClass::Small);
        assert_eq!(class(4, 16, 1024, 64), SizeClass::Medium);
        assert_eq!(class(4, 16, 2048, 128), SizeClass::Large);
    }

    #[test]
    fn every_table_row_lists_each_gpu_backend_once() {
        for r in super::table::TABLE {
            let mut seen: Vec<_> = r.order.to_vec();
            seen.sort_by_key(|b| b.name());
            seen.dedup();
            assert_eq!(seen.len(), r.order.len(), "{r:?}");
            assert!(r.order.iter().all(|b| Backend::GPU.contains(b)), "{r:?}");
        }
    }

    #[test]
    fn fast_fp8_rows_are_e4m3_rows() {
        for r in super::table::TABLE {
            let p = Problem::new(1, 1, 8, 8, r.head_dim)
                .with_dtype(r.dtype)
                .with_fp8_mode(r.fp8_mode);
            assert!(p.validate().is_ok(), "{r:?}");
        }
    }

    #[test]
    fn unknown_devices_fall_back_to_a_measured_row_then_the_default() {
        let p = Problem::new(2, 8, 256, 256, 64);
        let measured = order(Some(90), &p);
        assert_eq!(order(Some(1), &p), measured);
        let odd = Problem::new(1, 1, 8, 8, 128)
            .with_dtype(DType::Bf16)
            .with_causal(true);
        assert!(!order(None, &odd).is_empty());
    }
}
