//! Whole problems from host memory through a ring, for validation and the command line: the
//! full Q, K, V are rounded to the problem's dtype, split into the zigzag shards of the ranks
//! this process drives, uploaded, run, and the shards' outputs brought back.

use super::problems::check_problem;
use super::ring::{Ring, RingReport};
use super::shard::Shard;
use super::zigzag::{Dims, Zigzag};
use crate::codec::{decode, encode};
use crate::error::{Result, invalid};
use crate::problem::{DType, Problem};
use crate::tensor::Element;

/// The outputs of the ranks this process drives.
#[derive(Debug, Clone)]
pub struct HostShards {
    /// The ranks, in [`Ring::local_ranks`] order.
    pub ranks: Vec<usize>,
    /// Each rank's output shard, `[batch, heads, local, head_dim]` in the problem's layout.
    pub out: Vec<Vec<f32>>,
    /// Each rank's log-sum-exp shard, `[batch, heads, local]`.
    pub lse: Vec<Vec<f32>>,
    /// What the ring did.
    pub report: RingReport,
}

impl HostShards {
    /// The whole output and log-sum-exp, when this process drove every rank.
    pub fn gather(&self, p: &Problem) -> Result<(Vec<f32>, Vec<f32>)> {
        let z = Zigzag::new(p.seq_q, self.report.world)?;
        if !self.ranks.iter().copied().eq(0..z.world()) {
            return Err(invalid!(
                "this process drove ranks {:?} of {}; the others' shards are elsewhere",
                self.ranks,
                z.world()
            ));
        }
        let out = z.unshard(&self.out, q_dims(p))?;
        let lse = z.unshard(&self.lse, lse_dims(p))?;
        Ok((out, lse))
    }
}

/// The dims of Q and the output, for [`Zigzag::shard`].
pub fn q_dims(p: &Problem) -> Dims {
    Dims {
        batch: p.batch,
        heads: p.heads,
        inner: p.head_dim,
        layout: p.layout,
    }
}

/// The dims of K and V.
pub fn kv_dims(p: &Problem) -> Dims {
    Dims {
        heads: p.kv_heads,
        ..q_dims(p)
    }
}

/// The dims of the log-sum-exp.
pub fn lse_dims(p: &Problem) -> Dims {
    Dims {
        batch: p.batch,
        heads: p.heads,
        inner: 1,
        layout: crate::problem::Layout::Bhsd,
    }
}

/// Runs `p` on `ring` from the whole Q, K and V (`[batch, heads, seq, head_dim]` f32 values in
/// `p`'s layout, rounded to `p.dtype`), with the log-sum-exp; returns the local ranks' shards.
pub fn forward_host(
    ring: &mut Ring,
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<HostShards> {
    let z = check_problem(p, ring.world())?;
    let (ql, kl) = (p.q_len().unwrap_or(0), p.k_len().unwrap_or(0));
    for (name, x, need) in [("q", q, ql), ("k", k, kl), ("v", v, kl)] {
        if x.len() != need {
            return Err(invalid!("{name} holds {} values, {p} has {need}", x.len()));
        }
    }
    let p = p.with_lse(true);
    match p.dtype {
        DType::F16 => run::<half::f16>(ring, &p, &z, [q, k, v], half::f16::from_bits, |x| {
            x.to_bits()
        }),
        DType::Bf16 => run::<half::bf16>(ring, &p, &z, [q, k, v], half::bf16::from_bits, |x| {
            x.to_bits()
        }),
        d => Err(invalid!("ring attention runs f16 and bf16, not {d}")),
    }
}

fn run<T: Element + cudarc::driver::ValidAsZeroBits + Copy>(
    ring: &mut Ring,
    p: &Problem,
    z: &Zigzag,
    [q, k, v]: [&[f32]; 3],
    from_bits: fn(u16) -> T,
    to_bits: fn(T) -> u16,
) -> Result<HostShards> {
    let (qb, kb, vb) = (encode(p.dtype, q), encode(p.dtype, k), encode(p.dtype, v));
    let typed = |bits: Vec<u16>| bits.into_iter().map(from_bits).collect::<Vec<T>>();
    let lse_local = p.batch * p.heads * z.local_len();
    let mut ranks = Vec::new();
    let mut bufs = Vec::new();
    for (rank, dev) in ring.local_ranks() {
        let s = dev.stream();
        let qs = typed(z.shard(&qb, q_dims(p), rank)?);
        let ks = typed(z.shard(&kb, kv_dims(p), rank)?);
        let vs = typed(z.shard(&vb, kv_dims(p), rank)?);
        bufs.push((
            s.clone_htod(&qs)?,
            s.clone_htod(&ks)?,
            s.clone_htod(&vs)?,
            s.alloc_zeros::<T>(qs.len())?,
            s.alloc_zeros::<f32>(lse_local)?,
        ));
        ranks.push(rank);
    }
    let report = {
        let mut shards: Vec<Shard<'_, T>> = bufs
            .iter_mut()
            .map(|(q, k, v, out, lse)| Shard {
                q: q.as_view(),
                k: k.as_view(),
                v: v.as_view(),
                out: out.as_view_mut(),
                lse: Some(lse.as_view_mut()),
            })
            .collect();
        ring.forward(p, &mut shards)?
    };
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for ((_, dev), (_, _, _, o, l)) in ring.local_ranks().zip(&bufs) {
        let s = dev.stream();
        let bits: Vec<u16> = s.clone_dtoh(o)?.into_iter().map(to_bits).collect();
        out.push(
            decode(p.dtype, &bits)
                .into_iter()
                .map(|x| x as f32)
                .collect(),
        );
        lse.push(s.clone_dtoh(l)?);
    }
    Ok(HostShards {
        ranks,
        out,
        lse,
        report,
    })
}
