//! One attention call on candle storage, whichever op resolved it: the sdpa problem, how each
//! operand is laid out, the tensors it reads beyond Q, K and V; and its run on the CPU (sdpa's
//! float64 reference) or on the GPU (`cuda`). Both ops and their `forward_with_lse` go through
//! here.

use crate::host;
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, bail};
use sdpa::{Alibi, Problem, SeqMeta, Strides};

/// What an op makes of the layouts it is called with.
pub(crate) trait Resolve {
    /// The call on Q, K and V of `dtype` laid out as `q`, `k`, `v`, every shape checked.
    fn resolve(&self, dtype: DType, q: &Layout, k: &Layout, v: &Layout) -> Result<Call<'_>>;
}

/// A resolved call.
pub(crate) struct Call<'t> {
    /// `None`: a packed batch with no query rows or no keys, where no attention runs (the output
    /// is zeros, the log-sum-exp -inf).
    pub problem: Option<Problem>,
    /// The sdpa strides of Q, K and V, as the GPU reads them (the CPU gathers by layout).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub strides: [Strides; 3],
    /// The output's shape: Q's, with V's head dim.
    pub out_shape: Shape,
    /// The strides of the contiguous output.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub out_strides: Strides,
    /// The shape of the log-sum-exp: `(batch, heads, seq_q)`, or `(heads, total_q)` for packed Q.
    pub lse_shape: Shape,
    /// The sequence metadata.
    pub meta: Meta<'t>,
    /// f32 ALiBi slopes in `problem.alibi`'s layout, contiguous.
    pub alibi: Option<&'t Tensor>,
    /// f32 sink logits `(heads)`, contiguous, where `problem.sinks`.
    pub sinks: Option<&'t Tensor>,
}

/// The metadata tensors of a packed or paged batch, on Q's device.
#[derive(Default)]
pub(crate) struct Meta<'t> {
    /// u32 `(batch + 1)` offsets of each sequence's queries.
    pub cu_seqlens_q: Option<&'t Tensor>,
    /// u32 `(batch + 1)` offsets of each sequence's keys: for a paged cache, only their
    /// differences count (each sequence's keys), which become sdpa's `seqused_k`.
    pub cu_seqlens_k: Option<&'t Tensor>,
    /// Whether `cu_seqlens_k` gives `seqused_k` (a paged cache) rather than packed K/V rows.
    pub paged: bool,
    /// u32 or i32 `(batch, pages_per_seq)` pages of each sequence, contiguous.
    pub block_table: Option<&'t Tensor>,
}

impl Call<'_> {
    /// The call on the CPU: the output in Q's dtype and shape, and the log-sum-exp if asked.
    pub fn cpu(
        &self,
        (q, q_l): (&CpuStorage, &Layout),
        (k, k_l): (&CpuStorage, &Layout),
        (v, v_l): (&CpuStorage, &Layout),
        with_lse: bool,
    ) -> Result<(CpuStorage, Option<CpuStorage>)> {
        let out_len = self.out_shape.elem_count();
        let Some(p) = &self.problem else {
            let lse = with_lse
                .then(|| CpuStorage::F32(vec![f32::NEG_INFINITY; self.lse_shape.elem_count()]));
            return Ok((host::storage(q.dtype(), &vec![0.0; out_len]), lse));
        };
        let h = self.on_host(p, [(q, q_l), (k, k_l), (v, v_l)])?;
        let r = sdpa::reference_seqs(
            &h.problem,
            &h.values[0],
            &h.values[1],
            &h.values[2],
            h.slopes.as_deref(),
            h.sinks.as_deref(),
            &h.meta,
        )
        .map_err(candle_core::Error::wrap)?;
        let lse = with_lse.then(|| CpuStorage::F32(r.lse.iter().map(|&x| x as f32).collect()));
        Ok((host::storage(q.dtype(), &r.out), lse))
    }

    /// The call's gradients on the CPU (sdpa's float64 reference gradient) for `dout`, the
    /// loss's gradient against the output: dQ, dK and dV in Q's dtype, contiguous in Q's, K's
    /// and V's shapes. The sinks take no gradient here (they are not an input of the op).
    pub fn cpu_backward(
        &self,
        (q, q_l): (&CpuStorage, &Layout),
        (k, k_l): (&CpuStorage, &Layout),
        (v, v_l): (&CpuStorage, &Layout),
        (dout, dout_l): (&CpuStorage, &Layout),
    ) -> Result<[CpuStorage; 3]> {
        let zeros = |l: &Layout| host::storage(q.dtype(), &vec![0.0; l.shape().elem_count()]);
        let Some(p) = &self.problem else {
            return Ok([zeros(q_l), zeros(k_l), zeros(v_l)]);
        };
        let h = self.on_host(p, [(q, q_l), (k, k_l), (v, v_l)])?;
        let g = sdpa::reference_backward_seqs(
            &h.problem,
            &h.values[0],
            &h.values[1],
            &h.values[2],
            &host::values(dout, dout_l)?,
            h.slopes.as_deref(),
            h.sinks.as_deref(),
            &h.meta,
        )
        .map_err(candle_core::Error::wrap)?;
        Ok([&g.dq, &g.dk, &g.dv].map(|x| host::storage(q.dtype(), x)))
    }

    /// What the CPU reference takes of the call: `p` with a paged cache in NHD order, the
    /// metadata, ALiBi slopes and sinks on the host, and Q, K and V as f64 values.
    fn on_host(&self, p: &Problem, ops: [(&CpuStorage, &Layout); 3]) -> Result<OnHost> {
        let meta = self.host_meta()?;
        let slopes = match self.alibi {
            Some(t) => Some(
                host::on_cpu("alibi_slopes", t)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            ),
            None => None,
        };
        let sinks = match self.sinks {
            Some(t) => Some(host::on_cpu("sinks", t)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        let [(q, q_l), (k, k_l), (v, v_l)] = ops;
        Ok(OnHost {
            // The values are gathered in each operand's logical row-major order: a paged
            // cache's in NHD order, however it is stored.
            problem: p.with_page_layout(sdpa::PageLayout::Nhd),
            meta,
            slopes,
            sinks,
            values: [
                host::values(q, q_l)?,
                host::values(k, k_l)?,
                host::values(v, v_l)?,
            ],
        })
    }

    /// Host copies of the metadata, as sdpa's i32 values.
    fn host_meta(&self) -> Result<SeqMeta> {
        let m = &self.meta;
        let cu_q = m
            .cu_seqlens_q
            .map(|t| host::offsets("seqlens_q", t))
            .transpose()?;
        let cu_k = m
            .cu_seqlens_k
            .map(|t| host::offsets("seqlens_k", t))
            .transpose()?;
        let block_table = m.block_table.map(host::block_table).transpose()?;
        let (cu_k, seqused_k) = match (m.paged, cu_k) {
            (true, Some(cu)) => (None, Some(host::lengths("seqlens_k", &cu)?)),
            (_, cu) => (cu, None),
        };
        Ok(SeqMeta {
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
            seqused_k,
            block_table,
        })
    }
}

/// A call as the CPU reference takes it (`Call::on_host`).
struct OnHost {
    problem: Problem,
    meta: SeqMeta,
    slopes: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
    /// Q, K and V.
    values: [Vec<f64>; 3],
}

/// The layout of ALiBi slopes for `heads` query heads of `batch` sequences: f32, `(heads)` or
/// `(batch, heads)`, contiguous, on `q`'s device.
pub(crate) fn alibi_layout(slopes: &Tensor, batch: usize, heads: usize) -> Result<Alibi> {
    if slopes.dtype() != DType::F32 {
        bail!(
            "sdpa-candle: alibi_slopes are {:?}; they must be f32",
            slopes.dtype()
        );
    }
    if !slopes.is_contiguous() {
        bail!("sdpa-candle: alibi_slopes must be contiguous");
    }
    match slopes.dims() {
        [h] if *h == heads => Ok(Alibi::PerHead),
        [b, h] if (*b, *h) == (batch, heads) => Ok(Alibi::PerBatchHead),
        _ => bail!(
            "sdpa-candle: alibi_slopes are {:?}; they must be ({heads}) or ({batch}, {heads}), one \
             per query head",
            slopes.shape()
        ),
    }
}

/// Checks sink logits for `heads` query heads: f32 `(heads)`, contiguous (on Q's device: the
/// call checks where they live).
pub(crate) fn check_sinks(sinks: &Tensor, heads: usize) -> Result<()> {
    if sinks.dtype() != DType::F32 {
        bail!(
            "sdpa-candle: sinks are {:?}; they must be f32",
            sinks.dtype()
        );
    }
    if !sinks.is_contiguous() {
        bail!("sdpa-candle: sinks must be contiguous");
    }
    if sinks.dims() != [heads] {
        bail!(
            "sdpa-candle: sinks are {:?}; they must be ({heads}), one per query head",
            sinks.shape()
        );
    }
    Ok(())
}

/// The op's forward on the CPU (its `CustomOp3::cpu_fwd`).
pub(crate) fn cpu_fwd(
    op: &impl Resolve,
    q: (&CpuStorage, &Layout),
    k: (&CpuStorage, &Layout),
    v: (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    host::same_dtype(q.0.dtype(), k.0.dtype(), v.0.dtype())?;
    let call = op.resolve(q.0.dtype(), q.1, k.1, v.1)?;
    Ok((call.cpu(q, k, v, false)?.0, call.out_shape))
}

/// The op's forward on the GPU (its `CustomOp3::cuda_fwd`).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_fwd(
    op: &impl Resolve,
    q: (&candle_core::CudaStorage, &Layout),
    k: (&candle_core::CudaStorage, &Layout),
    v: (&candle_core::CudaStorage, &Layout),
) -> Result<(candle_core::CudaStorage, Shape)> {
    host::same_dtype(q.0.dtype(), k.0.dtype(), v.0.dtype())?;
    let call = op.resolve(q.0.dtype(), q.1, k.1, v.1)?;
    Ok((crate::cuda::run(&call, q, k, v, false)?.0, call.out_shape))
}

/// The op's backward (its `CustomOp3::bwd`): dQ, dK and dV for `grad_out`, contiguous in Q's,
/// K's and V's shapes: on the GPU through sdpa's backward (the forward recomputed for its
/// log-sum-exp), on the CPU through sdpa's float64 reference gradient.
pub(crate) fn backward(
    op: &(impl Resolve + CustomOp3),
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad_out: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return cuda_backward(op, q, k, v, grad_out);
    }
    let ((qs, q_l), (ks, k_l), (vs, v_l), (gs, g_l)) = (
        q.storage_and_layout(),
        k.storage_and_layout(),
        v.storage_and_layout(),
        grad_out.storage_and_layout(),
    );
    let call = op.resolve(q.dtype(), q_l, k_l, v_l)?;
    let (Storage::Cpu(qc), Storage::Cpu(kc), Storage::Cpu(vc), Storage::Cpu(gc)) =
        (&*qs, &*ks, &*vs, &*gs)
    else {
        return Err(candle_core::Error::BackwardNotSupported { op: op.name() }.bt());
    };
    let grads = call.cpu_backward((qc, q_l), (kc, k_l), (vc, v_l), (gc, g_l))?;
    let [dq, dk, dv] = grads;
    Ok(gradients(
        [Storage::Cpu(dq), Storage::Cpu(dk), Storage::Cpu(dv)],
        [q, k, v],
    ))
}

/// The op's backward on the GPU ([`backward`]): the operands made contiguous, so that each
/// gradient takes its operand's strides.
#[cfg(feature = "cuda")]
fn cuda_backward(
    op: &(impl Resolve + CustomOp3),
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad_out: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (q, k, v, g) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        grad_out.contiguous()?,
    );
    let ((qs, q_l), (ks, k_l), (vs, v_l), (gs, g_l)) = (
        q.storage_and_layout(),
        k.storage_and_layout(),
        v.storage_and_layout(),
        g.storage_and_layout(),
    );
    let (Storage::Cuda(qc), Storage::Cuda(kc), Storage::Cuda(vc), Storage::Cuda(gc)) =
        (&*qs, &*ks, &*vs, &*gs)
    else {
        bail!("sdpa-candle: the backward's q, k, v and grad_out must all be on the GPU");
    };
    let call = op.resolve(q.dtype(), q_l, k_l, v_l)?;
    let grads = crate::cuda::backward(&call, (qc, q_l), (kc, k_l), (vc, v_l), (gc, g_l))?;
    let [dq, dk, dv] = grads;
    Ok(gradients(
        [Storage::Cuda(dq), Storage::Cuda(dk), Storage::Cuda(dv)],
        [&q, &k, &v],
    ))
}

/// dQ, dK and dV as the backward's tensors (outside candle's graph), in Q's, K's and V's shapes.
fn gradients(
    [dq, dk, dv]: [Storage; 3],
    [q, k, v]: [&Tensor; 3],
) -> (Option<Tensor>, Option<Tensor>, Option<Tensor>) {
    let tensor = |s: Storage, t: &Tensor| {
        Tensor::from_storage(s, t.shape().clone(), BackpropOp::none(), false)
    };
    (
        Some(tensor(dq, q)),
        Some(tensor(dk, k)),
        Some(tensor(dv, v)),
    )
}

/// `CustomOp3` for an op that resolves its calls ([`Resolve`]): forward on the CPU and the GPU
/// through this module, and the backward ([`backward`]).
macro_rules! custom_op3 {
    ($op:ty, $name:literal) => {
        impl candle_core::CustomOp3 for $op {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                q: &candle_core::CpuStorage,
                q_l: &candle_core::Layout,
                k: &candle_core::CpuStorage,
                k_l: &candle_core::Layout,
                v: &candle_core::CpuStorage,
                v_l: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                $crate::call::cpu_fwd(self, (q, q_l), (k, k_l), (v, v_l))
            }

            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                q: &candle_core::CudaStorage,
                q_l: &candle_core::Layout,
                k: &candle_core::CudaStorage,
                k_l: &candle_core::Layout,
                v: &candle_core::CudaStorage,
                v_l: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
                $crate::call::cuda_fwd(self, (q, q_l), (k, k_l), (v, v_l))
            }

            fn bwd(
                &self,
                q: &candle_core::Tensor,
                k: &candle_core::Tensor,
                v: &candle_core::Tensor,
                _out: &candle_core::Tensor,
                grad_out: &candle_core::Tensor,
            ) -> candle_core::Result<(
                Option<candle_core::Tensor>,
                Option<candle_core::Tensor>,
                Option<candle_core::Tensor>,
            )> {
                $crate::call::backward(self, q, k, v, grad_out)
            }
        }
    };
}
pub(crate) use custom_op3;

/// The output and the log-sum-exp of `op` on Q, K and V, outside candle's graph (no backward).
pub(crate) fn forward_with_lse(
    op: &impl Resolve,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor)> {
    for (name, t) in [("k", k), ("v", v)] {
        if !t.device().same_device(q.device()) {
            bail!(
                "sdpa-candle: q is on {:?} and {name} on {:?}; they must share a device",
                q.device().location(),
                t.device().location()
            );
        }
    }
    host::same_dtype(q.dtype(), k.dtype(), v.dtype())?;
    let ((qs, q_l), (ks, k_l), (vs, v_l)) = (
        q.storage_and_layout(),
        k.storage_and_layout(),
        v.storage_and_layout(),
    );
    let call = op.resolve(q.dtype(), q_l, k_l, v_l)?;
    let (out, lse) = match (&*qs, &*ks, &*vs) {
        (Storage::Cpu(q), Storage::Cpu(k), Storage::Cpu(v)) => {
            let (out, lse) = call.cpu((q, q_l), (k, k_l), (v, v_l), true)?;
            (Storage::Cpu(out), lse.map(Storage::Cpu))
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(q), Storage::Cuda(k), Storage::Cuda(v)) => {
            let (out, lse) = crate::cuda::run(&call, (q, q_l), (k, k_l), (v, v_l), true)?;
            (Storage::Cuda(out), lse.map(Storage::Cuda))
        }
        _ => bail!(
            "sdpa-candle: {:?} tensors are not supported (the CPU, or CUDA with the `cuda` feature)",
            q.device().location()
        ),
    };
    let Some(lse) = lse else {
        bail!("sdpa-candle: the log-sum-exp was not computed");
    };
    Ok((
        Tensor::from_storage(out, call.out_shape.clone(), BackpropOp::none(), false),
        Tensor::from_storage(lse, call.lse_shape.clone(), BackpropOp::none(), false),
    ))
}
