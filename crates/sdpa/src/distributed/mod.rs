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
//!
//! Processes meet through a TCP rendezvous on `MASTER_ADDR` authenticated by a shared token,
//! `SDPA_RING_TOKEN` (see [`RankEnv`]; a process without it cannot join the ring or take its
//! NCCL id).
//!
//! NVLink multicast (NVLS): the ring's point-to-point sends and its 16-byte agreement do not
//! use it, and on hosts whose GPUs are shared a program that sets it up can put them out of
//! service. NCCL takes the choice only from the environment (`NCCL_NVLS_ENABLE`, read once, at
//! the first communicator; `ncclConfig_t` has no field for it), and a library must not write
//! the environment while other threads may read it. So the library writes nothing: the NCCL
//! rings ([`Ring::from_env`], [`Ring::from_rank_env`], [`Ring::single_process`]) refuse with
//! `DistError::Env` while `NCCL_NVLS_ENABLE` is unset, and the program decides: the launcher
//! sets it (`NCCL_NVLS_ENABLE=0` to keep multicast off, 1 or 2 to let NCCL use it), or `main`
//! calls [`init_env`] before it starts threads, which sets 0 where unset. The loopback ring
//! needs no NCCL and no choice.

mod block;
mod error;
mod handshake;
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
pub use nccl::{init_env, nccl_version};
pub use problems::check_problem;
pub use rendezvous::{MAX_WORLD, MIN_TOKEN, RankEnv, RingAuth, RingToken, exchange_id};
pub use ring::{Ring, RingOptions, RingReport, Transport};
pub use shard::Shard;
pub use timeline::{HostTimings, RankTimings};
pub use zigzag::{Dims, Zigzag};
