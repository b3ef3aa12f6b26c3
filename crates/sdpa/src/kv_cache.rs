//! Writing new keys and values into a paged K/V cache, on the device: the other half of a
//! decode step. [`write_kv`] takes the caller's cache (NHD or HND pages) and new rows, and
//! places them by slot (vLLM's `slot_mapping`) or after each sequence's keys with per-sequence
//! counts (FlashInfer's `append_paged_kv_cache`); [`append_kv`] appends the same count to every
//! sequence of a paged problem's own tensors (FlashAttention's `flash_attn_with_kvcache`).

use crate::device::Device;
use crate::error::{Result, invalid};
use crate::problem::{DType, Problem, Scaling};
use crate::seqs::{KvRows, PAGE_SIZES, PageLayout};
use crate::tensor::{Element, Tensor};
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use sdpa_sys::args::KvWriteArgs;
use std::sync::Arc;

/// A paged K/V cache in the caller's device memory: `pages` pages of `page_size` rows of
/// `kv_heads` heads of `head_dim` values, each page `[page_size, kv_heads, head_dim]` (NHD) or
/// `[kv_heads, page_size, head_dim]` (HND), pages one after another, K and V alike. Attention
/// reads it through a problem `with_paged_kv(pages, page_size, pages_per_seq)` and
/// `with_page_layout(layout)`, K and V as views at [`Problem::k_strides`] and [`Problem::v_strides`].
#[derive(Debug)]
pub struct PagedCache<'a, T> {
    /// The key cache.
    pub k: CudaViewMut<'a, T>,
    /// The value cache.
    pub v: CudaViewMut<'a, T>,
    /// Pages of the cache.
    pub pages: usize,
    /// Rows a page holds: a power of two from 16 to 256.
    pub page_size: usize,
    /// Heads of a row.
    pub kv_heads: usize,
    /// Values of a head: a multiple of 8.
    pub head_dim: usize,
    /// The order of a page's elements.
    pub layout: PageLayout,
}

impl<T> PagedCache<'_, T> {
    /// Elements of K (and of V): `None` on overflow.
    pub fn len(&self) -> Option<usize> {
        self.pages
            .checked_mul(self.page_size)?
            .checked_mul(self.kv_heads)?
            .checked_mul(self.head_dim)
    }
    /// Whether the cache holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }
    /// Element strides of (page, row in the page, head).
    pub fn strides(&self) -> [usize; 3] {
        self.layout
            .strides(self.page_size, self.kv_heads, self.head_dim)
    }
}

/// New K and V rows: `rows` rows of `kv_heads` heads of the cache's head_dim, head h of row r at
/// element `r · row_stride + h · head_stride` (a contiguous `[rows, kv_heads, head_dim]`
/// tensor: `kv_heads · head_dim` and `head_dim`). Strides are multiples of 8 elements.
#[derive(Debug)]
pub struct NewRows<'a, T> {
    /// New keys.
    pub k: CudaView<'a, T>,
    /// New values, at the same strides.
    pub v: CudaView<'a, T>,
    /// Rows to write.
    pub rows: usize,
    /// Elements between rows.
    pub row_stride: usize,
    /// Elements between heads of a row.
    pub head_stride: usize,
}

/// Where each new row goes.
#[derive(Debug)]
pub enum Placement<'a> {
    /// Row i to slot `slots[i]` (`[rows]`), page `slot / page_size`, offset `slot % page_size`
    /// (vLLM's `slot_mapping`); a negative slot (a padding row) writes nothing.
    Slots(CudaView<'a, i64>),
    /// After each sequence's keys: sequence b's rows `cu_new[b]..cu_new[b + 1]` (`[batch + 1]`)
    /// go to its positions `seqused_k[b]..` (`[batch]`), key j at offset `j % page_size` of page
    /// `block_table[b][j / page_size]` (`[batch, pages_per_seq]`); then `seqused_k[b]` grows by
    /// its rows (FlashInfer's `append_paged_kv_cache`).
    Append {
        /// `[batch + 1]` offsets of each sequence's rows in the new rows.
        cu_new: CudaView<'a, i32>,
        /// `[batch, pages_per_seq]` pages of each sequence.
        block_table: CudaView<'a, i32>,
        /// Columns of the block table.
        pages_per_seq: usize,
        /// `[batch]` keys of each sequence in the cache, advanced by the write.
        seqused_k: CudaViewMut<'a, i32>,
    },
}

/// Writes `new`'s rows into `cache` where `at` places them, on `dev`'s stream with no host
/// synchronization (capturable in a CUDA graph with the attention that reads the cache).
///
/// Shapes, strides, lengths, alignment and devices are checked on the host. The placement's
/// values live on the device, where they are not trusted: a slot outside the cache, or a
/// position outside its sequence's `pages_per_seq · page_size` keys, drops the row; a
/// block-table entry outside the cache's pages is clamped into them (the row lands in a wrong
/// page of this cache, never outside it); and `seqused_k[b]` stays within `0..=pages_per_seq ·
/// page_size`. Each row lands at most once (with offsets that overlap, in one of its
/// sequences).
///
/// A decode step of two requests, one new token each, into an HND cache of 16-row pages, then
/// attention over it:
///
/// ```no_run
/// use half::bf16;
/// use sdpa::{Backend, Extras, NewRows, PageLayout, PagedCache, Placement, Problem, View};
/// # fn main() -> sdpa::Result<()> {
/// let dev = sdpa::Device::new(0)?;
/// let s = dev.stream();
/// let (pages, page_size, kv_heads, d) = (64, 16, 8, 128);
/// let len = pages * page_size * kv_heads * d;
/// let (mut kc, mut vc) = (s.alloc_zeros::<bf16>(len)?, s.alloc_zeros::<bf16>(len)?);
/// let (kn, vn) = (s.alloc_zeros::<bf16>(2 * kv_heads * d)?, s.alloc_zeros::<bf16>(2 * kv_heads * d)?);
/// let slots = s.clone_htod(&[3 * 16 + 5i64, 7 * 16])?; // (page 3, row 5) and (page 7, row 0)
/// sdpa::write_kv(
///     &dev,
///     PagedCache { k: kc.as_view_mut(), v: vc.as_view_mut(), pages, page_size, kv_heads,
///                  head_dim: d, layout: PageLayout::Hnd },
///     NewRows { k: kn.as_view(), v: vn.as_view(), rows: 2, row_stride: kv_heads * d,
///               head_stride: d },
///     Placement::Slots(slots.as_view()),
/// )?;
/// // The same buffers as attention's K and V.
/// let p = Problem::new(2, 32, 1, 1024, d).with_kv_heads(kv_heads)
///     .with_layout(sdpa::Layout::Bshd)
///     .with_paged_kv(pages, page_size, 64).with_page_layout(PageLayout::Hnd);
/// let (k, v) = (View::new(kc.as_view(), p.k_strides()), View::new(vc.as_view(), p.v_strides()));
/// # let _ = (k, v, Backend::Auto, Extras::default());
/// # Ok(())
/// # }
/// ```
pub fn write_kv<T: Element>(
    dev: &Device,
    cache: PagedCache<'_, T>,
    new: NewRows<'_, T>,
    at: Placement<'_>,
) -> Result<()> {
    write_rows(dev, cache, None, new, at)
}

/// The dequantization scales of an e4m3 cache (real value = code · scale): one for K and one
/// for V ([`Scaling::PerTensor`], vLLM's `k_scale` / `v_scale`), or one per K/V head
/// ([`Scaling::PerHead`], `[kv_heads]`: a paged cache's per-head layout, the one a problem
/// `with_paged_kv` and `with_kv_dtype(DType::E4m3)` reads), device f32.
#[derive(Debug)]
pub struct KvScales<'a> {
    /// K's scales.
    pub k: CudaView<'a, f32>,
    /// V's scales.
    pub v: CudaView<'a, f32>,
    /// One a tensor or one a K/V head.
    pub scaling: Scaling,
}

/// [`write_kv`] into an e4m3 cache ([`crate::Problem::with_kv_dtype`]): each new 16-bit value x
/// of K/V head h is stored as the code E4M3(x / scale) with that head's scale (f32 division,
/// round to nearest even, saturating to ±448, NaN kept as NaN: [`crate::fp8::e4m3_from_f32`]
/// bit for bit). The scales are the caller's, fixed for the cache's life (calibrated, or
/// FlashInfer's and vLLM's static scales); values beyond 448 · scale saturate. Placement,
/// checks and ordering are [`write_kv`]'s; head_dim must be a multiple of 16 (the attention
/// kernels read rows of codes 16 bytes at a time).
///
/// ```no_run
/// use half::bf16;
/// use sdpa::{KvScales, NewRows, PageLayout, PagedCache, Placement, Scaling};
/// # fn main() -> sdpa::Result<()> {
/// let dev = sdpa::Device::new(0)?;
/// let s = dev.stream();
/// let (pages, page_size, kv_heads, d) = (64, 16, 8, 128);
/// let len = pages * page_size * kv_heads * d;
/// let (mut kc, mut vc) = (s.alloc_zeros::<u8>(len)?, s.alloc_zeros::<u8>(len)?);
/// let (k_scale, v_scale) = (s.clone_htod(&[0.02f32; 8])?, s.clone_htod(&[0.01f32; 8])?);
/// let (kn, vn) = (s.alloc_zeros::<bf16>(kv_heads * d)?, s.alloc_zeros::<bf16>(kv_heads * d)?);
/// let slots = s.clone_htod(&[3 * 16 + 5i64])?; // page 3, row 5
/// sdpa::write_kv_fp8(
///     &dev,
///     PagedCache { k: kc.as_view_mut(), v: vc.as_view_mut(), pages, page_size, kv_heads,
///                  head_dim: d, layout: PageLayout::Nhd },
///     KvScales { k: k_scale.as_view(), v: v_scale.as_view(), scaling: Scaling::PerHead },
///     NewRows { k: kn.as_view(), v: vn.as_view(), rows: 1, row_stride: kv_heads * d,
///               head_stride: d },
///     Placement::Slots(slots.as_view()),
/// )?;
/// # Ok(())
/// # }
/// ```
pub fn write_kv_fp8<T: Element>(
    dev: &Device,
    cache: PagedCache<'_, u8>,
    scales: KvScales<'_>,
    new: NewRows<'_, T>,
    at: Placement<'_>,
) -> Result<()> {
    write_rows(dev, cache, Some(scales), new, at)
}

/// [`write_kv`] and [`write_kv_fp8`]: a cache of `C` (T itself, or u8 e4m3 codes with `scales`).
fn write_rows<T: Element, C: cudarc::driver::DeviceRepr>(
    dev: &Device,
    cache: PagedCache<'_, C>,
    scales: Option<KvScales<'_>>,
    new: NewRows<'_, T>,
    at: Placement<'_>,
) -> Result<()> {
    if !matches!(T::DTYPE, DType::F16 | DType::Bf16) {
        return Err(invalid!(
            "write_kv writes f16 or bf16 rows, not {}",
            T::DTYPE
        ));
    }
    let (pages, page_size, heads, d) =
        (cache.pages, cache.page_size, cache.kv_heads, cache.head_dim);
    // Rows of 16 bytes: 8 16-bit values, 16 e4m3 codes.
    let unit = if scales.is_some() { 16 } else { 8 };
    if pages == 0 || heads == 0 || d == 0 || !d.is_multiple_of(unit) {
        return Err(invalid!(
            "write_kv: a cache of {pages} pages, {heads} kv heads of head_dim {d}; each must be \
             at least 1, head_dim a multiple of {unit}"
        ));
    }
    if !page_size.is_power_of_two() || !PAGE_SIZES.contains(&page_size) {
        return Err(invalid!(
            "write_kv: page_size must be a power of two from 16 to 256, got {page_size}"
        ));
    }
    if heads > 65535 || new.rows > i32::MAX as usize {
        return Err(invalid!(
            "write_kv: {heads} kv heads and {} rows; at most 65535 heads and 2^31 - 1 rows",
            new.rows
        ));
    }
    let cache_len = cache
        .len()
        .ok_or_else(|| invalid!("write_kv: the cache's size overflows"))?;
    let new_len = match new.rows {
        0 => Some(0),
        n => (n - 1)
            .checked_mul(new.row_stride)
            .and_then(|r| r.checked_add((heads - 1).checked_mul(new.head_stride)?))
            .and_then(|r| r.checked_add(d)),
    }
    .ok_or_else(|| invalid!("write_kv: the new rows' extent overflows"))?;
    if !new.row_stride.is_multiple_of(8) || !new.head_stride.is_multiple_of(8) {
        return Err(invalid!(
            "write_kv: the new rows' strides {} and {} must be multiples of 8 elements (16 \
             bytes): rows are copied 16 bytes at a time",
            new.row_stride,
            new.head_stride
        ));
    }
    let stream = dev.stream();
    let mut ptrs = Vec::new();
    for (name, len, need, s, ptr) in [
        (
            "k_new",
            new.k.len(),
            new_len,
            new.k.stream(),
            new.k.device_ptr(stream).0,
        ),
        (
            "v_new",
            new.v.len(),
            new_len,
            new.v.stream(),
            new.v.device_ptr(stream).0,
        ),
        (
            "k_cache",
            cache.k.len(),
            cache_len,
            cache.k.stream(),
            cache.k.device_ptr(stream).0,
        ),
        (
            "v_cache",
            cache.v.len(),
            cache_len,
            cache.v.stream(),
            cache.v.device_ptr(stream).0,
        ),
    ] {
        check_buffer(dev, name, len, need, s)?;
        if !ptr.is_multiple_of(16) {
            return Err(invalid!(
                "write_kv: {name} starts at {ptr:#x}, not a multiple of 16 bytes"
            ));
        }
        ptrs.push(ptr);
    }
    let [page_stride, row_stride, head_stride] = cache.strides();
    let mut streams = vec![
        new.k.stream().clone(),
        new.v.stream().clone(),
        cache.k.stream().clone(),
        cache.v.stream().clone(),
    ];
    let (cache_dtype, k_scale, v_scale, per_head_scales) = match &scales {
        None => (T::DTYPE, 0, 0, false),
        Some(sc) => {
            let need = match sc.scaling {
                Scaling::PerTensor => 1,
                Scaling::PerHead => heads,
            };
            check_buffer(dev, "k's scales", sc.k.len(), need, sc.k.stream())?;
            check_buffer(dev, "v's scales", sc.v.len(), need, sc.v.stream())?;
            streams.extend([sc.k.stream().clone(), sc.v.stream().clone()]);
            (
                DType::E4m3,
                sc.k.device_ptr(stream).0,
                sc.v.device_ptr(stream).0,
                sc.scaling == Scaling::PerHead,
            )
        }
    };
    let mut args = KvWriteArgs {
        k_new: ptrs[0],
        v_new: ptrs[1],
        new_row_stride: new.row_stride as i64,
        new_head_stride: new.head_stride as i64,
        rows: new.rows as i64,
        k_cache: ptrs[2],
        v_cache: ptrs[3],
        pages: pages as i64,
        page_size: page_size as i64,
        page_stride: page_stride as i64,
        row_stride: row_stride as i64,
        head_stride: head_stride as i64,
        kv_heads: heads as i64,
        head_dim: d as i64,
        slots: 0,
        batch: 0,
        cu_new: 0,
        n_new: 0,
        block_table: 0,
        pages_per_seq: 0,
        seqused_k: 0,
        dtype: crate::ffi::dtype(T::DTYPE),
        cache_dtype: crate::ffi::dtype(cache_dtype),
        k_scale,
        v_scale,
        per_head_scales,
    };
    match at {
        Placement::Slots(slots) => {
            check_buffer(dev, "slots", slots.len(), new.rows, slots.stream())?;
            streams.push(slots.stream().clone());
            args.slots = slots.device_ptr(stream).0;
            launch(dev, &args, &streams)
        }
        Placement::Append {
            cu_new,
            block_table,
            pages_per_seq,
            mut seqused_k,
        } => {
            let batch = cu_new.len().saturating_sub(1);
            if batch == 0 {
                return Err(invalid!(
                    "write_kv: cu_new holds {} offsets; batch + 1 is at least 2",
                    cu_new.len()
                ));
            }
            if pages_per_seq == 0
                || pages_per_seq
                    .checked_mul(page_size)
                    .is_none_or(|n| n > i32::MAX as usize)
            {
                return Err(invalid!(
                    "write_kv: {pages_per_seq} pages a sequence of {page_size} rows; at least \
                     one, and fewer than 2^31 rows"
                ));
            }
            check_buffer(dev, "cu_new", cu_new.len(), batch + 1, cu_new.stream())?;
            let table_len = batch
                .checked_mul(pages_per_seq)
                .ok_or_else(|| invalid!("write_kv: the block table's size overflows"))?;
            check_buffer(
                dev,
                "block_table",
                block_table.len(),
                table_len,
                block_table.stream(),
            )?;
            check_buffer(dev, "seqused_k", seqused_k.len(), batch, seqused_k.stream())?;
            streams.extend([
                cu_new.stream().clone(),
                block_table.stream().clone(),
                seqused_k.stream().clone(),
            ]);
            args.batch = batch as i64;
            args.cu_new = cu_new.device_ptr(stream).0;
            args.block_table = block_table.device_ptr(stream).0;
            args.pages_per_seq = pages_per_seq as i64;
            args.seqused_k = seqused_k.device_ptr_mut(stream).0;
            launch(dev, &args, &streams)
        }
    }
}

/// That a buffer of `len` elements holds `need`, on `dev`'s GPU.
fn check_buffer(
    dev: &Device,
    name: &str,
    len: usize,
    need: usize,
    s: &Arc<CudaStream>,
) -> Result<()> {
    if s.context() != dev.ctx() {
        return Err(invalid!(
            "{name} lives on another GPU than the device handle"
        ));
    }
    if len < need {
        return Err(invalid!(
            "write_kv: {name} holds {len} elements, the write needs {need}"
        ));
    }
    Ok(())
}

/// The write of `args` on `dev`'s stream, after the work already queued on `streams`.
fn launch(dev: &Device, args: &KvWriteArgs, streams: &[Arc<CudaStream>]) -> Result<()> {
    let order = dev.order_after(streams)?;
    let raw = dev.raw_stream()?;
    // SAFETY: every buffer of `args` was checked for its length, alignment and context; the
    // kernel drops or clamps whatever the device-side metadata would place outside them.
    let ran = unsafe { sdpa_sys::ffi::kv_write(args, &dev.info(), raw) }.map_err(Into::into);
    order.finish(ran)
}

/// One append: `n_new` new rows of each sequence into the cache a paged problem reads.
#[derive(Debug)]
pub struct KvAppend<'a> {
    /// New keys, `[batch, n_new, kv_heads, head_dim]`, of the problem's dtype.
    pub k_new: &'a Tensor,
    /// New values, the same shape.
    pub v_new: &'a Tensor,
    /// New rows a sequence.
    pub n_new: usize,
    /// The key cache, `[pages, page_size, kv_heads, head_dim]` (`p.k_len()` elements).
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
///
/// Two sequences of a paged cache (8 pages of 64 keys, 4 a sequence) take one new token each:
///
/// ```no_run
/// use sdpa::{DType, Device, KvAppend, Layout, Problem, Tensor};
/// # fn main() -> sdpa::Result<()> {
/// let dev = Device::new(0)?;
/// let p = Problem::new(2, 32, 1, 256, 128).with_kv_heads(8).with_layout(Layout::Bshd)
///     .with_paged_kv(8, 64, 4);
/// let mut k_cache = Tensor::zeros(&dev, DType::F16, p.k_len().unwrap())?;
/// let mut v_cache = Tensor::zeros(&dev, DType::F16, p.v_len().unwrap())?;
/// let table = dev.stream().clone_htod(&[0i32, 1, 2, 3, 4, 5, 6, 7])?;
/// let mut seqused = dev.stream().clone_htod(&[10i32, 70])?; // the keys each sequence holds
/// let k_new = Tensor::zeros(&dev, DType::F16, 2 * 8 * 128)?; // [batch, n_new, kv_heads, head_dim]
/// let v_new = Tensor::zeros(&dev, DType::F16, 2 * 8 * 128)?;
/// let append = KvAppend {
///     k_new: &k_new,
///     v_new: &v_new,
///     n_new: 1,
///     k_cache: &mut k_cache,
///     v_cache: &mut v_cache,
///     block_table: table.as_view(),
///     seqused_k: seqused.as_view_mut(),
/// };
/// sdpa::append_kv(&dev, &p, append)?; // keys 10 and 70 written; seqused_k now [11, 71]
/// # Ok(())
/// # }
/// ```
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
        return Err(invalid!(
            "append_kv takes f16 or bf16 rows, the problem's Q/K/V are e4m3 (an e4m3 cache \
             under 16-bit Q: Problem::with_kv_dtype)"
        ));
    }
    let kv_dtype = p.kv_dtype();
    if kv_dtype == DType::E4m3 && !p.head_dim.is_multiple_of(16) {
        return Err(invalid!(
            "append_kv: an e4m3 cache's head_dim must be a multiple of 16, got {}",
            p.head_dim
        ));
    }
    if p.v_dim() != p.head_dim {
        return Err(invalid!(
            "append_kv writes caches of one head dim; {p} has head_dim {} and head_dim_v {}",
            p.head_dim,
            p.v_dim()
        ));
    }
    if p.v_in_k {
        return Err(invalid!(
            "append_kv writes K and V caches of their own; {p} reads V from K's rows (append its \
             latent rows as K with a problem without with_v_in_k)"
        ));
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
    for (name, t, need, dtype, shape) in [
        ("k_new", a.k_new, new_len, p.dtype, p.k_shape()),
        ("v_new", a.v_new, new_len, p.dtype, p.v_shape()),
        (
            "k_cache",
            &*a.k_cache,
            p.k_len().unwrap_or_default(),
            kv_dtype,
            p.k_shape(),
        ),
        (
            "v_cache",
            &*a.v_cache,
            p.v_len().unwrap_or_default(),
            kv_dtype,
            p.v_shape(),
        ),
    ] {
        if t.dtype() != dtype {
            return Err(invalid!(
                "{name} is {}, the problem says {dtype}",
                t.dtype()
            ));
        }
        if let Some((scaling, layout)) = t.fp8_layout()
            && (scaling != p.fp8_scaling || layout != shape)
        {
            return Err(invalid!(
                "{name}'s scales are {} over {layout}, the problem's cache has {} scales over \
                 {shape}",
                scaling.name(),
                p.fp8_scaling.name()
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
    let stream = dev.stream();
    let (table, _tg) = a.block_table.device_ptr(stream);
    let mut used = a.seqused_k;
    let (seqused, _ug) = used.device_ptr_mut(stream);
    let (heads, d) = (p.kv_heads as i64, p.head_dim as i64);
    // The problem's own cache, in its page layout.
    let [_, row_stride, head_stride] = p
        .seqs
        .page_layout
        .strides(page_size, p.kv_heads, p.head_dim);
    let args = KvWriteArgs {
        k_new: a.k_new.ptr(dev),
        v_new: a.v_new.ptr(dev),
        new_row_stride: heads * d,
        new_head_stride: d,
        rows: (p.batch * a.n_new) as i64, // below new_len: no overflow
        k_cache: a.k_cache.ptr_mut(dev),
        v_cache: a.v_cache.ptr_mut(dev),
        pages: pages as i64,
        page_size: page_size as i64,
        page_stride: page_size as i64 * heads * d,
        row_stride: row_stride as i64,
        head_stride: head_stride as i64,
        kv_heads: heads,
        head_dim: d,
        slots: 0,
        batch: p.batch as i64,
        cu_new: 0,
        n_new: a.n_new as i64,
        block_table: table,
        pages_per_seq: pages_per_seq as i64,
        seqused_k: seqused,
        dtype: crate::ffi::dtype(p.dtype),
        cache_dtype: crate::ffi::dtype(kv_dtype),
        // An e4m3 cache's own scales ([kv_heads] per head: a paged cache's k_shape).
        k_scale: if p.is_fp8_kv() {
            a.k_cache.scales_ptr(dev)
        } else {
            0
        },
        v_scale: if p.is_fp8_kv() {
            a.v_cache.scales_ptr(dev)
        } else {
            0
        },
        per_head_scales: p.is_fp8_kv() && p.fp8_scaling == Scaling::PerHead,
    };
    launch(dev, &args, &streams)
}
