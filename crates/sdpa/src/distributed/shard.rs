//! One rank's operands of a ring call: views of its shards of Q, K, V and the output on its
//! GPU, which the caller owns.

use cudarc::driver::{CudaView, CudaViewMut};

/// One rank's operands: its zigzag shards (see [`Zigzag`](super::Zigzag)) of Q, K, V and the
/// output, each a dense tensor of the local sequence in the problem's layout, on the rank's
/// device.
pub struct Shard<'a, T> {
    /// Queries `[batch, heads, local, head_dim]` (in the problem's layout).
    pub q: CudaView<'a, T>,
    /// Keys `[batch, kv_heads, local, head_dim]`.
    pub k: CudaView<'a, T>,
    /// Values, as the keys.
    pub v: CudaView<'a, T>,
    /// Out: attention of the shard's queries over the whole sequence.
    pub out: CudaViewMut<'a, T>,
    /// Out, where given: each query row's log-sum-exp over the whole sequence, f32 `[batch,
    /// heads, local]` (natural log, as [`Extras::lse`](crate::Extras::lse)).
    pub lse: Option<CudaViewMut<'a, f32>>,
}
