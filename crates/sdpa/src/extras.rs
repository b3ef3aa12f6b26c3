//! The optional operands of a call beyond Q, K, V and the output: the ALiBi slopes it reads and
//! the log-sum-exp it writes, f32 buffers on the device owned by the caller.

use crate::device::Device;
use crate::error::{Result, invalid};
use crate::problem::Problem;
use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use std::ops::Range;
use std::sync::Arc;

/// What a call takes beyond Q, K, V and the output; each is required exactly when the problem
/// asks for it (`Problem::alibi`, `Problem::lse`).
#[derive(Debug, Default)]
pub struct Extras<'a> {
    /// ALiBi slopes, `p.alibi`'s layout: `[heads]` or `[batch, heads]`.
    pub alibi_slopes: Option<CudaView<'a, f32>>,
    /// Out: each query row's log-sum-exp, `[batch, heads, seq_q]` (natural log of the sum of
    /// the exponentials of its logits; -inf for a row that sees no key). Written only on
    /// success.
    pub lse: Option<CudaViewMut<'a, f32>>,
}

/// The device addresses of checked extras, valid while the guards live (their drop records
/// cudarc's read/write events where tracking is on).
pub(crate) struct ExtraPtrs<'g> {
    pub(crate) alibi_slopes: u64,
    pub(crate) lse: u64,
    _guards: (Option<SyncOnDrop<'g>>, Option<SyncOnDrop<'g>>),
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
                crate::view::out_apart(&span, &others)
                    .map_err(|_| invalid!("lse overlaps another operand of the call"))?;
            }
            (true, None) => return Err(invalid!("the problem asks for the LSE; pass lse")),
            (false, Some(_)) => {
                return Err(invalid!(
                    "lse given for a problem that does not ask for it (Problem::with_lse)"
                ));
            }
        }
        Ok(())
    }

    /// The streams the extras' buffers were made on (for ordering the call after them).
    pub(crate) fn streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        let a = self.alibi_slopes.as_ref().map(|s| s.stream());
        let l = self.lse.as_ref().map(|s| s.stream());
        a.into_iter().chain(l)
    }

    /// Device addresses on `stream` (0 for an absent one).
    pub(crate) fn pointers<'g>(&'g mut self, stream: &'g Arc<CudaStream>) -> ExtraPtrs<'g> {
        let a = self.alibi_slopes.as_ref().map(|s| s.device_ptr(stream));
        let l = self.lse.as_mut().map(|s| s.device_ptr_mut(stream));
        ExtraPtrs {
            alibi_slopes: a.as_ref().map_or(0, |x| x.0),
            lse: l.as_ref().map_or(0, |x| x.0),
            _guards: (a.map(|x| x.1), l.map(|x| x.1)),
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
