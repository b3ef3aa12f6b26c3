//! Attention beyond one GPU: context-parallel ("ring") attention over NCCL, for sequences too
//! long for one GPU's memory or time.
//!
//! The sequence is split over the ranks of a ring in zigzag order ([`Zigzag`]: rank `r` holds
//! chunks `r` and `2·world − 1 − r` of `2·world`, which balances causal work). Each rank keeps
//! its shard of Q and of the output; the K/V shards travel the ring by NCCL send/receive on a
//! stream of their own, overlapped with attention to the shard held ([`schedule`] says which
//! query rows see which keys at each step), and the partial results are merged through their
//! log-sum-exp. The output and the global log-sum-exp stay sharded like Q.
//!
//! Three ways to make a [`Ring`]: one process per GPU from torchrun's environment
//! ([`Ring::from_env`]), one process driving several GPUs ([`Ring::single_process`]), or
//! virtual ranks on one GPU without NCCL ([`Ring::loopback`]). NCCL is opened at run time
//! (`libnccl.so.2`: the PyPI package `nvidia-nccl-cu13`, the system's, or `SDPA_NCCL_LIB`);
//! without it the NCCL forms return `DistError::NcclNotFound` naming where they looked.
//! A rank that dies, hangs, or was called with another problem ends every rank's call with a
//! [`DistError`] within `RingOptions::timeout`; the communicators are aborted then.

mod block;
mod error;
mod host;
mod merge;
mod nccl;
mod problems;
mod rendezvous;
mod ring;
pub mod schedule;
mod shard;
mod timeline;
mod workspace;
mod zigzag;

pub use error::DistError;
pub use host::{HostShards, forward_host, kv_dims, lse_dims, q_dims};
pub use nccl::nccl_version;
pub use problems::check_problem;
pub use rendezvous::{RankEnv, exchange_id};
pub use ring::{Ring, RingOptions, RingReport, Transport};
pub use shard::Shard;
pub use timeline::{HostTimings, RankTimings};
pub use zigzag::{Dims, Zigzag};
