//! What can go wrong between ranks, as values: every rank of a failed call returns one of these
//! (inside `Error::Distributed`) instead of hanging or aborting the process.

use std::time::Duration;

/// A failure of attention across GPUs or processes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// The NCCL library could not be opened. `searched` lists every path and name tried, in
    /// order, each with why it failed.
    #[error(
        "NCCL (libnccl.so.2) not found; install it (the PyPI package nvidia-nccl-cu13, or the \
         system's libnccl2) or point SDPA_NCCL_LIB at the library or its folder. Tried: {}",
        .searched.join("; ")
    )]
    NcclNotFound {
        /// Each candidate and why it could not be opened.
        searched: Vec<String>,
    },
    /// An NCCL call failed.
    #[error("{call} failed: {message} (ncclResult {code})")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// Its `ncclResult_t`.
        code: i32,
        /// NCCL's own description (`ncclGetErrorString`, and `ncclGetLastError` where it says
        /// more).
        message: String,
    },
    /// The rank's environment is missing or malformed (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`, as torchrun sets them; `SDPA_RING_TOKEN`), or the process's
    /// environment leaves a choice to the ring that it does not make (`NCCL_NVLS_ENABLE`).
    #[error("rank environment: {0}")]
    Env(String),
    /// The TCP exchange that hands rank 0's NCCL id to the other ranks failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A peer could not prove that it holds the ring's token (`SDPA_RING_TOKEN`): rank 0 refused
    /// this rank's greeting, or what answered as rank 0 is not authenticated.
    #[error("not authenticated: {0}")]
    Unauthenticated(String),
    /// The ranks disagree: a different world size, a rank given twice, or a different problem.
    #[error("ranks disagree: {0}")]
    Mismatch(String),
    /// Another rank did not answer in time (it died, hangs, or was never started). The NCCL
    /// communicators of this process were aborted, so no kernel of this call is left waiting.
    #[error("{what}: no answer within {after:?}; the communicator was aborted")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The limit that ran out.
        after: Duration,
    },
    /// The communicator was aborted by an earlier failure and cannot run more calls; make a
    /// new `Ring`.
    #[error("the ring's communicator was aborted after an earlier failure ({0})")]
    Aborted(String),
}
