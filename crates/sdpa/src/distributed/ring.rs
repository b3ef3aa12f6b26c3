//! Ring attention: each rank keeps its zigzag shard of Q and its output; the K/V shards travel
//! the ring, one hop a step, while each rank attends its queries to the shard it holds.
//!
//! Per rank two streams on its GPU: the compute stream (the rank's `Device`: attention calls,
//! merges) and the communication stream (NCCL's sends and receives). At step `t` the rank
//! attends to the shard received at step `t − 1` while sending that same shard on and
//! receiving the next into the other of two buffers; the streams meet only where a buffer
//! changes hands (the compute stream waits for the receive it is about to read; the
//! communication stream waits for the step that last read the buffer it receives into).
//! Each step's partial output and log-sum-exp fold into an f32 accumulator (`merge`), written
//! to the caller's output once at the end. The buffers for all of it stay with the ring from
//! call to call (`workspace`).
//!
//! A `Ring` drives the ranks of this process: one (a process per GPU, torchrun style, from the
//! environment), all of them (one process, several GPUs: `Ring::single_process`), or `world`
//! virtual ranks on one GPU that hand K/V over by device copies (`Ring::loopback`: the same
//! schedule, buffers and stream ordering without NCCL, for tests and single-GPU runs).

use super::block::{Scratch, attend};
use super::error::DistError;
use super::merge::Accumulator;
use super::nccl::{Comm, Deadline, Nccl, library, nvls_chosen};
use super::problems::{
    block_problem, check_problem, check_shard, fingerprint, fnv1a, local_problem,
};
use super::rendezvous::{MAX_WORLD, RankEnv, exchange_id};
use super::schedule;
use super::shard::Shard;
use super::timeline::{HostClock, HostPhase, HostTimings, Phase, RankTimings, Timeline};
use super::workspace::{RankBuffers, Sizes};
use super::zigzag::Zigzag;
use crate::backend::Backend;
use crate::device::Device;
use crate::error::{Result, invalid};
use crate::problem::{DType, Problem};
use crate::tensor::Element;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use std::mem::size_of;
use std::sync::Arc;
use std::time::Duration;

/// How a ring waits and computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOptions {
    /// How long any wait for another rank may take (the rendezvous, NCCL setup, one call)
    /// before every communicator of this process is aborted and the call fails with
    /// `DistError::Timeout`. `Duration::MAX` (or any limit past what `Instant` holds): no
    /// limit.
    pub timeout: Duration,
    /// The backend of each local attention call.
    pub backend: Backend,
    /// Whether each call measures where every local rank's compute stream spends its time
    /// ([`RingReport::timings`]: a few timing events a step) and where the host thread does
    /// ([`RingReport::host`]).
    pub timings: bool,
}

impl Default for RingOptions {
    /// Five minutes (a first call at hundreds of thousands of positions includes NCCL's
    /// connection setup); `Backend::Auto`; no timings.
    fn default() -> Self {
        RingOptions {
            timeout: Duration::from_secs(300),
            backend: Backend::Auto,
            timings: false,
        }
    }
}

/// How the K/V shards travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// NCCL send/receive between GPUs (and processes, and nodes).
    Nccl,
    /// Device copies between virtual ranks on one GPU.
    Loopback,
}

/// What one [`Ring::forward`] did, so callers (and tests) can see the ring ran.
#[derive(Debug, Clone, PartialEq)]
pub struct RingReport {
    /// How the shards travelled.
    pub transport: Transport,
    /// Ranks in the ring.
    pub world: usize,
    /// Steps each rank ran (one per K/V shard it attended to: `world`).
    pub steps: usize,
    /// K/V hand-overs each rank made (`world − 1`).
    pub exchanges: usize,
    /// K and V bytes each rank sent.
    pub bytes_sent: usize,
    /// Attention calls made by the ranks of this process, all steps.
    pub calls: usize,
    /// Device memory the call used on each rank beyond the caller's shards (the two K/V shards
    /// in flight, one call's partial result, the f32 running result): O(sequence / ranks), like
    /// the shards. The most of any local rank. The ring keeps it for its next calls (grown when
    /// one needs more), until it is dropped or [`Ring::release_buffers`] is called.
    pub workspace_bytes: usize,
    /// Whether every local rank's attention calls wrote their partial results in f32 (cutlass on
    /// sm90), so that the output is rounded once, as on one GPU; otherwise (another backend or
    /// GPU) a rank's partial results are rounded to the problem's dtype, one rounding more each.
    pub f32_partials: bool,
    /// Where each local rank's compute stream spent the call, where `RingOptions::timings` asks
    /// (else empty).
    pub timings: Vec<RankTimings>,
    /// Where this process's host thread spent the call, where `RingOptions::timings` asks.
    pub host: Option<HostTimings>,
}

/// A rank this process drives.
struct LocalRank {
    rank: usize,
    /// The compute stream.
    dev: Device,
    comm_stream: Arc<CudaStream>,
    /// `None` for loopback.
    comm: Option<Comm>,
}

/// The ranks of this process in one ring, and how they talk.
///
/// A causal problem over two virtual ranks on one GPU ([`Ring::loopback`]); the NCCL rings
/// take the same shards, one per GPU this process drives:
///
/// ```no_run
/// use half::bf16;
/// use sdpa::distributed::{Ring, RingOptions, Shard, Zigzag};
/// use sdpa::{DType, Device, Problem};
/// # fn main() -> sdpa::Result<()> {
/// let dev = Device::new(0)?;
/// let mut ring = Ring::loopback(&dev, 2, RingOptions::default())?;
/// let p = Problem::new(1, 8, 4096, 4096, 128).with_causal(true).with_dtype(DType::Bf16);
/// let z = Zigzag::new(p.seq_q, ring.world())?; // each rank holds 2 chunks of 1024 positions
/// let n = 8 * z.local_len() * 128;
/// // Each rank's Q, K, V and output shards, on its device.
/// let mut bufs = Vec::new();
/// for (_rank, d) in ring.local_ranks() {
///     let s = d.stream();
///     bufs.push([s.alloc_zeros::<bf16>(n)?, s.alloc_zeros(n)?, s.alloc_zeros(n)?, s.alloc_zeros(n)?]);
/// }
/// let mut shards: Vec<_> = bufs
///     .iter_mut()
///     .map(|[q, k, v, out]| Shard {
///         q: q.as_view(),
///         k: k.as_view(),
///         v: v.as_view(),
///         out: out.as_view_mut(),
///         lse: None,
///     })
///     .collect();
/// let report = ring.forward(&p, &mut shards)?;
/// assert_eq!(report.steps, 2);
/// # Ok(())
/// # }
/// ```
pub struct Ring {
    world: usize,
    ranks: Vec<LocalRank>,
    transport: Transport,
    nccl: Option<&'static Nccl>,
    opts: RingOptions,
    /// The local ranks' device memory for calls, kept between them (`workspace`).
    buffers: Vec<RankBuffers>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("world", &self.world)
            .field(
                "ranks",
                &self.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
            )
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// This process as one rank of a ring of processes, from the torchrun environment
    /// ([`RankEnv::from_env`], `SDPA_RING_TOKEN` included): opens GPU `LOCAL_RANK`, meets the
    /// other ranks (rank 0 hands out the NCCL id over an authenticated TCP exchange) and starts
    /// the communicator. Every rank must call this. `NCCL_NVLS_ENABLE` must be set (see the
    /// module).
    pub fn from_env(opts: RingOptions) -> Result<Ring> {
        let env = RankEnv::from_env()?;
        let dev = Device::new(env.local_rank)?;
        Ring::from_rank_env(&env, dev, opts)
    }

    /// As [`Ring::from_env`] with the rank's environment and device given.
    pub fn from_rank_env(env: &RankEnv, dev: Device, opts: RingOptions) -> Result<Ring> {
        nvls_chosen(&|k| std::env::var_os(k))?;
        let nccl = library()?;
        // What every rank must agree on before NCCL is started: the ring's size and this
        // crate's version (the wire protocol of the calls that follow).
        let fp = fnv1a(format!("{} {}", env.world, env!("CARGO_PKG_VERSION")).as_bytes());
        let id = exchange_id(env, fp, opts.timeout, || nccl.unique_id())?;
        let deadline = Deadline::after(opts.timeout);
        dev.ctx().bind_to_thread()?;
        let comm = Comm::start(nccl, &id, env.rank, env.world)?;
        let mut ranks = vec![LocalRank {
            rank: env.rank,
            comm_stream: dev.ctx().new_stream()?,
            dev,
            comm: Some(comm),
        }];
        wait_all(&mut ranks, "NCCL communicator setup", deadline)?;
        Ok(Ring {
            world: env.world,
            ranks,
            transport: Transport::Nccl,
            nccl: Some(nccl),
            opts,
            buffers: Vec::new(),
        })
    }

    /// One process driving a ring over `devices` (rank i on `devices[i]`, each a different
    /// GPU: NCCL refuses two ranks on one GPU), over NCCL.
    pub fn single_process(devices: Vec<Device>, opts: RingOptions) -> Result<Ring> {
        if devices.is_empty() {
            return Err(invalid!("a ring needs at least one device"));
        }
        let world = devices.len();
        nvls_chosen(&|k| std::env::var_os(k))?;
        let nccl = library()?;
        let id = nccl.unique_id()?;
        let deadline = Deadline::after(opts.timeout);
        let mut ranks = devices
            .into_iter()
            .enumerate()
            .map(|(rank, dev)| {
                Ok(LocalRank {
                    rank,
                    comm_stream: dev.ctx().new_stream()?,
                    dev,
                    comm: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let started = nccl.group(|| {
            for r in ranks.iter_mut() {
                bind(&r.dev)?;
                r.comm = Some(Comm::start(nccl, &id, r.rank, world)?);
            }
            Ok(())
        });
        if let Err(e) = started {
            abort_all(&mut ranks, &e.to_string());
            return Err(e.into());
        }
        wait_all(&mut ranks, "NCCL communicator setup", deadline)?;
        Ok(Ring {
            world,
            ranks,
            transport: Transport::Nccl,
            nccl: Some(nccl),
            opts,
            buffers: Vec::new(),
        })
    }

    /// `world` virtual ranks on `dev`'s GPU, each with its own compute stream, handing K/V on
    /// by device copies on one shared stream. No NCCL: the schedule, the buffers, the stream
    /// ordering and the merge of a ring on one GPU.
    pub fn loopback(dev: &Device, world: usize, opts: RingOptions) -> Result<Ring> {
        if world == 0 || world > MAX_WORLD {
            return Err(invalid!("a ring has 1 to {MAX_WORLD} ranks, not {world}"));
        }
        let comm_stream = dev.ctx().new_stream()?;
        let ranks = (0..world)
            .map(|rank| {
                Ok(LocalRank {
                    rank,
                    dev: dev.fork()?,
                    comm_stream: comm_stream.clone(),
                    comm: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Ring {
            world,
            ranks,
            transport: Transport::Loopback,
            nccl: None,
            opts,
            buffers: Vec::new(),
        })
    }

    /// Ranks in the ring.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Frees the device memory the ring keeps between calls ([`RingReport::workspace_bytes`]);
    /// the next call allocates it again.
    pub fn release_buffers(&mut self) {
        self.buffers.clear();
    }
    /// How the K/V shards travel.
    pub fn transport(&self) -> Transport {
        self.transport
    }
    /// The ranks this process drives, in the order [`Ring::forward`] takes their shards, with
    /// the device (GPU and compute stream) of each: allocate its shards there.
    pub fn local_ranks(&self) -> impl Iterator<Item = (usize, &Device)> {
        self.ranks.iter().map(|r| (r.rank, &r.dev))
    }

    /// Attention of the sequence `p` describes, sharded over the ring: `shards[i]` is the
    /// shard of the i-th rank of [`Ring::local_ranks`]. Returns once every local rank's output
    /// (and log-sum-exp) is written, or with an error on every rank of the ring (a rank that
    /// fails or does not answer within the timeout aborts the communicators).
    ///
    /// `p` is the whole problem, equal on every rank (checked: a rank with another problem
    /// fails all of them with `DistError::Mismatch`): seq_q == seq_k, a multiple of
    /// 2 × world; no mask or causal; f16 or bf16; GQA and softcap as the single-GPU call.
    /// `p.lse` says whether the shards carry a log-sum-exp buffer.
    pub fn forward<T: Element>(
        &mut self,
        p: &Problem,
        shards: &mut [Shard<'_, T>],
    ) -> Result<RingReport> {
        let mut clock = self.opts.timings.then(HostClock::start);
        let z = check_problem(p, self.world)?;
        if T::DTYPE != p.dtype {
            return Err(invalid!(
                "the shards are {}, the problem says {}",
                T::DTYPE,
                p.dtype
            ));
        }
        if shards.len() != self.ranks.len() {
            return Err(invalid!(
                "{} shards for the {} rank(s) this process drives",
                shards.len(),
                self.ranks.len()
            ));
        }
        for r in &self.ranks {
            if let Some(c) = &r.comm {
                c.live()?;
            }
        }
        let local = local_problem(p, &z);
        for (r, s) in self.ranks.iter().zip(shards.iter()) {
            check_shard(r.rank, &r.dev, s, &local, p.lse)?;
        }
        HostClock::mark(&mut clock, HostPhase::Checks);
        let deadline = Deadline::after(self.opts.timeout);
        if self.transport == Transport::Nccl {
            self.agree(fingerprint(p, self.world), deadline)?;
        }
        HostClock::mark(&mut clock, HostPhase::Agree);
        // Ordered after the work queued on the shards' own streams, and theirs after the call
        // (also after a failed one: part of it may be queued).
        let orders = self
            .ranks
            .iter()
            .zip(shards.iter())
            .map(|(r, s)| {
                let mut streams = vec![s.q.stream(), s.k.stream(), s.v.stream(), s.out.stream()];
                streams.extend(s.lse.as_ref().map(|l| l.stream()));
                r.dev.order_after(streams)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut buffers = std::mem::take(&mut self.buffers);
        buffers.resize_with(self.ranks.len(), RankBuffers::default);
        let result = self.run(p, &z, &local, shards, (deadline, &mut clock), &mut buffers);
        self.buffers = buffers;
        if let Err(e) = &result {
            abort_all(&mut self.ranks, &e.to_string());
        }
        for o in orders {
            o.finish(Ok(()))?;
        }
        result
    }

    /// Every rank checks that all have the same problem: an all-reduce (max) of the
    /// fingerprint and of its complement equals both only where every rank's is the same.
    fn agree(&mut self, fp: u64, deadline: Deadline) -> Result<()> {
        let nccl = self.nccl.expect("NCCL rings have the library");
        let bufs = self
            .ranks
            .iter()
            .map(|r| Ok(r.comm_stream.clone_htod(&[fp, !fp])?))
            .collect::<Result<Vec<CudaSlice<u64>>>>()?;
        let ptrs: Vec<u64> = bufs
            .iter()
            .zip(&self.ranks)
            .map(|(b, r)| b.device_ptr(&r.comm_stream).0)
            .collect();
        let ranks = &self.ranks;
        let issued = nccl.group(|| {
            for (r, &ptr) in ranks.iter().zip(&ptrs) {
                bind(&r.dev)?;
                let comm = r.comm.as_ref().expect("NCCL ranks have communicators");
                // SAFETY: two u64s on this rank's GPU, read back only after the stream is done.
                unsafe { comm.max_u64(ptr, 2, raw(&r.comm_stream))? };
            }
            Ok(())
        });
        if let Err(e) = issued {
            abort_all(&mut self.ranks, &e.to_string());
            return Err(e.into());
        }
        wait_all(&mut self.ranks, "the problem check", deadline)?;
        let streams: Vec<_> = self.ranks.iter().map(|r| r.comm_stream.clone()).collect();
        wait_streams(
            &mut self.ranks,
            &streams,
            "the problem check (all-reduce)",
            deadline,
        )?;
        for (r, b) in self.ranks.iter().zip(&bufs) {
            let got = r.comm_stream.clone_dtoh(b)?;
            if got != [fp, !fp] {
                return Err(DistError::Mismatch(format!(
                    "rank {} was called with another problem than some other rank (fingerprints \
                     range over {:016x}..={:016x}; this rank's {fp:016x})",
                    r.rank, !got[1], got[0]
                ))
                .into());
            }
        }
        Ok(())
    }

    /// One call, on the ring's buffers (taken out of `self` by the caller for the call, so that
    /// the hand-overs may borrow `self`).
    fn run<T: Element>(
        &mut self,
        p: &Problem,
        z: &Zigzag,
        local: &Problem,
        shards: &mut [Shard<'_, T>],
        (deadline, clock): (Deadline, &mut Option<HostClock>),
        buffers: &mut [RankBuffers],
    ) -> Result<RingReport> {
        let w = self.world;
        let (qs, ks) = (local.q_strides(), local.k_strides());
        let kv_elems = local.k_len().expect("validated");
        let kv_bytes = kv_elems * size_of::<T>();
        let rows = local.batch * local.heads * z.local_len();
        let q_elems = local.q_len().expect("validated");
        let plans: Vec<Vec<schedule::Step>> = self
            .ranks
            .iter()
            .map(|r| schedule::steps(z, r.rank, p.is_causal()))
            .collect::<Result<_>>()?;
        // Partial results in f32 where the backend writes every one of the rank's calls so.
        let f32_parts: Vec<bool> = self
            .ranks
            .iter()
            .zip(&plans)
            .map(|(r, plan)| {
                let backend = self.opts.backend;
                plan.iter().flat_map(|s| &s.blocks).all(|b| {
                    let bp = block_problem(p, b);
                    matches!(backend, Backend::Auto | Backend::Cutlass)
                        && Backend::Cutlass
                            .supports(Some(&r.dev), &bp.with_out_dtype(DType::F32))
                            .is_ok()
                })
            })
            .collect();
        // Two K/V shards in flight per rank (none in a ring of one), the partial output and
        // log-sum-exp of one call, and the running result.
        let sizes = |f32_part: bool| Sizes {
            kv_bytes: if w > 1 { 4 * kv_bytes } else { 0 },
            part_bytes: q_elems * if f32_part { 4 } else { size_of::<T>() },
            rows,
            head_dim: local.head_dim,
        };
        let workspace_bytes = f32_parts
            .iter()
            .map(|&f| sizes(f).bytes())
            .max()
            .unwrap_or(0);
        let mut kv_bufs = Vec::with_capacity(self.ranks.len());
        let mut work = Vec::with_capacity(self.ranks.len());
        for ((r, &f32_part), b) in self.ranks.iter().zip(&f32_parts).zip(buffers.iter_mut()) {
            let call = b.for_call(&r.dev, &sizes(f32_part))?;
            kv_bufs.push(call.kv);
            let acc = Accumulator::new(
                &r.dev,
                (call.acc_o, call.acc_lse),
                local.batch,
                local.heads,
                z.local_len(),
                local.head_dim,
            )?;
            work.push(Scratch {
                part: call.part,
                part_f32: f32_part,
                part_lse: call.part_lse,
                acc,
                timeline: self.opts.timings.then(Timeline::new),
            });
        }
        // Device addresses of what travels: the caller's K/V (step 0), and the two shards in
        // flight (K, V, K, V in the buffer).
        let user_kv: Vec<[u64; 2]> = self
            .ranks
            .iter()
            .zip(shards.iter())
            .map(|(r, s)| {
                [
                    s.k.device_ptr(r.dev.stream()).0,
                    s.v.device_ptr(r.dev.stream()).0,
                ]
            })
            .collect();
        let buf_kv: Vec<[[u64; 2]; 2]> = self
            .ranks
            .iter()
            .zip(&kv_bufs)
            .map(|(r, b)| {
                let base = b.device_ptr(r.dev.stream()).0;
                let at = |j: usize| base + (j * kv_bytes) as u64;
                [[at(0), at(1)], [at(2), at(3)]]
            })
            .collect();
        // The K/V rank i holds at step t, and the buffer it receives into at step t.
        let held = |i: usize, t: usize| {
            if t == 0 {
                user_kv[i]
            } else {
                buf_kv[i][(t - 1) % 2]
            }
        };
        let next = |i: usize, t: usize| buf_kv[i][t % 2];
        HostClock::mark(clock, HostPhase::Setup);
        let mut calls = 0;
        for t in 0..w {
            for (r, wk) in self.ranks.iter().zip(work.iter_mut()) {
                if t > 0 {
                    let s = r.dev.stream();
                    Timeline::span(&mut wk.timeline, Phase::Waiting, s, || {
                        Ok(s.join(&r.comm_stream)?)
                    })?;
                }
                r.comm_stream.join(r.dev.stream())?;
            }
            if t + 1 < w {
                self.exchange(t, kv_bytes, &held, &next, deadline)?;
            }
            let ranks = self.ranks.iter().zip(shards.iter()).zip(work.iter_mut());
            for (((r, s), wk), (plan, kv_buf)) in ranks.zip(plans.iter().zip(&kv_bufs)) {
                for block in &plan[t].blocks {
                    let (k, v) = if t == 0 {
                        (s.k.slice(..), s.v.slice(..))
                    } else {
                        // SAFETY: the buffer holds four shards of `kv_elems` elements of T,
                        // received as T.
                        let all = unsafe { kv_buf.transmute::<T>(4 * kv_elems) }
                            .expect("sized for four shards");
                        let at = |j: usize| all.slice(j * kv_elems..(j + 1) * kv_elems);
                        let b = 2 * ((t - 1) % 2);
                        (at(b), at(b + 1))
                    };
                    attend(
                        &r.dev,
                        p,
                        block,
                        &s.q,
                        &k,
                        &v,
                        (qs, ks),
                        wk,
                        self.opts.backend,
                    )?;
                    calls += 1;
                }
            }
        }
        for (i, r) in self.ranks.iter().enumerate() {
            let s = &mut shards[i];
            let out = s.out.device_ptr_mut(r.dev.stream()).0;
            let lse = s.lse.as_mut().map(|l| l.device_ptr_mut(r.dev.stream()).0);
            let wk = &mut work[i];
            Timeline::span(&mut wk.timeline, Phase::Merge, r.dev.stream(), || {
                // SAFETY: checked against the local problem in `check_shard`.
                unsafe { wk.acc.finish(&r.dev, out, qs, p.dtype, lse) }
            })?;
        }
        HostClock::mark(clock, HostPhase::Issue);
        let streams: Vec<_> = self.ranks.iter().map(|r| r.dev.stream().clone()).collect();
        wait_streams(&mut self.ranks, &streams, "the ring's last step", deadline)?;
        let timings = self
            .ranks
            .iter()
            .zip(&work)
            .filter_map(|(r, wk)| wk.timeline.as_ref().map(|tl| tl.sum(r.rank)))
            .collect::<Result<Vec<_>>>()?;
        HostClock::mark(clock, HostPhase::Wait);
        Ok(RingReport {
            transport: self.transport,
            world: w,
            steps: w,
            exchanges: w - 1,
            bytes_sent: 2 * kv_bytes * (w - 1),
            calls,
            workspace_bytes,
            f32_partials: f32_parts.iter().all(|&f| f),
            timings,
            host: clock.as_ref().map(HostClock::timings),
        })
    }

    /// Step `t`'s hand-over: every local rank sends the K/V it holds to the next rank and
    /// receives the previous rank's into its other buffer, on its communication stream.
    fn exchange(
        &mut self,
        t: usize,
        kv_bytes: usize,
        held: &dyn Fn(usize, usize) -> [u64; 2],
        next: &dyn Fn(usize, usize) -> [u64; 2],
        deadline: Deadline,
    ) -> Result<()> {
        let w = self.world;
        match self.transport {
            Transport::Loopback => {
                // All ranks are here, in rank order, on one stream.
                for i in 0..w {
                    let from = held((i + w - 1) % w, t);
                    let to = next(i, t);
                    let s = self.ranks[i].comm_stream.cu_stream();
                    for (dst, src) in to.into_iter().zip(from) {
                        // SAFETY: both are K/V buffers of `kv_bytes` on this GPU, ordered on
                        // the shared stream after their last use (the joins of `run`).
                        unsafe {
                            cudarc::driver::result::memcpy_dtod_async(dst, src, kv_bytes, s)?
                        };
                    }
                }
                Ok(())
            }
            Transport::Nccl => {
                let nccl = self.nccl.expect("NCCL rings have the library");
                let ranks = &self.ranks;
                let issued = nccl.group(|| {
                    for (i, r) in ranks.iter().enumerate() {
                        bind(&r.dev)?;
                        let comm = r.comm.as_ref().expect("NCCL ranks have communicators");
                        let s = raw(&r.comm_stream);
                        let (to, from) = ((r.rank + 1) % w, (r.rank + w - 1) % w);
                        // SAFETY: the K/V buffers hold `kv_bytes`; the stream joins of `run` keep
                        // them from being written (sent) or read (received) meanwhile.
                        unsafe {
                            for buf in held(i, t) {
                                comm.send(buf, kv_bytes, to, s)?;
                            }
                            for buf in next(i, t) {
                                comm.recv(buf, kv_bytes, from, s)?;
                            }
                        }
                    }
                    Ok(())
                });
                if let Err(e) = issued {
                    abort_all(&mut self.ranks, &e.to_string());
                    return Err(e.into());
                }
                wait_all(
                    &mut self.ranks,
                    &format!("ring step {t}'s K/V hand-over"),
                    deadline,
                )
            }
        }
    }
}

fn bind(dev: &Device) -> Result<(), DistError> {
    dev.ctx()
        .bind_to_thread()
        .map_err(|e| DistError::Rendezvous(format!("binding the rank's GPU: {e}")))
}

fn raw(s: &CudaStream) -> *mut std::ffi::c_void {
    s.cu_stream() as *mut std::ffi::c_void
}

/// Waits until every local communicator's last call is through (see [`Comm::wait`]); on a
/// failure of any, aborts them all.
fn wait_all(ranks: &mut [LocalRank], what: &str, deadline: Deadline) -> Result<()> {
    for i in 0..ranks.len() {
        let Some(comm) = ranks[i].comm.as_mut() else {
            continue;
        };
        if let Err(e) = comm.wait(what, deadline) {
            abort_all(ranks, &e.to_string());
            return Err(e.into());
        }
    }
    Ok(())
}

/// Waits until the work queued on `streams` is done, watching the communicators for
/// asynchronous errors; past the deadline, or on an error, aborts them (which ends NCCL
/// kernels still waiting for a peer) and fails.
fn wait_streams(
    ranks: &mut [LocalRank],
    streams: &[Arc<CudaStream>],
    what: &str,
    deadline: Deadline,
) -> Result<()> {
    let events = streams
        .iter()
        .map(|s| s.record_event(None))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    loop {
        let mut done = true;
        for e in &events {
            done &= e.try_is_complete()?;
        }
        if done {
            return Ok(());
        }
        for i in 0..ranks.len() {
            if let Some(comm) = ranks[i].comm.as_mut()
                && let Err(e) = comm.poll()
            {
                abort_all(ranks, &e.to_string());
                return Err(e.into());
            }
        }
        if deadline.passed() {
            let e = deadline.timeout(what);
            abort_all(ranks, &e.to_string());
            return Err(e.into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn abort_all(ranks: &mut [LocalRank], why: &str) {
    for r in ranks {
        if let Some(c) = r.comm.as_mut() {
            c.abort(why);
        }
    }
}
