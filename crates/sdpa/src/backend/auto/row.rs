//! The row type of the measured table: which kind of problem, on which GPU, and the backends
//! in the order they were measured fastest.

use crate::backend::Backend;
use crate::problem::{DType, Fp8Mode, Problem};

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
    /// How the row's e4m3 problems compute P·V (the fast mode changes only the backends with an
    /// e4m3 P·V, so it is timed and ranked on its own); `Accurate` for f16/bf16 rows.
    pub fp8_mode: Fp8Mode,
    /// Backends, fastest first (measured us_graph).
    pub order: &'static [Backend],
}
