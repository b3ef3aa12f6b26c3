//! Batches of sequences of different lengths, packed without padding, and paged K/V caches:
//! candle-flash-attn's `flash_attn_varlen` functions on sdpa's packed Q and K/V
//! (`Problem::with_packed_q`, `with_packed_kv`) or paged cache (`with_paged_kv`), each sequence
//! attended on its own.

use crate::call::{self, Call, Meta, Resolve};
use crate::dense::{cap, window_mask};
use crate::host;
use candle_core::{DType, Layout, Result, Shape, Tensor, bail};
use sdpa::Problem;

/// Attention over a packed batch of sequences of different lengths, as candle-flash-attn's
/// `flash_attn_varlen`: Q is `(total_q, heads, head_dim)`, K and V `(total_k, kv_heads,
/// head_dim)` (`heads / kv_heads` query heads share each K/V head), and sequence b holds rows
/// `seqlens_q[b]..seqlens_q[b + 1]` of Q and `seqlens_k[b]..seqlens_k[b + 1]` of K and V.
/// `seqlens_q` and `seqlens_k` are u32 tensors of `batch + 1` cumulative offsets (`0, len_1,
/// len_1 + len_2, ..`) on Q's device; `max_seqlen_q` and `max_seqlen_k` are the longest
/// sequence's lengths. Each sequence is attended on its own, `softmax(softmax_scale · Q·Kᵀ +
/// mask) · V`, its causal mask aligned bottom-right to its own lengths (its query row i sees keys
/// j ≤ i + len_k − len_q, as FlashAttention). V may have a head dim of its own, which the output
/// takes. Returns a contiguous `(total_q, heads, head_dim_v)`
/// tensor of Q's dtype; a query row that sees no key (a sequence with no keys, or rows above
/// the causal diagonal) is zeros, and a batch with no query rows or no keys at all runs no
/// attention (its output is empty, or zeros).
///
/// On the CPU the offsets are checked (starting at 0, never decreasing, inside Q and K/V, no
/// sequence longer than its maximum). On the GPU they are read where they lie, unchecked, as
/// FlashAttention reads them: only their count is checked on the host, and each u32 is read as
/// an i32 (offsets must be below 2^31); bad values give wrong rows, never a read outside the
/// tensors. [`FlashAttnVarLen::checked`] checks them there too.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// // Two sequences: 3 and 5 queries, 4 and 6 keys.
/// let dev = Device::Cpu;
/// let q = Tensor::ones((8, 4, 64), DType::F16, &dev)?;
/// let kv = Tensor::ones((10, 2, 64), DType::F16, &dev)?;
/// let seqlens_q = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let seqlens_k = Tensor::new(&[0u32, 4, 10], &dev)?;
/// let (max_seqlen_q, max_seqlen_k) = (5, 6);
/// let out = sdpa_candle::flash_attn_varlen(
///     &q, &kv, &kv, &seqlens_q, &seqlens_k, max_seqlen_q, max_seqlen_k, 0.125, true,
/// )?;
/// assert_eq!(out.dims(), &[8, 4, 64]);
/// # Ok(())
/// # }
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttnVarLen::new(
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
    )
    .window(None, causal.then_some(0))
    .forward(q, k, v)
}

/// [`flash_attn_varlen`] with candle-flash-attn's window arguments, per sequence: its query row
/// i sees keys j with `i + len_k − len_q − left ≤ j ≤ i + len_k − len_q + right`, `None`
/// meaning no bound on that side (`None, Some(0)` is causal; Mistral's sliding window is
/// `Some(w), Some(0)`).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttnVarLen::new(
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
    )
    .window(window_size_left, window_size_right)
    .forward(q, k, v)
}

/// [`flash_attn_varlen_windowed`] on a paged K/V cache, for prefill or decode: K and V are
/// `(pages, page_block_size, kv_heads, head_dim)`, key j of sequence b lies at row
/// `j % page_block_size` of page `block_table[b][j / page_block_size]` (`block_table` u32 or
/// i32, `(batch, pages_per_seq)`, contiguous), and sequence b has `seqlens_k[b + 1] −
/// seqlens_k[b]` keys (its offsets count keys; where they lie is the block table's).
/// `page_block_size` is a power of two from 16 to 256 (FlashAttention takes multiples of 32;
/// 96, 160, 192 and 224 are refused here). The cache may also be stored head after head (HND,
/// `(pages, kv_heads, page_size, head_dim)`) and passed transposed to this shape.
/// `mm_prefix_ranges` (bidirectional spans inside a causal mask) is not supported: `Some` is an
/// error. Softcap as
/// [`flash_attn_varlen_alibi_windowed_softcap`].
///
/// A decode step of two sequences over a cache that [`crate::write_kv`] filled:
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// // 4 pages of 16 rows, 2 K/V heads of 64; sequence 0 owns pages 2 and 0, sequence 1 pages 1, 3.
/// let k_cache = Tensor::zeros((4, 16, 2, 64), DType::F16, &dev)?;
/// let v_cache = Tensor::zeros((4, 16, 2, 64), DType::F16, &dev)?;
/// let block_table = Tensor::new(&[[2u32, 0], [1, 3]], &dev)?;
/// // Sequence 0's 3 keys to page 2 rows 0..3, sequence 1's 2 keys to page 1 rows 0..2; each
/// // value row holds one number.
/// let slots = Tensor::new(&[32i64, 33, 34, 16, 17], &dev)?;
/// let k_new = Tensor::zeros((5, 2, 64), DType::F16, &dev)?;
/// let v_new = Tensor::new(&[1f32, 2.0, 3.0, 10.0, 20.0], &dev)?
///     .reshape((5, 1, 1))?
///     .broadcast_as((5, 2, 64))?
///     .to_dtype(DType::F16)?
///     .contiguous()?;
/// sdpa_candle::write_kv(&k_cache, &v_cache, &k_new, &v_new, &slots)?;
/// // One query token a sequence, 4 query heads; the sequences hold 3 and 2 keys.
/// let q = Tensor::zeros((2, 4, 64), DType::F16, &dev)?;
/// let seqlens_q = Tensor::new(&[0u32, 1, 2], &dev)?;
/// let seqlens_k = Tensor::new(&[0u32, 3, 5], &dev)?;
/// let out = sdpa_candle::flash_attn_varlen_paged_windowed(
///     &q, &k_cache, &v_cache, &seqlens_q, &seqlens_k, &block_table, None, 1, 3, 0.125,
///     None, Some(0), 16, None,
/// )?;
/// // Q is zero, so each sequence's output is the mean of its values.
/// let means = out.to_dtype(DType::F32)?.mean((1, 2))?.to_vec1::<f32>()?;
/// assert_eq!(means, [2.0, 15.0]);
/// # Ok(())
/// # }
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    if mm_prefix_ranges.is_some() {
        bail!("sdpa-candle: mm_prefix_ranges are not supported (pass None)");
    }
    FlashAttnVarLen {
        block_table: Some(block_table.clone()),
        page_block_size: Some(page_block_size),
        softcap,
        ..FlashAttnVarLen::new(
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
        )
        .window(window_size_left, window_size_right)
    }
    .forward(q, k, v)
}

/// [`flash_attn_varlen`] with ALiBi: `alibi_slopes`, f32 `(heads)` (or `(batch, heads)`), add
/// `−slope · |i + len_k − len_q − j|` to the score of query row i and key j of each sequence.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttnVarLen {
        alibi_slopes: Some(alibi_slopes.clone()),
        ..FlashAttnVarLen::new(
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
        )
        .window(None, causal.then_some(0))
    }
    .forward(q, k, v)
}

/// [`flash_attn_varlen_alibi`] with [`flash_attn_varlen_windowed`]'s window.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttnVarLen {
        alibi_slopes: Some(alibi_slopes.clone()),
        ..FlashAttnVarLen::new(
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
        )
        .window(window_size_left, window_size_right)
    }
    .forward(q, k, v)
}

/// [`flash_attn_varlen_alibi_windowed`] with optional slopes and Gemma 2's logit cap: scores
/// become `softcap · tanh(scores / softcap)` before the softmax (`0.0`: no cap, as
/// FlashAttention).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    FlashAttnVarLen {
        alibi_slopes: alibi_slopes.cloned(),
        softcap: Some(softcap),
        ..FlashAttnVarLen::new(
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
        )
        .window(window_size_left, window_size_right)
    }
    .forward(q, k, v)
}

/// The op behind the varlen functions, with candle-flash-attn's field names (its op is private
/// there): apply it with [`FlashAttnVarLen::forward`] (or candle's `apply_op3`), or take the
/// log-sum-exp too with [`FlashAttnVarLen::forward_with_lse`]. It holds the metadata tensors and
/// reads their storage when it runs. On the GPU one call of [`sdpa::forward`] on views, the
/// metadata in [`sdpa::Extras`]; on the CPU [`sdpa::reference_seqs`].
#[derive(Debug, Clone)]
pub struct FlashAttnVarLen {
    /// The factor of Q·Kᵀ before the softmax (usually `1 / sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// The most queries a sequence has.
    pub max_seqlen_q: usize,
    /// The most keys a sequence has.
    pub max_seqlen_k: usize,
    /// u32 `(batch + 1,)`, contiguous, on Q's device: where each sequence's queries start in Q,
    /// then where the last one ends.
    pub seqlens_q: Tensor,
    /// As `seqlens_q`, for each sequence's keys in K and V (for a paged cache, only the
    /// differences count: each sequence's keys).
    pub seqlens_k: Tensor,
    /// A paged cache's pages of each sequence: u32 or i32 `(batch, pages_per_seq)`, contiguous.
    pub block_table: Option<Tensor>,
    /// A paged cache's page size (its K's second dimension): required with `block_table`.
    pub page_block_size: Option<usize>,
    /// f32 ALiBi slopes, `(heads)` or `(batch, heads)`, on Q's device.
    pub alibi_slopes: Option<Tensor>,
    /// f32 attention sinks `(heads)` on Q's device (gpt-oss; FlashAttention-4's
    /// `learnable_sink`): one logit per query head that joins each row's softmax and weights no
    /// value, taken raw (not scaled or capped); [`sdpa::Problem::with_sinks`] says what a row
    /// then computes. A batch with query rows but no keys at all is refused with sinks (its rows
    /// would be the sinks alone, which no kernel runs). ([`crate::FlashAttn`] stays field for
    /// field candle-flash-attn's, which has no sinks: a dense batch with sinks is this op over
    /// sequences of equal lengths.)
    pub sinks: Option<Tensor>,
    /// The keys before a query row's diagonal it sees (`None`: all).
    pub window_size_left: Option<usize>,
    /// The keys after a query row's diagonal it sees (`None`: all; `Some(0)`: causal).
    pub window_size_right: Option<usize>,
    /// The logit cap, if any (`Some(0.0)` is none).
    pub softcap: Option<f32>,
    /// Whether the GPU op first copies the metadata to the host and checks it (sdpa's
    /// `Seqs::checked`: a synchronization each call, for debugging). The CPU op always checks
    /// it.
    pub checked: bool,
}

impl FlashAttnVarLen {
    /// The op over packed Q and K/V, no mask, no bias, unchecked on the GPU.
    pub fn new(
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
    ) -> Self {
        FlashAttnVarLen {
            softmax_scale,
            max_seqlen_q,
            max_seqlen_k,
            seqlens_q: seqlens_q.clone(),
            seqlens_k: seqlens_k.clone(),
            block_table: None,
            page_block_size: None,
            alibi_slopes: None,
            sinks: None,
            window_size_left: None,
            window_size_right: None,
            softcap: None,
            checked: false,
        }
    }

    /// The op with this window (candle-flash-attn's arguments).
    pub fn window(self, left: Option<usize>, right: Option<usize>) -> Self {
        FlashAttnVarLen {
            window_size_left: left,
            window_size_right: right,
            ..self
        }
    }

    /// The op on Q, K and V, recorded in candle's graph (a backward through it: sdpa's
    /// backward on a GPU, the float64 reference's gradients on the CPU).
    pub fn forward(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        q.apply_op3(k, v, self)
    }

    /// The op's output and each query row's log-sum-exp (f32 `(heads, total_q)`, natural log;
    /// -inf for a row that sees no key or belongs to no sequence), outside candle's graph.
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        call::forward_with_lse(self, q, k, v)
    }
}

/// Sizes of a packed batch.
struct Packed {
    batch: usize,
    total_q: usize,
    heads: usize,
    head_dim: usize,
}

impl FlashAttnVarLen {
    /// The sizes of packed Q and of the metadata, checked against each other.
    fn packed(&self, q: &Layout) -> Result<Packed> {
        let (total_q, heads, head_dim) = q
            .shape()
            .dims3()
            .map_err(|e| e.context("sdpa-candle: q must be (total_q, heads, head_dim)"))?;
        let offsets_q = host::offsets_count("seqlens_q", &self.seqlens_q)?;
        let offsets_k = host::offsets_count("seqlens_k", &self.seqlens_k)?;
        if offsets_q != offsets_k {
            bail!(
                "sdpa-candle: seqlens_q holds {offsets_q} offsets and seqlens_k {offsets_k}; \
                 both hold batch + 1"
            );
        }
        if offsets_q < 2 {
            bail!(
                "sdpa-candle: seqlens_q and seqlens_k hold {offsets_q} offsets; batch + 1 is at \
                 least 2"
            );
        }
        Ok(Packed {
            batch: offsets_q - 1,
            total_q,
            heads,
            head_dim,
        })
    }

    /// K's heads, and the problem's K/V rows from K's layout: packed `(total_k, kv_heads,
    /// head_dim)`, or a paged cache; `None` for packed K/V of no rows.
    fn kv_rows(&self, s: &Packed, k: &Layout, p: Problem) -> Result<(usize, Option<Problem>)> {
        let Some(table) = &self.block_table else {
            let (total_k, kv_heads, d) = k.shape().dims3().map_err(|e| {
                e.context("sdpa-candle: k and v must be (total_k, kv_heads, head_dim)")
            })?;
            check_head_dim(s.head_dim, d)?;
            return Ok((kv_heads, (total_k > 0).then(|| p.with_packed_kv(total_k))));
        };
        let (pages, page_size, kv_heads, d) = k.shape().dims4().map_err(|e| {
            e.context("sdpa-candle: a paged k and v must be (pages, page_size, kv_heads, head_dim)")
        })?;
        check_head_dim(s.head_dim, d)?;
        match self.page_block_size {
            Some(n) if n == page_size => {}
            other => bail!(
                "sdpa-candle: page_block_size is {other:?}; the paged k is {:?}, pages of \
                 {page_size}",
                k.shape()
            ),
        }
        let pages_per_seq = host::block_table_columns(table, s.batch)?;
        Ok((
            kv_heads,
            Some(p.with_paged_kv(pages, page_size, pages_per_seq)),
        ))
    }
}

fn check_head_dim(q: usize, k: usize) -> Result<()> {
    if q != k {
        bail!("sdpa-candle: q's head_dim is {q} and k's {k}: they must match");
    }
    Ok(())
}

impl Resolve for FlashAttnVarLen {
    fn resolve(&self, dtype: DType, q: &Layout, k: &Layout, v: &Layout) -> Result<Call<'_>> {
        let dtype = host::sdpa_dtype(dtype)?;
        let s = self.packed(q)?;
        let dv = host::v_head_dim(k, v)?;
        host::last_dim_contiguous([("q", q), ("k", k), ("v", v)])?;
        let paged = self.block_table.is_some();
        let base = Problem::new(
            s.batch,
            s.heads,
            self.max_seqlen_q,
            self.max_seqlen_k,
            s.head_dim,
        )
        .with_head_dim_v(dv)
        .with_packed_q(s.total_q);
        let (kv_heads, p) = self.kv_rows(&s, k, base)?;
        if kv_heads == 0 || !s.heads.is_multiple_of(kv_heads) {
            bail!(
                "sdpa-candle: k and v have {kv_heads} heads, which must divide q's {}",
                s.heads
            );
        }
        let (layout, k_strides, v_strides) = if paged {
            let (kl, ks) = host::paged_layout("k", k)?;
            let (vl, vs) = host::paged_layout("v", v)?;
            if kl != vl {
                bail!("sdpa-candle: k's pages are {kl:?} and v's {vl:?}; they must match");
            }
            (kl, ks, vs)
        } else {
            let packed = (host::strides_packed(k), host::strides_packed(v));
            (sdpa::PageLayout::Nhd, packed.0, packed.1)
        };
        let strides = [host::strides_packed(q), k_strides, v_strides];
        let problem = match p {
            Some(p) if s.total_q > 0 => {
                let mut p = p
                    .with_page_layout(layout)
                    .with_kv_heads(kv_heads)
                    .with_scale(self.softmax_scale)
                    .with_mask(window_mask(self.window_size_left, self.window_size_right))
                    .with_dtype(dtype)
                    .with_layout(sdpa::Layout::Bshd);
                p.seqs = p.seqs.with_checked(self.checked);
                if let Some(c) = cap(self.softcap) {
                    p = p.with_softcap(c);
                }
                if let Some(a) = &self.alibi_slopes {
                    p = p.with_alibi(call::alibi_layout(a, s.batch, s.heads)?);
                }
                if let Some(t) = &self.sinks {
                    call::check_sinks(t, s.heads)?;
                    p = p.with_sinks(true);
                }
                p.validate().map_err(candle_core::Error::wrap)?;
                Some(p)
            }
            Some(_) => None, // no query rows: nothing to attend
            // No keys: each row is zeros with log-sum-exp -inf, or with sinks its head's sink.
            None if s.total_q > 0 && self.sinks.is_some() => {
                bail!(
                    "sdpa-candle: a batch with query rows and no keys has nothing to attend but \
                     its sinks; sinks need at least one key in the batch"
                )
            }
            None => None,
        };
        Ok(Call {
            problem,
            strides,
            out_shape: host::out_shape(q, dv),
            out_strides: host::strides_packed(&Layout::contiguous(host::out_shape(q, dv))),
            lse_shape: Shape::from((s.heads, s.total_q)),
            meta: Meta {
                cu_seqlens_q: Some(&self.seqlens_q),
                cu_seqlens_k: Some(&self.seqlens_k),
                paged,
                block_table: self.block_table.as_ref(),
            },
            alibi: self.alibi_slopes.as_ref(),
            sinks: self.sinks.as_ref(),
        })
    }
}

crate::call::custom_op3!(FlashAttnVarLen, "sdpa-flash-attn-varlen");
