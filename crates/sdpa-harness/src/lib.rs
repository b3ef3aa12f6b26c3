//! The harness around the `sdpa` library: what the `sdpa` CLI, the integration tests and the
//! benches use to check and measure it, kept out of the library so that its crate root is the
//! user API only.
//!
//! - [`check`]: accuracy checks against the float64 reference (output poisoned with NaN, the
//!   tolerances every backend is held to, per dtype and FP8 mode).
//! - [`grad`]: the backward's checks against the float64 reference gradient.
//! - [`inputs`]: fresh random inputs from a seed, and the input distributions the fast FP8
//!   mode's bars are stated for.
//! - [`timing`]: GPU timing with CUDA events and graphs, warm-up first, medians.
//! - [`info`]: what this build compiled (the ptxas report, the driver's kernel attributes).
//! - [`problems`]: the named problems the CLI, benches and PyTorch anchors share.
//! - [`seqs`]: the metadata of packed (varlen) and paged-cache batches.
//!
//! Everything here goes through the public API of `sdpa` (and `sdpa_sys` for what the core
//! reports about its build).
//!
//! ```
//! use sdpa::Backend;
//! use sdpa_harness::{check, inputs, problems};
//!
//! let p = problems::named_problem("mission")?;
//! let report = check::check_backend(None, &p, Backend::Cpu, inputs::fresh_seed())?;
//! assert!(report.pass(), "{report:?}");
//! # Ok::<(), sdpa::Error>(())
//! ```

#![warn(missing_docs)]

pub mod check;
pub mod grad;
pub mod info;
pub mod inputs;
pub mod problems;
pub mod seqs;
pub mod timing;

pub use problems::{NAMED_PROBLEMS, named_meta, named_problem};

/// The README's Rust examples, compiled (and, where they need no GPU, run) as doctests of this
/// crate, whose dev-dependencies see every name they use: a snippet that stops compiling fails
/// `cargo test`.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
