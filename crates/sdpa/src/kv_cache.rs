//! Appending new keys and values to a paged K/V cache, on the device: the other half of a decode
//! step (FlashAttention's `flash_attn_with_kvcache` appends `k`, `v` before attending).

use crate::device::Device;
use crate::error::{Result, invalid};
use crate::problem::{DType, Problem};
use crate::seqs::KvRows;
use crate::tensor::Tensor;
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};

/// One append: `n_new` new rows of each sequence into the cache a paged problem reads.
#[derive(Debug)]
pub struct KvAppend<'a> {
    /// New keys, `[batch, n_new, kv_heads, head_dim]`, of the problem's dtype.
    pub k_new: &'a Tensor,
    /// New values, the same shape.
    pub v_new: &'a Tensor,
    /// New rows a sequence.
    pub n_new: usize,
    /// The key cache, `[pages, page_size, kv_heads, head_dim]` (`p.kv_len()` elements).
    pub k_cache: &'a mut Tensor,
    /// The value cache, the same shape.
    pub v_cache: &'a mut Tensor,
    /// `[batch, pages_per_seq]`: each sequence's pages.
    pub block_table: CudaView<'a, i32>,
    /// `[batch]`: each sequence's keys in the cache; grows by `n_new`.
    pub seqused_k: CudaViewMut<'a, i32>,
}

/// Writes row i of sequence b's new keys and values to cache position `seqused_k[b] + i` (page
/// `block_table[b][pos / page_size]`, row `pos % page_size`), then adds `n_new` to each
/// `seqused_k[b]`. Everything happens on the device, on `dev`'s stream, with no host
/// synchronization: a decode step (append, then [`crate::Plan::run`] on the paged problem) can
/// be captured in a CUDA graph and replayed, each replay appending at the advanced positions.
///
/// Shapes, dtypes and buffer lengths are checked against `p` (a paged problem, f16 or bf16).
/// Positions live on the device, where the metadata is not trusted: a row whose position lies
/// outside `0..pages_per_seq · page_size` is dropped, a block-table entry outside the cache's
/// pages is clamped into them (the row lands in a wrong page of this cache, never outside it),
/// and `seqused_k[b]` never advances past `pages_per_seq · page_size` (nor below 0). With
/// `p.seqs.checked` the call first copies `seqused_k` and the block table to the host and
/// refuses such an append with a typed error instead.
pub fn append_kv(dev: &Device, p: &Problem, a: KvAppend<'_>) -> Result<()> {
    let p = p.checked()?;
    let KvRows::Paged {
        pages,
        page_size,
        pages_per_seq,
    } = p.seqs.kv
    else {
        return Err(invalid!(
            "append_kv needs a paged problem (Problem::with_paged_kv)"
        ));
    };
    if p.dtype == DType::E4m3 {
        return Err(invalid!("append_kv takes f16 or bf16 caches, not e4m3"));
    }
    // Past i32::MAX new rows a sequence the kernel's lengths (i32) could not advance.
    let new_len = (a.n_new <= i32::MAX as usize)
        .then(|| {
            p.batch
                .checked_mul(a.n_new)?
                .checked_mul(p.kv_heads)?
                .checked_mul(p.head_dim)
        })
        .flatten()
        .ok_or_else(|| {
            invalid!(
                "append_kv: {} new rows a sequence of {p} are more than a tensor can hold",
                a.n_new
            )
        })?;
    for (name, t, need) in [
        ("k_new", a.k_new, new_len),
        ("v_new", a.v_new, new_len),
        ("k_cache", &*a.k_cache, p.kv_elems()),
        ("v_cache", &*a.v_cache, p.kv_elems()),
    ] {
        if t.dtype() != p.dtype {
            return Err(invalid!(
                "{name} is {}, the problem says {}",
                t.dtype(),
                p.dtype
            ));
        }
        if t.len() < need {
            return Err(invalid!(
                "{name} holds {} elements, {p} needs {need}",
                t.len()
            ));
        }
        if !t.same_context(dev) {
            return Err(invalid!(
                "{name} lives on another GPU than the device handle"
            ));
        }
    }
    for (name, ctx, len, need) in [
        (
            "block_table",
            a.block_table.stream().context(),
            a.block_table.len(),
            p.block_table_len(),
        ),
        (
            "seqused_k",
            a.seqused_k.stream().context(),
            a.seqused_k.len(),
            p.batch,
        ),
    ] {
        if ctx != dev.ctx() {
            return Err(invalid!(
                "{name} lives on another GPU than the device handle"
            ));
        }
        if len < need {
            return Err(invalid!("{name} holds {len} values, {p} needs {need}"));
        }
    }
    if a.n_new == 0 {
        return Ok(());
    }
    if p.seqs.checked {
        let used = a.seqused_k.stream().clone_dtoh(&a.seqused_k)?;
        let table = a.block_table.stream().clone_dtoh(&a.block_table)?;
        let capacity = pages_per_seq * page_size; // no overflow: Seqs::validate
        for (b, &u) in used.iter().take(p.batch).enumerate() {
            let end = i64::from(u) + a.n_new as i64; // n_new <= i32::MAX: above
            if u < 0 || end > capacity as i64 {
                return Err(invalid!(
                    "append_kv: sequence {b} would hold {end} keys, its {pages_per_seq} pages \
                     of {page_size} hold {capacity}"
                ));
            }
            let row = &table[b * pages_per_seq..][..pages_per_seq];
            if let Some(&pg) = row[u as usize / page_size..(end as usize).div_ceil(page_size)]
                .iter()
                .find(|&&pg| pg < 0 || pg as usize >= pages)
            {
                return Err(invalid!(
                    "append_kv: sequence {b}'s block table names page {pg}, the cache has \
                     {pages}"
                ));
            }
        }
    }
    let streams: Vec<_> = [a.k_new, a.v_new, &*a.k_cache, &*a.v_cache]
        .into_iter()
        .flat_map(|t| t.streams())
        .chain([a.block_table.stream(), a.seqused_k.stream()])
        .cloned()
        .collect();
    let order = dev.order_after(&streams)?;
    let stream = dev.stream();
    let (table, _tg) = a.block_table.device_ptr(stream);
    let mut used = a.seqused_k;
    let (seqused, _ug) = used.device_ptr_mut(stream);
    let args = sdpa_sys::args::KvAppendArgs {
        k_new: a.k_new.ptr(dev),
        v_new: a.v_new.ptr(dev),
        k_cache: a.k_cache.ptr_mut(dev),
        v_cache: a.v_cache.ptr_mut(dev),
        block_table: table,
        seqused_k: seqused,
        batch: p.batch as i64,
        n_new: a.n_new as i64,
        kv_heads: p.kv_heads as i64,
        head_dim: p.head_dim as i64,
        page_size: page_size as i64,
        pages_per_seq: pages_per_seq as i64,
        pages: pages as i64,
        dtype: crate::ffi::dtype(p.dtype),
    };
    let raw = dev.raw_stream()?;
    // SAFETY: every buffer was checked above for its dtype, length and context against `p`;
    // positions past a sequence's pages are dropped by the kernel.
    let ran = unsafe { sdpa_sys::ffi::kv_append(&args, raw) }.map_err(Into::into);
    order.finish(ran)
}
