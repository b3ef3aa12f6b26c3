//! The optional operands of a call beyond Q, K, V and the output: the ALiBi slopes and sink
//! logits it reads, the log-sum-exp it writes (f32) and the sequence metadata of packed or paged batches (i32),
//! buffers on the device owned by the caller.

use crate::device::Device;
use crate::error::{Result, invalid};
use crate::problem::Problem;
use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use std::ops::Range;
use std::sync::Arc;

/// What a call takes beyond Q, K, V and the output; each is required exactly when the problem
/// asks for it (`Problem::alibi`, `Problem::sinks`, `Problem::lse`, `Problem::seqs`).
///
/// Three prompts of 100, 7 and 300 tokens in one call, packed as FlashAttention's varlen packs
/// them, with each row's log-sum-exp (`[heads, total_q]` for packed Q):
///
/// ```no_run
/// use sdpa::{Backend, DType, Device, Extras, Problem, Tensor, Tensors};
/// # fn main() -> sdpa::Result<()> {
/// let dev = Device::new(0)?;
/// let total = 100 + 7 + 300;
/// let p = Problem::new(3, 16, 300, 300, 128) // batch: sequences; seq_q, seq_k: the longest
///     .with_causal(true)
///     .with_packed_q(total)                  // Q and out [total, 16, 128]
///     .with_packed_kv(total)                 // K and V [total, 16, 128]
///     .with_lse(true);
/// let cu = dev.stream().clone_htod(&[0i32, 100, 107, 407])?;
/// let mut lse = dev.stream().alloc_zeros::<f32>(p.lse_len())?;
/// let (nq, nkv) = (p.q_len().unwrap(), p.k_len().unwrap());
/// let q = Tensor::zeros(&dev, DType::F16, nq)?;
/// let (k, v) = (Tensor::zeros(&dev, DType::F16, nkv)?, Tensor::zeros(&dev, DType::F16, nkv)?);
/// let mut out = Tensor::poisoned(&dev, DType::F16, nq)?;
/// let extras = Extras {
///     cu_seqlens_q: Some(cu.as_view()),
///     cu_seqlens_k: Some(cu.as_view()),
///     lse: Some(lse.as_view_mut()),
///     ..Extras::default()
/// };
/// sdpa::forward(&dev, &p, Backend::Auto, Tensors { q: &q, k: &k, v: &v, out: &mut out }, extras)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Default)]
pub struct Extras<'a> {
    /// ALiBi slopes, `p.alibi`'s layout: `[heads]` or `[batch, heads]`.
    pub alibi_slopes: Option<CudaView<'a, f32>>,
    /// The sink logit of each query head, `[heads]` (natural-log units, taken raw: see
    /// [`Problem::with_sinks`]); entries past `heads` are not read.
    pub sinks: Option<CudaView<'a, f32>>,
    /// Out: each query row's log-sum-exp, `[batch, heads, seq_q]`, or `[heads, total_q]` for
    /// packed Q (FlashAttention's varlen layout); [`Problem::lse_len`] entries. The natural log
    /// of the sum of the exponentials of its logits; -inf for a row that sees no key. Written
    /// only on success.
    pub lse: Option<CudaViewMut<'a, f32>>,
    /// `[batch + 1]` offsets of each sequence's queries in packed Q (`Seqs::packed_q`).
    pub cu_seqlens_q: Option<CudaView<'a, i32>>,
    /// `[batch + 1]` offsets of each sequence's keys in packed K/V (`KvRows::Packed`).
    pub cu_seqlens_k: Option<CudaView<'a, i32>>,
    /// `[batch]` keys each sequence uses (`Seqs::seqused_k`; a paged cache's lengths).
    pub seqused_k: Option<CudaView<'a, i32>>,
    /// `[batch, pages_per_seq]` cache pages of each sequence's keys (`KvRows::Paged`).
    pub block_table: Option<CudaView<'a, i32>>,
}

/// The device addresses of checked extras, valid while the guards live (their drop records
/// cudarc's read/write events where tracking is on).
pub(crate) struct ExtraPtrs<'g> {
    pub(crate) alibi_slopes: u64,
    pub(crate) sinks: u64,
    pub(crate) lse: u64,
    /// cu_seqlens_q, cu_seqlens_k, seqused_k, block_table.
    pub(crate) seqs: [u64; 4],
    _guards: Vec<SyncOnDrop<'g>>,
}

impl Extras<'_> {
    /// Checks each extra against the problem and the device: given exactly when asked for, long
    /// enough, on `dev`'s GPU; and the log-sum-exp apart from the call's operands (the byte
    /// ranges of Q, K, V and the output).
    pub(crate) fn check(
        &self,
        dev: &Device,
        p: &Problem,
        operands: &[Range<u64>; 4],
    ) -> Result<()> {
        match (p.alibi, &self.alibi_slopes) {
            (None, None) => {}
            (Some(a), Some(s)) => {
                let need = a.len(p.batch, p.heads);
                on_device("alibi_slopes", dev, s.stream())?;
                if s.len() < need {
                    return Err(invalid!(
                        "alibi_slopes holds {} values, {a:?} slopes of {p} need {need}",
                        s.len()
                    ));
                }
            }
            (Some(_), None) => return Err(invalid!("the problem has ALiBi; pass alibi_slopes")),
            (None, Some(_)) => {
                return Err(invalid!(
                    "alibi_slopes given for a problem without ALiBi (Problem::with_alibi)"
                ));
            }
        }
        match (p.sinks, &self.sinks) {
            (false, None) => {}
            (true, Some(s)) => {
                on_device("sinks", dev, s.stream())?;
                if s.len() < p.heads {
                    return Err(invalid!(
                        "sinks holds {} values, {p} needs one per query head ({})",
                        s.len(),
                        p.heads
                    ));
                }
            }
            (true, None) => return Err(invalid!("the problem has sinks; pass sinks")),
            (false, Some(_)) => {
                return Err(invalid!(
                    "sinks given for a problem without sinks (Problem::with_sinks)"
                ));
            }
        }
        match (p.lse, &self.lse) {
            (false, None) => {}
            (true, Some(l)) => {
                on_device("lse", dev, l.stream())?;
                if l.len() < p.lse_len() {
                    return Err(invalid!(
                        "lse holds {} values, {p} needs batch x heads x seq_q = {}",
                        l.len(),
                        p.lse_len()
                    ));
                }
                let (ptr, _g) = l.device_ptr(l.stream());
                let span = ptr..ptr + 4 * p.lse_len() as u64;
                let [q, k, v, out] = operands;
                let others = [("q", q), ("k", k), ("v", v), ("out", out)];
                crate::footprint::out_apart(&span, &others)
                    .map_err(|_| invalid!("lse overlaps another operand of the call"))?;
            }
            (true, None) => return Err(invalid!("the problem asks for the LSE; pass lse")),
            (false, Some(_)) => {
                return Err(invalid!(
                    "lse given for a problem that does not ask for it (Problem::with_lse)"
                ));
            }
        }
        let s = &p.seqs;
        for (name, buf, want, len) in [
            (
                "cu_seqlens_q",
                &self.cu_seqlens_q,
                s.takes_cu_seqlens_q(),
                p.batch + 1,
            ),
            (
                "cu_seqlens_k",
                &self.cu_seqlens_k,
                s.takes_cu_seqlens_k(),
                p.batch + 1,
            ),
            ("seqused_k", &self.seqused_k, s.seqused_k, p.batch),
            (
                "block_table",
                &self.block_table,
                s.takes_block_table(),
                p.block_table_len(),
            ),
        ] {
            match (buf, want) {
                (None, false) => {}
                (Some(b), true) => {
                    on_device(name, dev, b.stream())?;
                    if b.len() < len {
                        return Err(invalid!("{name} holds {} values, {p} needs {len}", b.len()));
                    }
                }
                (None, true) => return Err(invalid!("{p} needs {name}; pass it in Extras")),
                (Some(_), false) => {
                    return Err(invalid!("{name} given for {p}, which does not take it"));
                }
            }
        }
        if s.checked {
            crate::seqs::check_metadata(p, &self.metadata_on_host()?)?;
        }
        Ok(())
    }

    /// Host copies of the sequence metadata (a synchronizing copy each).
    pub(crate) fn metadata_on_host(&self) -> Result<crate::seqs::SeqMeta> {
        let copy = |b: &Option<CudaView<'_, i32>>| -> Result<Option<Vec<i32>>> {
            match b {
                Some(b) => Ok(Some(b.stream().clone_dtoh(b)?)),
                None => Ok(None),
            }
        };
        Ok(crate::seqs::SeqMeta {
            cu_seqlens_q: copy(&self.cu_seqlens_q)?,
            cu_seqlens_k: copy(&self.cu_seqlens_k)?,
            seqused_k: copy(&self.seqused_k)?,
            block_table: copy(&self.block_table)?,
        })
    }

    /// The streams the extras' buffers were made on (for ordering the call after them).
    pub(crate) fn streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        let a = self.alibi_slopes.as_ref().map(|s| s.stream());
        let s = self.sinks.as_ref().map(|s| s.stream());
        let l = self.lse.as_ref().map(|s| s.stream());
        let m = self.metadata().into_iter().flatten().map(|b| b.stream());
        a.into_iter().chain(s).chain(l).chain(m)
    }

    fn metadata(&self) -> [&Option<CudaView<'_, i32>>; 4] {
        [
            &self.cu_seqlens_q,
            &self.cu_seqlens_k,
            &self.seqused_k,
            &self.block_table,
        ]
    }

    /// Device addresses on `stream` (0 for an absent one).
    pub(crate) fn pointers<'g>(&'g mut self, stream: &'g Arc<CudaStream>) -> ExtraPtrs<'g> {
        let mut guards = Vec::new();
        let mut keep = |x: Option<(u64, SyncOnDrop<'g>)>| match x {
            Some((ptr, g)) => {
                guards.push(g);
                ptr
            }
            None => 0,
        };
        let alibi_slopes = keep(self.alibi_slopes.as_ref().map(|s| s.device_ptr(stream)));
        let sinks = keep(self.sinks.as_ref().map(|s| s.device_ptr(stream)));
        let lse = keep(self.lse.as_mut().map(|s| s.device_ptr_mut(stream)));
        let seqs = [
            &self.cu_seqlens_q,
            &self.cu_seqlens_k,
            &self.seqused_k,
            &self.block_table,
        ]
        .map(|b| keep(b.as_ref().map(|b| b.device_ptr(stream))));
        ExtraPtrs {
            alibi_slopes,
            sinks,
            lse,
            seqs,
            _guards: guards,
        }
    }
}

fn on_device(name: &str, dev: &Device, s: &Arc<CudaStream>) -> Result<()> {
    if s.context() != dev.ctx() {
        return Err(invalid!(
            "{name} lives on another GPU than the device handle"
        ));
    }
    Ok(())
}
