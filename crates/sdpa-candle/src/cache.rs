//! Writing new keys and values into a paged K/V cache held in candle tensors, in place: the
//! write half of a decode step, beside [`crate::flash_attn_varlen_paged_windowed`] which reads
//! the cache.
//!
//! candle hands an op one tensor's storage mutably (`Tensor::inplace_op3`), and a write touches
//! two caches. Both are reached soundly, through candle's own locks:
//! - K and V in one allocation (vLLM's `(2, pages, page_size, kv_heads, head_dim)` cache, K and
//!   V its two halves): the op writes that one storage, split into the two disjoint ranges the
//!   layouts address (`split_at_mut`), after checking they do not overlap;
//! - K and V in two allocations (candle-vllm's and mistral.rs's `key_cache`, `value_cache`):
//!   the op on K's storage applies a second in-place op on V's storage from inside, which
//!   receives V mutably and writes both.
//!
//! The new rows and the slots must live in allocations of their own (not views of a cache):
//! the op holds the caches' write locks while it reads them.

use crate::host;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp3, Layout, Result, Tensor, bail};
use sdpa::PageLayout;
use std::cell::Cell;
use std::ops::Range;

/// Writes row i of `k_new` and `v_new` (`(rows, kv_heads, head_dim)`, head_dim contiguous, both
/// at the same strides) into `k_cache` and `v_cache` (`(pages, page_size, kv_heads, head_dim)`)
/// at slot `slots[i]` (i64 `(rows,)`, contiguous): page `slot / page_size`, row `slot %
/// page_size` of that page. A negative slot (a padding row) writes nothing, and so does a slot
/// past the cache. These are vLLM's `reshape_and_cache_flash` semantics (its `slot_mapping`).
///
/// The caches are f16 or bf16, the new rows of the same dtype; each cache is contiguous (NHD
/// pages) or a `(pages, kv_heads, page_size, head_dim)` cache transposed to this shape (HND
/// pages), K and V alike; page_size is a power of two from 16 to 256 and head_dim a multiple of
/// 8, as [`crate::flash_attn_varlen_paged_windowed`] reads them. K and V may be two tensors or
/// two halves of one (`kv.get(0)`, `kv.get(1)`); see the module notes for how each is written.
///
/// On a CUDA device the write is one [`sdpa::write_kv`] on candle's buffers, queued on candle's
/// stream with no synchronisation (the slots are read on the device, unchecked beyond what is
/// said above); on the CPU a host copy. Shapes, dtypes, devices and strides are checked first,
/// each mismatch an error.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// // 4 pages of 16 rows, 2 KV heads of 64, K and V in one tensor as vLLM holds them.
/// let kv = Tensor::zeros((2, 4, 16, 2, 64), DType::BF16, &dev)?;
/// let (k_cache, v_cache) = (kv.get(0)?, kv.get(1)?);
/// let k_new = Tensor::ones((3, 2, 64), DType::BF16, &dev)?;
/// let v_new = Tensor::ones((3, 2, 64), DType::BF16, &dev)?;
/// // Rows to page 1 row 0, nowhere (padding), page 0 row 5.
/// let slots = Tensor::new(&[16i64, -1, 5], &dev)?;
/// sdpa_candle::write_kv(&k_cache, &v_cache, &k_new, &v_new, &slots)?;
/// assert_eq!(k_cache.get(1)?.get(0)?.sum_all()?.to_scalar::<half::bf16>()?.to_f32(), 128.0);
/// # Ok(())
/// # }
/// ```
pub fn write_kv(
    k_cache: &Tensor,
    v_cache: &Tensor,
    k_new: &Tensor,
    v_new: &Tensor,
    slots: &Tensor,
) -> Result<()> {
    let geometry = Geometry::new(k_cache, v_cache, k_new, v_new, slots)?;
    if geometry.rows == 0 {
        return Ok(());
    }
    let key = storage_key;
    for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
        if [key(k_cache), key(v_cache)].contains(&key(t)) {
            bail!("sdpa-candle: {name} shares its storage with a cache; write a copy of it");
        }
    }
    let v = if key(k_cache) == key(v_cache) {
        let (k_range, v_range) = (
            geometry.cache_range(k_cache.layout()),
            geometry.cache_range(v_cache.layout()),
        );
        if k_range.start < v_range.end && v_range.start < k_range.end {
            bail!("sdpa-candle: k_cache and v_cache overlap; they must be distinct");
        }
        Values::Shared(v_cache.layout().clone())
    } else {
        Values::Distinct(v_cache)
    };
    let op = WriteKv { geometry, v, slots };
    k_cache.inplace_op3(k_new, v_new, &op)
}

/// An identity of a tensor's storage, equal for tensors that share an allocation: the address
/// of the storage behind its lock (which the tensor keeps alive), read under a brief read lock.
fn storage_key(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref(&*storage).addr()
}

/// The sizes and strides of one write, checked.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    pages: usize,
    page_size: usize,
    kv_heads: usize,
    head_dim: usize,
    layout: PageLayout,
    rows: usize,
    /// Elements between the new rows, and between heads of a new row.
    new_strides: (usize, usize),
}

impl Geometry {
    fn new(
        k_cache: &Tensor,
        v_cache: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        slots: &Tensor,
    ) -> Result<Self> {
        let dtype = k_cache.dtype();
        host::sdpa_dtype(dtype)?;
        for (name, t) in [("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)] {
            if t.dtype() != dtype {
                bail!(
                    "sdpa-candle: k_cache is {dtype:?} and {name} {:?}; they must match",
                    t.dtype()
                );
            }
        }
        if slots.dtype() != DType::I64 {
            bail!(
                "sdpa-candle: slots hold {:?}; they must hold i64 (page · page_size + row)",
                slots.dtype()
            );
        }
        for (name, t) in [
            ("v_cache", v_cache),
            ("k_new", k_new),
            ("v_new", v_new),
            ("slots", slots),
        ] {
            if !t.device().same_device(k_cache.device()) {
                bail!("sdpa-candle: {name} must be on k_cache's device");
            }
        }
        let (pages, page_size, kv_heads, head_dim) = k_cache.dims4().map_err(|e| {
            e.context("sdpa-candle: k_cache must be (pages, page_size, kv_heads, head_dim)")
        })?;
        if v_cache.dims() != k_cache.dims() {
            bail!(
                "sdpa-candle: k_cache is {:?} and v_cache {:?}; they must match",
                k_cache.shape(),
                v_cache.shape()
            );
        }
        let layout = cache_layout("k_cache", k_cache.layout())?;
        if cache_layout("v_cache", v_cache.layout())? != layout {
            bail!("sdpa-candle: k_cache and v_cache must store their pages alike (NHD or HND)");
        }
        if !page_size.is_power_of_two() || !sdpa::seqs::PAGE_SIZES.contains(&page_size) {
            bail!("sdpa-candle: page_size must be a power of two from 16 to 256, got {page_size}");
        }
        if pages == 0 || kv_heads == 0 || head_dim == 0 || !head_dim.is_multiple_of(8) {
            bail!(
                "sdpa-candle: a cache of {pages} pages, {kv_heads} kv heads of head_dim \
                 {head_dim}; each at least 1, head_dim a multiple of 8"
            );
        }
        let (rows, h, d) = k_new
            .dims3()
            .map_err(|e| e.context("sdpa-candle: k_new must be (rows, kv_heads, head_dim)"))?;
        if v_new.dims() != k_new.dims() || (h, d) != (kv_heads, head_dim) {
            bail!(
                "sdpa-candle: k_new is {:?} and v_new {:?}; both must be (rows, {kv_heads}, \
                 {head_dim}) for a cache of {kv_heads} kv heads of {head_dim}",
                k_new.shape(),
                v_new.shape()
            );
        }
        let (ks, vs) = (k_new.stride(), v_new.stride());
        if ks != vs {
            bail!("sdpa-candle: k_new's strides {ks:?} and v_new's {vs:?} must match");
        }
        if ks[2] != 1 || !ks[0].is_multiple_of(8) || !ks[1].is_multiple_of(8) {
            bail!(
                "sdpa-candle: k_new and v_new need a contiguous head_dim and row and head \
                 strides that are multiples of 8 elements; strides {ks:?}"
            );
        }
        let n = slots
            .dims1()
            .map_err(|e| e.context("sdpa-candle: slots must be (rows,)"))?;
        if n != rows {
            bail!("sdpa-candle: {n} slots for {rows} new rows; one slot a row");
        }
        if !slots.is_contiguous() {
            bail!("sdpa-candle: slots must be contiguous");
        }
        Ok(Geometry {
            pages,
            page_size,
            kv_heads,
            head_dim,
            layout,
            rows,
            new_strides: (ks[0], ks[1]),
        })
    }

    /// Elements of one cache.
    fn cache_len(&self) -> usize {
        self.pages * self.page_size * self.kv_heads * self.head_dim
    }

    /// The elements of its storage a new-rows tensor reads from.
    fn new_region(&self, l: &Layout) -> Range<usize> {
        let (row, head) = self.new_strides;
        let start = l.start_offset();
        start..start + (self.rows - 1) * row + (self.kv_heads - 1) * head + self.head_dim
    }

    /// Element strides of (page, row of a page, head) in a cache.
    fn cache_strides(&self) -> [usize; 3] {
        self.layout
            .strides(self.page_size, self.kv_heads, self.head_dim)
    }
}

/// How a `(pages, page_size, kv_heads, head_dim)` cache lays out its pages (`host::paged_layout`),
/// which must also follow each other with no gap: contiguous (NHD), or a contiguous `(pages,
/// kv_heads, page_size, head_dim)` transposed (HND), as `sdpa::PagedCache` takes them.
fn cache_layout(name: &str, l: &Layout) -> Result<PageLayout> {
    let (layout, _) = host::paged_layout(name, l)?;
    let (d, s) = (l.dims(), l.stride());
    if s[..3] != layout.strides(d[1], d[2], d[3]) {
        bail!(
            "sdpa-candle: {name} must be a contiguous (pages, page_size, kv_heads, head_dim) \
             cache, or a contiguous (pages, kv_heads, page_size, head_dim) one transposed to \
             that shape; strides {s:?} of shape {:?} are neither",
            l.shape()
        );
    }
    Ok(layout)
}

/// Where the value cache lies.
enum Values<'t> {
    /// In the key cache's storage, at this layout.
    Shared(Layout),
    /// In a storage of its own.
    Distinct(&'t Tensor),
}

/// The in-place op on the key cache's storage, with the new K and V rows as its sources.
struct WriteKv<'t> {
    geometry: Geometry,
    v: Values<'t>,
    slots: &'t Tensor,
}

impl InplaceOp3 for WriteKv<'_> {
    fn name(&self) -> &'static str {
        "sdpa-write-kv"
    }

    fn cpu_fwd(
        &self,
        k: &mut CpuStorage,
        k_l: &Layout,
        k_new: &CpuStorage,
        kn_l: &Layout,
        v_new: &CpuStorage,
        vn_l: &Layout,
    ) -> Result<()> {
        let new = New {
            k: (k_new, kn_l),
            v: (v_new, vn_l),
        };
        match &self.v {
            Values::Shared(v_l) => cpu_write(self, Caches::Shared(k, k_l, v_l), new),
            Values::Distinct(v_cache) => v_cache.inplace_op1(&ValueCache {
                op: self,
                k: Cell::new(Some(KeyCache::Cpu(k, k_l))),
                new: Cell::new(Some(NewAny::Cpu(new))),
            }),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        k: &mut candle_core::CudaStorage,
        k_l: &Layout,
        k_new: &candle_core::CudaStorage,
        kn_l: &Layout,
        v_new: &candle_core::CudaStorage,
        vn_l: &Layout,
    ) -> Result<()> {
        let new = New {
            k: (k_new, kn_l),
            v: (v_new, vn_l),
        };
        match &self.v {
            Values::Shared(v_l) => gpu::write(self, gpu::Caches::Shared(k, k_l, v_l), new),
            Values::Distinct(v_cache) => v_cache.inplace_op1(&ValueCache {
                op: self,
                k: Cell::new(Some(KeyCache::Cuda(k, k_l))),
                new: Cell::new(Some(NewAny::Cuda(new))),
            }),
        }
    }
}

/// The new K and V rows' storage and layouts.
struct New<'a, S> {
    k: (&'a S, &'a Layout),
    v: (&'a S, &'a Layout),
}

/// The key cache's storage, held mutably while the op on the value cache runs.
enum KeyCache<'a> {
    Cpu(&'a mut CpuStorage, &'a Layout),
    #[cfg(feature = "cuda")]
    Cuda(&'a mut candle_core::CudaStorage, &'a Layout),
}

/// The new rows on either device.
enum NewAny<'a> {
    Cpu(New<'a, CpuStorage>),
    #[cfg(feature = "cuda")]
    Cuda(New<'a, candle_core::CudaStorage>),
}

/// The in-place op on a value cache of its own storage, applied from inside the op on the key
/// cache: it receives V's storage mutably and writes both caches. The cells hand over what the
/// outer op holds (taken once: the op runs once).
struct ValueCache<'a, 't> {
    op: &'a WriteKv<'t>,
    k: Cell<Option<KeyCache<'a>>>,
    new: Cell<Option<NewAny<'a>>>,
}

impl InplaceOp1 for ValueCache<'_, '_> {
    fn name(&self) -> &'static str {
        "sdpa-write-kv-values"
    }

    fn cpu_fwd(&self, v: &mut CpuStorage, v_l: &Layout) -> Result<()> {
        match (self.k.take(), self.new.take()) {
            (Some(KeyCache::Cpu(k, k_l)), Some(NewAny::Cpu(new))) => {
                cpu_write(self.op, Caches::Distinct((k, k_l), (v, v_l)), new)
            }
            _ => bail!("sdpa-candle: k_cache and v_cache must be on one device"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, v: &mut candle_core::CudaStorage, v_l: &Layout) -> Result<()> {
        match (self.k.take(), self.new.take()) {
            (Some(KeyCache::Cuda(k, k_l)), Some(NewAny::Cuda(new))) => {
                gpu::write(self.op, gpu::Caches::Distinct((k, k_l), (v, v_l)), new)
            }
            _ => bail!("sdpa-candle: k_cache and v_cache must be on one device"),
        }
    }
}

/// The two caches' CPU storage: one holding both, or one each.
enum Caches<'a> {
    Shared(&'a mut CpuStorage, &'a Layout, &'a Layout),
    Distinct(
        (&'a mut CpuStorage, &'a Layout),
        (&'a mut CpuStorage, &'a Layout),
    ),
}

/// The write on the CPU: each row copied head by head to its slot.
fn cpu_write(op: &WriteKv<'_>, caches: Caches<'_>, new: New<'_, CpuStorage>) -> Result<()> {
    let slots = op.slots.to_vec1::<i64>()?;
    let g = &op.geometry;
    let (kn, vn) = (g.new_region(new.k.1), g.new_region(new.v.1));
    macro_rules! write {
        ($variant:ident) => {{
            let (CpuStorage::$variant(k_new), CpuStorage::$variant(v_new)) = (new.k.0, new.v.0)
            else {
                bail!("sdpa-candle: k_new and v_new must have the caches' dtype")
            };
            let (k_new, v_new) = (part(k_new, kn, "k_new")?, part(v_new, vn, "v_new")?);
            match caches {
                Caches::Shared(CpuStorage::$variant(kv), k_l, v_l) => {
                    let (k, v) = two_mut(kv, g.cache_range(k_l), g.cache_range(v_l))?;
                    place(g, &slots, (k, v), (k_new, v_new))
                }
                Caches::Distinct(
                    (CpuStorage::$variant(k), k_l),
                    (CpuStorage::$variant(v), v_l),
                ) => {
                    let k = part_mut(k, g.cache_range(k_l), "k_cache")?;
                    let v = part_mut(v, g.cache_range(v_l), "v_cache")?;
                    place(g, &slots, (k, v), (k_new, v_new))
                }
                _ => bail!("sdpa-candle: k_cache and v_cache must have one dtype"),
            }
        }};
    }
    match new.k.0 {
        CpuStorage::BF16(_) => write!(BF16),
        CpuStorage::F16(_) => write!(F16),
        other => bail!("sdpa-candle: {:?} caches are not supported", other.dtype()),
    }
}

impl Geometry {
    /// The elements of its storage a cache at layout `l` occupies.
    fn cache_range(&self, l: &Layout) -> Range<usize> {
        let start = l.start_offset();
        start..start + self.cache_len()
    }
}

/// Rows to their slots in the caches (each the cache's own elements), new rows read from their
/// first element at the geometry's strides; slots negative or past the cache write nothing.
fn place<T: Copy>(
    g: &Geometry,
    slots: &[i64],
    (k, v): (&mut [T], &mut [T]),
    (k_new, v_new): (&[T], &[T]),
) -> Result<()> {
    let [page_stride, row_stride, head_stride] = g.cache_strides();
    let (new_row, new_head) = g.new_strides;
    let d = g.head_dim;
    let capacity = g.pages * g.page_size;
    for (i, &slot) in slots.iter().enumerate() {
        let Ok(slot) = usize::try_from(slot) else {
            continue;
        };
        if slot >= capacity {
            continue;
        }
        let at = (slot / g.page_size) * page_stride + (slot % g.page_size) * row_stride;
        for h in 0..g.kv_heads {
            let (dst, src) = (at + h * head_stride, i * new_row + h * new_head);
            k[dst..dst + d].copy_from_slice(&k_new[src..src + d]);
            v[dst..dst + d].copy_from_slice(&v_new[src..src + d]);
        }
    }
    Ok(())
}

/// `range` of `data`, or an error naming the tensor if its storage is shorter.
fn part<'a, T>(data: &'a [T], range: Range<usize>, name: &str) -> Result<&'a [T]> {
    match data.get(range) {
        Some(s) => Ok(s),
        None => bail!("sdpa-candle: {name}'s storage is shorter than its layout"),
    }
}

fn part_mut<'a, T>(data: &'a mut [T], range: Range<usize>, name: &str) -> Result<&'a mut [T]> {
    match data.get_mut(range) {
        Some(s) => Ok(s),
        None => bail!("sdpa-candle: {name}'s storage is shorter than its layout"),
    }
}

/// Two disjoint ranges of one buffer, mutably, in the order given.
fn two_mut<T>(data: &mut [T], a: Range<usize>, b: Range<usize>) -> Result<(&mut [T], &mut [T])> {
    let fits = a.end <= data.len() && b.end <= data.len();
    if !fits || (a.start < b.end && b.start < a.end) {
        bail!("sdpa-candle: k_cache and v_cache must be disjoint parts of their storage");
    }
    if a.start < b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        Ok((&mut lo[a], &mut hi[..b.end - b.start]))
    } else {
        let (lo, hi) = data.split_at_mut(a.start);
        Ok((&mut hi[..a.end - a.start], &mut lo[b]))
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    //! The write on the GPU: `sdpa::write_kv` on views of candle's buffers, on candle's stream.

    use super::{New, WriteKv};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{DType, Layout, Result, Storage, bail};
    use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
    use half::{bf16, f16};
    use sdpa::{NewRows, PagedCache, Placement};
    use std::ops::Range;

    /// The two caches' GPU storage: one holding both, or one each.
    pub(super) enum Caches<'a> {
        Shared(&'a mut CudaStorage, &'a Layout, &'a Layout),
        Distinct(
            (&'a mut CudaStorage, &'a Layout),
            (&'a mut CudaStorage, &'a Layout),
        ),
    }

    pub(super) fn write(
        op: &WriteKv<'_>,
        caches: Caches<'_>,
        new: New<'_, CudaStorage>,
    ) -> Result<()> {
        match new.k.0.dtype() {
            DType::BF16 => write_t::<bf16>(op, caches, new),
            DType::F16 => write_t::<f16>(op, caches, new),
            other => bail!("sdpa-candle: {other:?} caches are not supported"),
        }
    }

    fn write_t<T: sdpa::Element + CudaDType>(
        op: &WriteKv<'_>,
        caches: Caches<'_>,
        new: New<'_, CudaStorage>,
    ) -> Result<()> {
        let g = &op.geometry;
        let stream = new.k.0.device().cuda_stream();
        let (slots_s, slots_l) = op.slots.storage_and_layout();
        let Storage::Cuda(slots_c) = &*slots_s else {
            bail!("sdpa-candle: slots must be on the GPU with the caches");
        };
        let slots = view(
            slots_c.as_cuda_slice::<i64>()?,
            slots_l.start_offset()..slots_l.start_offset() + g.rows,
            "slots",
        )?;
        let k_new = view(
            new.k.0.as_cuda_slice::<T>()?,
            g.new_region(new.k.1),
            "k_new",
        )?;
        let v_new = view(
            new.v.0.as_cuda_slice::<T>()?,
            g.new_region(new.v.1),
            "v_new",
        )?;
        let rows = NewRows {
            k: k_new,
            v: v_new,
            rows: g.rows,
            row_stride: g.new_strides.0,
            head_stride: g.new_strides.1,
        };
        let dev = crate::cuda::handle(&stream)?;
        let cache = |k, v| PagedCache {
            k,
            v,
            pages: g.pages,
            page_size: g.page_size,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            layout: g.layout,
        };
        let ran = match caches {
            Caches::Shared(kv, k_l, v_l) => {
                // Two disjoint ranges of one buffer: split it where the later range starts.
                let (a, b) = (g.cache_range(k_l), g.cache_range(v_l));
                let s = kv.as_cuda_slice_mut::<T>()?;
                if a.end.max(b.end) > s.len() || (a.start < b.end && b.start < a.end) {
                    bail!(
                        "sdpa-candle: k_cache and v_cache must be disjoint parts of their storage"
                    );
                }
                let k_first = a.start < b.start;
                let (first, second) = if k_first { (a, b) } else { (b, a) };
                let (mut lo, mut hi) = s.split_at_mut(second.start);
                let (Some(x), Some(y)) = (
                    lo.try_slice_mut(first),
                    hi.try_slice_mut(..second.end - second.start),
                ) else {
                    bail!("sdpa-candle: a cache's storage is shorter than its layout");
                };
                let (k, v) = if k_first { (x, y) } else { (y, x) };
                sdpa::write_kv(&dev, cache(k, v), rows, Placement::Slots(slots))
            }
            Caches::Distinct((k, k_l), (v, v_l)) => {
                let k = view_mut(k.as_cuda_slice_mut::<T>()?, g.cache_range(k_l), "k_cache")?;
                let v = view_mut(v.as_cuda_slice_mut::<T>()?, g.cache_range(v_l), "v_cache")?;
                sdpa::write_kv(&dev, cache(k, v), rows, Placement::Slots(slots))
            }
        };
        ran.map_err(candle_core::Error::wrap)
    }

    fn view<'a, T>(
        s: &'a CudaSlice<T>,
        range: Range<usize>,
        name: &str,
    ) -> Result<CudaView<'a, T>> {
        match s.try_slice(range) {
            Some(v) => Ok(v),
            None => bail!("sdpa-candle: {name}'s storage is shorter than its layout"),
        }
    }

    fn view_mut<'a, T>(
        s: &'a mut CudaSlice<T>,
        range: Range<usize>,
        name: &str,
    ) -> Result<CudaViewMut<'a, T>> {
        match s.try_slice_mut(range) {
            Some(v) => Ok(v),
            None => bail!("sdpa-candle: {name}'s storage is shorter than its layout"),
        }
    }
}
