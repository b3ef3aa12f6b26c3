//! What a GPU backend is handed once a call's operands are checked: device addresses and element
//! strides, whether they came from owned [`Tensor`]s or borrowed views of the caller's memory.

use crate::device::Device;
use crate::problem::{Problem, Strides};
use crate::tensor::Tensor;

/// Device addresses and element strides of one call's Q, K, V and output, each checked against
/// the call's problem: the strides address only memory inside its buffer, rows are 16-byte
/// aligned, and the output overlaps no input.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buffers {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    /// The output, of the problem's output dtype.
    pub(crate) o: u64,
    /// Device addresses of the e4m3 dequantization scales of Q, K and V (0 for f16/bf16).
    pub(crate) scales: [u64; 3],
    /// Of Q, K, V and the output, in that order.
    pub(crate) strides: [Strides; 4],
    /// Device addresses of the ALiBi slopes, the sink logits and the log-sum-exp output (0:
    /// none), checked against the problem's sizes.
    pub(crate) alibi_slopes: u64,
    pub(crate) sinks: u64,
    pub(crate) lse: u64,
    /// Device addresses of the sequence metadata (0: none): cu_seqlens_q, cu_seqlens_k,
    /// seqused_k, block_table.
    pub(crate) seqs: [u64; 4],
}

impl Buffers {
    /// Owned tensors, laid out contiguously as the problem's layout says.
    pub(crate) fn of_tensors(
        dev: &Device,
        p: &Problem,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &mut Tensor,
    ) -> Buffers {
        Buffers {
            q: q.ptr(dev),
            k: k.ptr(dev),
            v: v.ptr(dev),
            o: out.ptr_mut(dev),
            scales: [q.scales_ptr(dev), k.scales_ptr(dev), v.scales_ptr(dev)],
            strides: p.operand_strides(),
            alibi_slopes: 0,
            sinks: 0,
            lse: 0,
            seqs: [0; 4],
        }
    }

    /// The same buffers with the call's extras (ALiBi slopes, sinks, log-sum-exp).
    pub(crate) fn with_extras(self, e: &crate::extras::ExtraPtrs<'_>) -> Buffers {
        Buffers {
            alibi_slopes: e.alibi_slopes,
            sinks: e.sinks,
            lse: e.lse,
            seqs: e.seqs,
            ..self
        }
    }

    /// Whether every operand has the strides of the problem's own layout (what the backends
    /// that index by layout, cpu and cublas, need).
    pub(crate) fn in_layout(&self, p: &Problem) -> bool {
        self.strides == p.operand_strides()
    }
}
