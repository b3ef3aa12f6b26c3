//! How `Backend::Auto` chooses: by measurement. `sdpa bench --json` times every backend;
//! `sdpa autotable` turns those records into `auto_table.rs` (checked in), one row per
//! (compute capability, dtype, head_dim, causal, size class) with the backends fastest first.

use super::Backend;
use crate::problem::{DType, Problem};

/// Problem size by the number of attention scores, B·H·Sq·Sk: small problems are decided by
/// launch and latency, large ones by throughput, and the winners differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SizeClass {
    /// At most 2^22 scores (the mission problem has 2^20).
    Small,
    /// At most 2^27 scores (s1k-d64 has 2^26).
    Medium,
    /// More (s2k-d128 has 2^28).
    Large,
}

impl SizeClass {
    /// The class of a problem.
    pub fn of(p: &Problem) -> SizeClass {
        let scores = p.batch as f64 * p.heads as f64 * p.seq_q as f64 * p.seq_k as f64;
        if scores <= (1u64 << 22) as f64 {
            SizeClass::Small
        } else if scores <= (1u64 << 27) as f64 {
            SizeClass::Medium
        } else {
            SizeClass::Large
        }
    }
}

/// One measured row: on `sm` (e.g. 90), for problems of this kind, try backends in `order`.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// Compute capability as major*10 + minor.
    pub sm: u32,
    /// Element type.
    pub dtype: DType,
    /// Head dimension.
    pub head_dim: usize,
    /// Causal mask.
    pub causal: bool,
    /// Size class.
    pub size: SizeClass,
    /// Backends, fastest first (measured us_graph).
    pub order: &'static [Backend],
}

/// The measured table (crates/sdpa/src/backend/auto_table.rs).
pub fn table() -> &'static [Row] {
    super::auto_table::TABLE
}

/// Order used when no measured row matches: tensor-core paths first.
pub const FALLBACK: [Backend; 5] = [
    Backend::Cutlass,
    Backend::CutlassSm80,
    Backend::Wmma,
    Backend::Cublas,
    Backend::Scalar,
];

/// The candidate order for `p` on a device of compute capability `sm`: the exact measured row,
/// else a row measured on another device for the same kind of problem, else `FALLBACK`.
pub fn order(sm: Option<u32>, p: &Problem) -> &'static [Backend] {
    let size = SizeClass::of(p);
    let same = |r: &&Row| {
        r.dtype == p.dtype && r.head_dim == p.head_dim && r.causal == p.causal && r.size == size
    };
    let rows = super::auto_table::TABLE;
    rows.iter()
        .filter(same)
        .find(|r| Some(r.sm) == sm)
        .or_else(|| rows.iter().find(same))
        .map_or(&FALLBACK, |r| r.order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_split_the_named_problems() {
        let class = |n| SizeClass::of(&crate::named_problem(n).unwrap());
        assert_eq!(class("mission"), SizeClass::Small);
        assert_eq!(class("s1k-d64"), SizeClass::Medium);
        assert_eq!(class("s2k-d128"), SizeClass::Large);
    }

    #[test]
    fn every_table_row_lists_each_gpu_backend_once() {
        for r in super::super::auto_table::TABLE {
            let mut seen: Vec<_> = r.order.to_vec();
            seen.sort_by_key(|b| b.name());
            seen.dedup();
            assert_eq!(seen.len(), r.order.len(), "{r:?}");
            assert!(r.order.iter().all(|b| Backend::GPU.contains(b)), "{r:?}");
        }
    }

    #[test]
    fn unknown_devices_fall_back_to_a_measured_row_then_the_default() {
        let p = crate::named_problem("mission").unwrap();
        let measured = order(Some(90), &p);
        assert_eq!(order(Some(1), &p), measured);
        let odd = Problem::new(1, 1, 8, 8, 128)
            .with_dtype(DType::Bf16)
            .with_causal(true);
        assert!(!order(None, &odd).is_empty());
    }
}
