//! The one problem type every backend takes, and its validation. Shapes, dtypes and layouts are
//! checked here, once, before anything is launched; kernels assume what `validate` guarantees.

mod dtype;
mod mask;
mod shape;

pub use crate::seqs::{KvRows, PageLayout, Seqs};
pub use dtype::{DType, Fp8Mode, Scaling};
pub use mask::{Alibi, Mask};
pub use shape::{Layout, Strides, TensorShape};

use crate::error::{Result, invalid};
use std::fmt;

/// One attention problem: out = softmax(cap(scale · Q·Kᵀ) + alibi + mask) · V, where
/// cap(x) = softcap · tanh(x / softcap) when `softcap` is set (Gemma 2's logit capping) and the
/// ALiBi bias is added when `alibi` is set (its slopes come with the call). With `sinks` each
/// row's softmax also counts one more logit per query head, which weights no value (gpt-oss's
/// attention sinks; [`Problem::with_sinks`]).
///
/// Q is `[batch, heads, seq_q, head_dim]`, K `[batch, kv_heads, seq_k, head_dim]`, V
/// `[batch, kv_heads, seq_k, head_dim_v]` and the output `[batch, heads, seq_q, head_dim_v]` (in
/// the order `layout` says); `head_dim_v` is `head_dim` unless set ([`Problem::with_head_dim_v`]).
/// `kv_heads < heads` is grouped-query attention: query head `h` reads K/V head
/// `h / (heads / kv_heads)`.
///
/// A plain value (`Copy`, `Send`, `Sync`), like every enum of this crate. [`Problem::new`] sets
/// the shape; each `with_` builder one option; [`Problem::validate`] (which every call runs
/// first) says what is wrong with it, without a GPU:
///
/// ```
/// use sdpa::{DType, Layout, Mask, Problem, Strides};
///
/// // A Llama-style prefill: 32 query heads over 8 K/V heads, bf16, BSHD, causal.
/// let p = Problem::new(2, 32, 512, 512, 128)
///     .with_kv_heads(8)
///     .with_dtype(DType::Bf16)
///     .with_layout(Layout::Bshd)
///     .with_causal(true);
/// p.validate()?;
/// assert_eq!(p.mask, Mask::CausalBottomRight);
/// assert_eq!(p.scale(), 1.0 / 128f32.sqrt());
/// assert_eq!(p.q_len(), Some(2 * 512 * 32 * 128));
/// assert_eq!(p.k_len(), Some(2 * 512 * 8 * 128));
/// // BSHD: a head's consecutive rows are heads · head_dim elements apart.
/// assert_eq!(p.q_strides(), Strides { batch: 512 * 32 * 128, head: 128, seq: 32 * 128 });
/// // 32 query heads cannot share 5 K/V heads.
/// assert!(p.with_kv_heads(5).validate().is_err());
/// # Ok::<(), sdpa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Problem {
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Query sequence length.
    pub seq_q: usize,
    /// Key/value sequence length.
    pub seq_k: usize,
    /// Head dimension of Q and K.
    pub head_dim: usize,
    /// Head dimension of V and the output; `None` means `head_dim` ([`Problem::v_dim`]).
    pub head_dim_v: Option<usize>,
    /// Whether V is the first `head_dim_v` columns of K's rows rather than a tensor of its own
    /// (MLA's absorbed form: one latent cache, [`Problem::with_v_in_k`]).
    pub v_in_k: bool,
    /// Which keys each query row sees.
    pub mask: Mask,
    /// Softmax scale; `None` means 1/sqrt(head_dim).
    pub scale: Option<f32>,
    /// Logit cap: scores become `softcap · tanh(scores / softcap)` before the softmax.
    pub softcap: Option<f32>,
    /// ALiBi bias, with slopes of this layout passed to the call.
    pub alibi: Option<Alibi>,
    /// Whether each query head has a sink logit ([`Problem::with_sinks`]; the logits come with
    /// the call in [`crate::Extras::sinks`]).
    pub sinks: bool,
    /// Whether the call also writes each row's log-sum-exp (f32 `[batch, heads, seq_q]`).
    pub lse: bool,
    /// Element type of Q, K and V.
    pub dtype: DType,
    /// Element type of K and V where it differs from Q's: `Some(DType::E4m3)` under f16/bf16 Q
    /// is an FP8 K/V cache ([`Problem::with_kv_dtype`]); `None` (or `dtype` itself) means K and
    /// V are of `dtype`.
    pub kv_dtype: Option<DType>,
    /// Element type of the output; `None` means the input dtype (f16 for e4m3 inputs).
    pub out_dtype: Option<DType>,
    /// How the scales of e4m3 inputs (and of an e4m3 K/V cache) are laid out (ignored for
    /// f16/bf16).
    pub fp8_scaling: Scaling,
    /// How an e4m3 problem computes P·V ([`Fp8Mode`]); `Fast` on an f16/bf16 problem is an
    /// `InvalidArgument` error (there is nothing to make fast, and silently ignoring it would
    /// hide a caller's mistake).
    pub fp8_mode: Fp8Mode,
    /// Memory layout of all four tensors (of the dense ones where `seqs` packs some).
    pub layout: Layout,
    /// How the sequences are stored: dense (the default), packed Q and K/V of different
    /// lengths, or K/V in a paged cache; `seq_q` and `seq_k` are then the longest sequence's.
    pub seqs: Seqs,
}

/// Largest element count of one tensor: the CPU side multiplies sizes in `usize`, and the driver
/// caps one allocation well below this. It is not what the kernels can index: they hold some sizes,
/// row and key indices, tile counts and grid dimensions in 32-bit `int`, and each backend's
/// `supports` (backend/fused.rs, backend/cublas/mod.rs) rejects what exceeds them.
const MAX_ELEMENTS: usize = 1 << 40;

impl Problem {
    /// Self-attention shaped problem with defaults: kv_heads = heads, non-causal, f16, BHSD.
    pub fn new(batch: usize, heads: usize, seq_q: usize, seq_k: usize, head_dim: usize) -> Self {
        Problem {
            batch,
            heads,
            kv_heads: heads,
            seq_q,
            seq_k,
            head_dim,
            head_dim_v: None,
            v_in_k: false,
            mask: Mask::None,
            scale: None,
            softcap: None,
            alibi: None,
            sinks: false,
            lse: false,
            dtype: DType::F16,
            kv_dtype: None,
            out_dtype: None,
            fp8_scaling: Scaling::PerHead,
            fp8_mode: Fp8Mode::Accurate,
            layout: Layout::Bhsd,
            seqs: Seqs::default(),
        }
    }
    /// Sets how the sequences are stored ([`Seqs`]).
    pub fn with_seqs(mut self, seqs: Seqs) -> Self {
        self.seqs = seqs;
        self
    }
    /// Q and the output packed, `[total_q, heads, head_dim]`, offsets in `cu_seqlens_q`
    /// (FlashAttention's varlen).
    pub fn with_packed_q(mut self, total_q: usize) -> Self {
        self.seqs.packed_q = Some(total_q);
        self
    }
    /// K and V packed, `[total_k, kv_heads, head_dim]`, offsets in `cu_seqlens_k`.
    pub fn with_packed_kv(mut self, total_k: usize) -> Self {
        self.seqs.kv = KvRows::Packed { total: total_k };
        self
    }
    /// K and V in a paged cache `[pages, page_size, kv_heads, head_dim]` with a block table
    /// `[batch, pages_per_seq]`; each sequence's key count comes from `seqused_k`.
    pub fn with_paged_kv(mut self, pages: usize, page_size: usize, pages_per_seq: usize) -> Self {
        self.seqs.kv = KvRows::Paged {
            pages,
            page_size,
            pages_per_seq,
        };
        self.seqs.seqused_k = true;
        self
    }
    /// Asks each call to copy its sequence metadata to the host and check the values first
    /// ([`Seqs::checked`]: a host synchronization per call, for debugging).
    pub fn with_checked_metadata(mut self, checked: bool) -> Self {
        self.seqs.checked = checked;
        self
    }
    /// Sets how a paged cache orders each page's elements (NHD unless set).
    pub fn with_page_layout(mut self, layout: PageLayout) -> Self {
        self.seqs.page_layout = layout;
        self
    }
    /// Whether `seqused_k` caps each sequence's keys.
    pub fn with_seqused_k(mut self, seqused_k: bool) -> Self {
        self.seqs.seqused_k = seqused_k;
        self
    }
    /// Gives V and the output a head dimension of their own (DeepSeek's MLA prefill: Q and K
    /// 192, V 128); the softmax scale stays `1/sqrt(head_dim)`, Q·Kᵀ's. The kernels that take
    /// it (scalar, cutlass-sm80) run it on their instance as wide as the wider of the two,
    /// reading and writing only the columns there are ([`crate::Backend::supports`] says which
    /// backend takes which problem):
    ///
    /// ```
    /// use sdpa::Problem;
    ///
    /// let p = Problem::new(1, 128, 4096, 4096, 192).with_head_dim_v(128).with_causal(true);
    /// p.validate()?;
    /// assert_eq!(p.v_dim(), 128);
    /// assert_eq!(p.k_len(), Some(128 * 4096 * 192));
    /// assert_eq!(p.v_len(), Some(128 * 4096 * 128));
    /// assert_eq!(p.out_len(), p.v_len());
    /// # Ok::<(), sdpa::Error>(())
    /// ```
    pub fn with_head_dim_v(mut self, head_dim_v: usize) -> Self {
        self.head_dim_v = Some(head_dim_v);
        self
    }
    /// Reads V from K's rows: their first `head_dim_v` columns (DeepSeek's MLA decode in the
    /// absorbed form, FlashMLA's layout: one latent cache of 576 columns whose first 512 are V).
    /// The call's V is K itself (the same tensor, or a view at K's address with K's strides);
    /// V's strides are K's ([`Problem::v_strides`]). Nothing is copied: cutlass (sm90) runs the
    /// 576/512 decode step on a kernel of its own, scalar runs any such problem.
    ///
    /// ```
    /// use sdpa::Problem;
    ///
    /// // 64 sequences of one token, 128 query heads, a latent cache of 4096 keys.
    /// let p = Problem::new(64, 128, 1, 4096, 576)
    ///     .with_kv_heads(1)
    ///     .with_head_dim_v(512)
    ///     .with_v_in_k(true);
    /// p.validate()?;
    /// assert_eq!(p.v_strides(), p.k_strides());
    /// assert_eq!(p.v_len(), p.k_len());
    /// assert_eq!(p.out_len(), Some(64 * 128 * 512));
    /// # Ok::<(), sdpa::Error>(())
    /// ```
    pub fn with_v_in_k(mut self, v_in_k: bool) -> Self {
        self.v_in_k = v_in_k;
        self
    }
    /// Head dimension of V and the output: `head_dim_v`, else `head_dim`.
    pub fn v_dim(&self) -> usize {
        self.head_dim_v.unwrap_or(self.head_dim)
    }
    /// Sets the number of K/V heads (GQA when fewer than `heads`).
    pub fn with_kv_heads(mut self, kv_heads: usize) -> Self {
        self.kv_heads = kv_heads;
        self
    }
    /// Sets the mask.
    pub fn with_mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }
    /// Causal (aligned bottom-right, [`Mask::CausalBottomRight`]) or no mask.
    pub fn with_causal(self, causal: bool) -> Self {
        self.with_mask(if causal {
            Mask::CausalBottomRight
        } else {
            Mask::None
        })
    }
    /// Whether the mask is causal aligned bottom-right (also as a window unbounded on the left).
    pub fn is_causal(&self) -> bool {
        self.mask.canonical() == Mask::CausalBottomRight
    }
    /// Sets the logit cap (`softcap · tanh(scores / softcap)`).
    pub fn with_softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }
    /// Sets the layout of the ALiBi slopes the calls will pass.
    pub fn with_alibi(mut self, alibi: Alibi) -> Self {
        self.alibi = Some(alibi);
        self
    }
    /// Gives each query head a learnable attention sink (FlashAttention-4's `learnable_sink`,
    /// gpt-oss's `sinks`): one logit `s_h` per query head, passed with each call as
    /// [`crate::Extras::sinks`] (f32 `[heads]`), that joins the softmax of every row of head `h`
    /// and weights no value:
    ///
    /// out_i = Σ_j exp(x_ij) · v_j / (exp(s_h) + Σ_j exp(x_ij)),
    /// lse_i = ln(exp(s_h) + Σ_j exp(x_ij)),
    ///
    /// where x_ij are the row's logits after scale, softcap and ALiBi and j runs over the keys
    /// the mask shows it. The sink is taken raw, as the models train it: not scaled, capped or
    /// biased. A row that sees no key has output 0 and log-sum-exp `s_h`; `s_h = -inf` is no
    /// sink (that head's rows are as without sinks); a NaN or +inf sink makes every row of its
    /// head NaN (output and log-sum-exp), as a NaN in Q does to its row, and no other head's
    /// (the logits stay on the device: checking them would cost each call a synchronization).
    pub fn with_sinks(mut self, sinks: bool) -> Self {
        self.sinks = sinks;
        self
    }
    /// Asks the call for each row's log-sum-exp too ([`crate::Extras::lse`]).
    pub fn with_lse(mut self, lse: bool) -> Self {
        self.lse = lse;
        self
    }
    /// Entries of the log-sum-exp output: batch · heads · seq_q, `[batch, heads, seq_q]`; with
    /// packed Q heads · total_q, `[heads, total_q]` (FlashAttention's varlen layout).
    /// Saturates at `usize::MAX` where the product overflows (no buffer is that long).
    pub fn lse_len(&self) -> usize {
        match self.seqs.packed_q {
            Some(total) => self.heads.saturating_mul(total),
            None => self
                .batch
                .saturating_mul(self.heads)
                .saturating_mul(self.seq_q),
        }
    }
    /// Entries of the block table of a paged cache, `batch · pages_per_seq` (0 for other
    /// problems); saturates at `usize::MAX` where the product overflows.
    pub fn block_table_len(&self) -> usize {
        match self.seqs.kv {
            KvRows::Paged { pages_per_seq, .. } => self.batch.saturating_mul(pages_per_seq),
            _ => 0,
        }
    }
    /// Whether the problem is plain attention with no mask beyond causal bottom-right, no
    /// softcap, no ALiBi, no sinks and no e4m3 K/V cache under 16-bit Q: what every backend
    /// runs.
    pub fn is_plain(&self) -> bool {
        matches!(self.mask.canonical(), Mask::None | Mask::CausalBottomRight)
            && self.softcap.is_none()
            && self.alibi.is_none()
            && !self.sinks
            && !self.is_fp8_kv()
    }
    /// Sets an explicit softmax scale.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Sets the element type.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }
    /// Sets the element type of K and V apart from Q's: [`DType::E4m3`] under f16 or bf16 Q
    /// is an FP8 K/V cache, half the bytes a decode step reads.
    ///
    /// K and V are then e4m3 codes with dequantization scales, real value = code · scale (the
    /// convention of every e4m3 operand here, [`crate::fp8`]): one scale for K and one for V
    /// ([`Scaling::PerTensor`], vLLM's `k_scale` / `v_scale`), or with [`Scaling::PerHead`] (the
    /// default) one per (batch, K/V head) pair of K's shape ([`Problem::k_shape`]): `[batch,
    /// kv_heads]` for dense K/V (FlashAttention-3's `descale_k` / `descale_v`), `[kv_heads]` for
    /// a paged cache or packed K/V, whose pages every sequence shares. The scales travel with
    /// the codes: e4m3 [`crate::Tensor`]s ([`crate::Tensor::quantize`]) or [`crate::Fp8View`]s
    /// in [`crate::Fp8KvViews`]; [`crate::write_kv`] quantizes new 16-bit rows into such a cache.
    /// Scales must be finite and not negative (a quantization's amax / 448): a negative or
    /// non-finite K scale makes its rows' output NaN.
    ///
    /// Q and the output stay 16-bit ([`Problem::output_dtype`] is Q's dtype); the kernels widen
    /// the codes exactly to Q's dtype and fold the scales into the softmax scale (K's) and the
    /// output's normalization (V's), so the result is that of the 16-bit kernel on the
    /// dequantized cache. The float64 reference of such a problem is the reference of
    /// [`Problem::as_dequantized`] on the dequantized K and V ([`crate::fp8::dequantize_host`]).
    /// Where it runs: decode steps (at most 16 query tokens a sequence against at least 256
    /// keys, head_dim 64 or 128, no mask or bottom-right causal, no softcap or ALiBi; sinks, GQA,
    /// dense, paged and packed K/V) on `cutlass` (sm_90a) and `cutlass-sm80`, and any problem on
    /// `cpu` (owned tensors); other backends and problems are refused by name.
    ///
    /// ```
    /// use sdpa::{DType, Problem, Scaling};
    ///
    /// // A decode step of 16 sequences, 32 query heads over 8 K/V heads, over an e4m3 cache.
    /// let p = Problem::new(16, 32, 1, 8192, 128)
    ///     .with_kv_heads(8)
    ///     .with_dtype(DType::Bf16)
    ///     .with_kv_dtype(DType::E4m3);
    /// p.validate()?;
    /// assert_eq!((p.kv_dtype(), p.output_dtype()), (DType::E4m3, DType::Bf16));
    /// assert_eq!(p.to_string(), "B16 H32/8 Sq1 Sk8192 D128 bf16 kv e4m3/head");
    /// // Per-head scales of a dense cache: one per (sequence, K/V head).
    /// assert_eq!(sdpa::fp8::scale_count(&p.k_shape(), Scaling::PerHead), 16 * 8);
    /// // The reference's problem: K/V of Q's dtype.
    /// assert_eq!(p.as_dequantized().kv_dtype(), DType::Bf16);
    /// // K/V differ from Q only as an e4m3 cache under 16-bit Q.
    /// assert!(p.with_kv_dtype(DType::F16).validate().is_err());
    /// # Ok::<(), sdpa::Error>(())
    /// ```
    pub fn with_kv_dtype(mut self, dtype: DType) -> Self {
        self.kv_dtype = Some(dtype);
        self
    }
    /// The element type of K and V: `kv_dtype` where set, else `dtype`.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype.unwrap_or(self.dtype)
    }
    /// Whether K and V are an e4m3 cache under 16-bit Q ([`Problem::with_kv_dtype`]).
    pub fn is_fp8_kv(&self) -> bool {
        self.kv_dtype() == DType::E4m3 && self.dtype != DType::E4m3
    }
    /// Sets the output element type: the input type, f16 or bf16 for e4m3 inputs, f32 for
    /// f16/bf16 inputs ([`DType::F32`]; the `cutlass` and `cpu` backends write it).
    pub fn with_out_dtype(mut self, dtype: DType) -> Self {
        self.out_dtype = Some(dtype);
        self
    }
    /// Sets the scale layout of e4m3 inputs.
    pub fn with_fp8_scaling(mut self, scaling: Scaling) -> Self {
        self.fp8_scaling = scaling;
        self
    }
    /// Sets how an e4m3 problem computes P·V ([`Fp8Mode`]; `Fast` is valid on e4m3 problems
    /// only).
    pub fn with_fp8_mode(mut self, mode: Fp8Mode) -> Self {
        self.fp8_mode = mode;
        self
    }
    /// Whether P·V may run on e4m3 tensor cores: an e4m3 problem in [`Fp8Mode::Fast`].
    pub fn is_fp8_fast(&self) -> bool {
        self.dtype == DType::E4m3 && self.fp8_mode == Fp8Mode::Fast
    }
    /// The output's element type.
    pub fn output_dtype(&self) -> DType {
        self.out_dtype.unwrap_or(match self.dtype {
            DType::E4m3 => DType::F16,
            d => d,
        })
    }
    /// The f16/bf16 problem an e4m3 problem becomes once its inputs are dequantized to the
    /// output dtype (the simulated FP8 path, which runs P·V in 16 bit: the mode is back to
    /// accurate); an e4m3 K/V cache's problem with K and V of Q's dtype (its reference's);
    /// other problems unchanged.
    pub fn as_dequantized(&self) -> Problem {
        if self.is_fp8_kv() {
            return Problem {
                kv_dtype: None,
                ..*self
            };
        }
        if self.dtype != DType::E4m3 {
            return *self;
        }
        Problem {
            dtype: self.output_dtype(),
            kv_dtype: None,
            out_dtype: None,
            fp8_mode: Fp8Mode::Accurate,
            ..*self
        }
    }
    /// Shape of Q: packed Q is one sequence of total_q rows, BSHD.
    pub fn q_shape(&self) -> TensorShape {
        self.query_rows(self.head_dim)
    }
    /// Shape of the output: Q's rows of `head_dim_v` ([`Problem::v_dim`]).
    pub fn out_shape(&self) -> TensorShape {
        self.query_rows(self.v_dim())
    }
    fn query_rows(&self, head_dim: usize) -> TensorShape {
        let (batch, seq, layout) = match self.seqs.packed_q {
            Some(total) => (1, total, Layout::Bshd),
            None => (self.batch, self.seq_q, self.layout),
        };
        TensorShape {
            batch,
            heads: self.heads,
            seq,
            head_dim,
            layout,
        }
    }
    /// Shape of K: packed K/V is one sequence of total_k rows, a paged cache one of
    /// pages · page_size rows, BSHD. An HND cache is one sequence of the rows its kernels
    /// address, `(pages - 1) · kv_heads · page_size + page_size` of them, read at
    /// [`Problem::k_strides`] (a row stride of head_dim).
    pub fn k_shape(&self) -> TensorShape {
        self.key_rows(self.head_dim)
    }
    /// Shape of V: K's rows of `head_dim_v` ([`Problem::v_dim`]).
    pub fn v_shape(&self) -> TensorShape {
        self.key_rows(self.v_dim())
    }
    fn key_rows(&self, head_dim: usize) -> TensorShape {
        let (batch, seq, layout) = match self.seqs.kv {
            KvRows::Dense => (self.batch, self.seq_k, self.layout),
            KvRows::Packed { total } => (1, total, Layout::Bshd),
            KvRows::Paged {
                pages, page_size, ..
            } => {
                let page_rows = self.seqs.page_layout.page_rows(page_size, self.kv_heads);
                let rows = pages
                    .saturating_sub(1)
                    .saturating_mul(page_rows)
                    .saturating_add(page_size);
                (1, rows, Layout::Bshd)
            }
        };
        TensorShape {
            batch,
            heads: self.kv_heads,
            seq,
            head_dim,
            layout,
        }
    }
    /// Whether K and V are a paged cache of HND pages.
    fn hnd_pages(&self) -> Option<usize> {
        match self.seqs.kv {
            KvRows::Paged {
                pages, page_size, ..
            } if self.seqs.page_layout == PageLayout::Hnd => Some(pages.saturating_mul(page_size)),
            _ => None,
        }
    }
    /// Sets the memory layout.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The softmax scale in effect.
    pub fn scale(&self) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }

    /// Checks everything that does not depend on a backend. Every error names the value.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("batch", self.batch),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("seq_q", self.seq_q),
            ("seq_k", self.seq_k),
            ("head_dim", self.head_dim),
            ("head_dim_v", self.v_dim()),
        ] {
            if v == 0 {
                return Err(invalid!("{name} must be at least 1, got 0"));
            }
        }
        // Packed sequences leave batch out of the tensors' sizes; their metadata has batch + 1
        // entries, which no buffer holds past this.
        if self.batch > MAX_ELEMENTS {
            return Err(invalid!("batch {} is more than 2^40 sequences", self.batch));
        }
        if self.mask == (Mask::Chunked { size: 0 }) {
            return Err(invalid!(
                "a chunked mask needs chunks of at least 1 key, got 0"
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid!(
                "heads ({}) must be a multiple of kv_heads ({})",
                self.heads,
                self.kv_heads
            ));
        }
        match (self.dtype, self.output_dtype()) {
            (DType::F32, _) => {
                return Err(invalid!(
                    "the inputs are f32: f32 is an output type only (Q, K and V are f16, bf16 \
                     or e4m3)"
                ));
            }
            (_, DType::E4m3) => {
                return Err(invalid!(
                    "the output dtype must be f16, bf16 or f32, got e4m3 (e4m3 is an input type)"
                ));
            }
            (DType::E4m3, DType::F32) => {
                return Err(invalid!(
                    "the output of e4m3 inputs is f16 or bf16, got f32"
                ));
            }
            (DType::E4m3, _) | (_, DType::F32) => {}
            (i, o) if i != o => {
                return Err(invalid!(
                    "output dtype {o} differs from input dtype {i}: only e4m3 inputs (to f16 or \
                     bf16) and f16/bf16 inputs (to f32) may have another output dtype"
                ));
            }
            _ => {}
        }
        match self.kv_dtype {
            None => {}
            Some(kv) if kv == self.dtype => {}
            Some(DType::E4m3)
                if matches!(self.dtype, DType::F16 | DType::Bf16)
                    && self.output_dtype() != self.dtype =>
            {
                return Err(invalid!(
                    "the output of an e4m3 K/V cache problem is Q's dtype ({}), got {}",
                    self.dtype,
                    self.output_dtype()
                ));
            }
            Some(DType::E4m3) if matches!(self.dtype, DType::F16 | DType::Bf16) => {}
            Some(kv) => {
                return Err(invalid!(
                    "K/V of {kv} under Q of {}: K and V differ from Q's dtype only as an e4m3 \
                     cache under f16 or bf16 Q",
                    self.dtype
                ));
            }
        }
        if self.fp8_mode == Fp8Mode::Fast && self.dtype != DType::E4m3 {
            return Err(invalid!(
                "fp8 mode fast needs e4m3 inputs, the problem is {} (P·V on e4m3 tensor cores \
                 applies to e4m3 problems only)",
                self.dtype
            ));
        }
        if let Some(s) = self.scale
            && !(s.is_finite() && s > 0.0)
        {
            return Err(invalid!("scale must be finite and positive, got {s}"));
        }
        if let Some(c) = self.softcap
            && !(c.is_finite() && c > 0.0)
        {
            return Err(invalid!("softcap must be finite and positive, got {c}"));
        }
        self.seqs.validate(self.seq_k)?;
        if let KvRows::Paged { pages_per_seq, .. } = self.seqs.kv
            && self.block_table_len() > MAX_ELEMENTS
        {
            return Err(invalid!(
                "the block table would hold more than 2^40 entries ({} sequences x \
                 {pages_per_seq} pages)",
                self.batch
            ));
        }
        if (self.dtype == DType::E4m3 || self.is_fp8_kv()) && self.v_dim() != self.head_dim {
            return Err(invalid!(
                "e4m3 inputs and e4m3 K/V caches take one head dimension, got head_dim {} and \
                 head_dim_v {}",
                self.head_dim,
                self.v_dim()
            ));
        }
        if self.v_in_k && self.v_dim() > self.head_dim {
            return Err(invalid!(
                "V read from K's rows is their first head_dim_v columns: head_dim_v {} exceeds \
                 head_dim {}",
                self.v_dim(),
                self.head_dim
            ));
        }
        if self.v_in_k && (self.dtype == DType::E4m3 || self.is_fp8_kv()) {
            return Err(invalid!(
                "V read from K's rows takes 16-bit K/V (no e4m3 inputs or e4m3 K/V cache)"
            ));
        }
        if !self.seqs.is_dense() && self.dtype == DType::E4m3 {
            return Err(invalid!(
                "e4m3 inputs take dense sequences only (no packed Q/K/V, paged cache or seqused_k)"
            ));
        }
        for (name, n, heads, seq, d) in [
            ("Q", self.q_len(), self.heads, self.seq_q, self.head_dim),
            ("O", self.out_len(), self.heads, self.seq_q, self.v_dim()),
            ("K", self.k_len(), self.kv_heads, self.seq_k, self.head_dim),
            ("V", self.v_len(), self.kv_heads, self.seq_k, self.v_dim()),
        ] {
            if n.is_none_or(|n| n > MAX_ELEMENTS) {
                return Err(invalid!(
                    "{name} would hold more than 2^40 elements ({}x{heads}x{seq}x{d})",
                    self.batch
                ));
            }
        }
        Ok(())
    }

    /// The problem as a [`Checked`] one, which only passing `validate` makes.
    pub(crate) fn checked(&self) -> Result<Checked> {
        self.validate()?;
        Ok(Checked(*self))
    }

    /// Elements of Q; `None` on overflow.
    pub fn q_len(&self) -> Option<usize> {
        self.q_shape().len()
    }
    /// Elements of the output; `None` on overflow.
    pub fn out_len(&self) -> Option<usize> {
        self.out_shape().len()
    }
    /// Elements of K; `None` on overflow.
    pub fn k_len(&self) -> Option<usize> {
        self.key_len(self.head_dim)
    }
    /// Elements of V; `None` on overflow.
    pub fn v_len(&self) -> Option<usize> {
        if self.v_in_k {
            return self.k_len();
        }
        self.key_len(self.v_dim())
    }
    fn key_len(&self, head_dim: usize) -> Option<usize> {
        match self.hnd_pages() {
            // Every page's rows of every head.
            Some(rows) => rows.checked_mul(self.kv_heads)?.checked_mul(head_dim),
            None => self.key_rows(head_dim).len(),
        }
    }

    /// Strides of Q.
    pub fn q_strides(&self) -> Strides {
        self.q_shape().strides()
    }
    /// Strides of the output.
    pub fn out_strides(&self) -> Strides {
        self.out_shape().strides()
    }
    /// Strides of K (an HND cache's: its heads `page_size · head_dim` apart, its rows
    /// head_dim apart, in the row space of [`Problem::k_shape`]).
    pub fn k_strides(&self) -> Strides {
        self.key_strides(self.head_dim)
    }
    /// Strides of V (as K's, with rows of `head_dim_v`; K's own where V is read from K's rows).
    pub fn v_strides(&self) -> Strides {
        if self.v_in_k {
            return self.k_strides();
        }
        self.key_strides(self.v_dim())
    }
    /// Q's, K's, V's and the output's strides in the problem's own layout, in that order.
    pub(crate) fn operand_strides(&self) -> [Strides; 4] {
        [
            self.q_strides(),
            self.k_strides(),
            self.v_strides(),
            self.out_strides(),
        ]
    }
    fn key_strides(&self, head_dim: usize) -> Strides {
        match (self.seqs.kv, self.hnd_pages()) {
            (KvRows::Paged { page_size, .. }, Some(rows)) => Strides {
                batch: rows.saturating_mul(self.kv_heads).saturating_mul(head_dim),
                head: page_size * head_dim,
                seq: head_dim,
            },
            _ => self.key_rows(head_dim).strides(),
        }
    }

    /// The keys `[first, end)` query row `i` attends to (empty for rows that see none).
    pub fn visible_range(&self, i: usize) -> std::ops::Range<usize> {
        self.mask.visible(i, self.seq_q, self.seq_k)
    }

    /// Number of keys query row `i` attends to (0 for rows that see none).
    pub fn visible_keys(&self, i: usize) -> usize {
        self.visible_range(i).len()
    }

    /// Floating-point operations of the two matrix products, counting only visible scores
    /// (so a causal square problem counts about half, a window its band).
    pub fn flops(&self) -> f64 {
        let (sq, sk) = (self.seq_q as f64, self.seq_k as f64);
        // Causal: row i sees i + 1 + sk - sq keys (at least 0), an arithmetic series ending at
        // sk; other masks row by row.
        let visible = match (self.mask.canonical(), self.seq_q <= self.seq_k) {
            (Mask::None, _) => sq * sk,
            (Mask::CausalBottomRight, true) => sq * (2.0 * sk - sq + 1.0) / 2.0,
            (Mask::CausalBottomRight, false) => sk * (sk + 1.0) / 2.0,
            _ => (0..self.seq_q).map(|i| self.visible_keys(i) as f64).sum(),
        };
        2.0 * (self.batch * self.heads) as f64 * visible * (self.head_dim + self.v_dim()) as f64
    }
}

/// A problem that passed [`Problem::validate`]: what the backends take, so a call validates
/// once. Its sizes are known not to overflow (`q_len`, `out_len`, `k_len`, `v_len` are `Some`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Checked(Problem);

impl Checked {
    /// The f16/bf16 problem of the simulated FP8 path (still valid: see `as_dequantized`).
    pub(crate) fn dequantized(&self) -> Checked {
        Checked(self.0.as_dequantized())
    }
    /// Elements of Q, K, V and the output, in that order.
    pub(crate) fn operand_elems(&self) -> [usize; 4] {
        [
            self.0.q_len(),
            self.0.k_len(),
            self.0.v_len(),
            self.0.out_len(),
        ]
        .map(Option::unwrap_or_default)
    }
    /// Strides `given` to Q, K, V and the output as the kernels take them: each dimension of
    /// size 1 at the problem's own stride ([`Problem::operand_strides`]; V read from K's rows
    /// has K's), the others as given.
    pub(crate) fn effective_strides(&self, given: [Strides; 4]) -> [Strides; 4] {
        let (shapes, own) = (self.operand_shapes(), self.0.operand_strides());
        std::array::from_fn(|i| shapes[i].effective(given[i], own[i]))
    }
    /// Shapes of Q, K, V and the output, in that order.
    pub(crate) fn operand_shapes(&self) -> [TensorShape; 4] {
        [
            self.0.q_shape(),
            self.0.k_shape(),
            self.0.v_shape(),
            self.0.out_shape(),
        ]
    }
}

impl fmt::Display for Checked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::ops::Deref for Checked {
    type Target = Problem;
    fn deref(&self) -> &Problem {
        &self.0
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "B{} H{}", self.batch, self.heads)?;
        if self.kv_heads != self.heads {
            write!(f, "/{}", self.kv_heads)?;
        }
        if self.seq_q == self.seq_k {
            write!(f, " S{}", self.seq_q)?;
        } else {
            write!(f, " Sq{} Sk{}", self.seq_q, self.seq_k)?;
        }
        write!(f, " D{}", self.head_dim)?;
        if self.v_dim() != self.head_dim {
            write!(f, "/{}", self.v_dim())?;
        }
        if self.v_in_k {
            f.write_str(" v-in-k")?;
        }
        write!(f, " {}", self.dtype)?;
        if self.is_fp8_kv() {
            write!(f, " kv e4m3/{}", self.fp8_scaling.name())?;
        } else if self.dtype == DType::E4m3 {
            write!(f, "/{}->{}", self.fp8_scaling.name(), self.output_dtype())?;
            if self.fp8_mode == Fp8Mode::Fast {
                f.write_str(" fast")?;
            }
        } else if self.output_dtype() != self.dtype {
            write!(f, "->{}", self.output_dtype())?;
        }
        match self.mask.canonical() {
            Mask::None => {}
            Mask::CausalBottomRight => f.write_str(" causal")?,
            m => write!(f, " {m}")?,
        }
        if let Some(c) = self.softcap {
            write!(f, " softcap {c}")?;
        }
        if self.alibi.is_some() {
            f.write_str(" alibi")?;
        }
        if self.sinks {
            f.write_str(" sinks")?;
        }
        if self.lse {
            f.write_str(" +lse")?;
        }
        write!(f, "{}", self.seqs)?;
        if self.layout == Layout::Bshd {
            f.write_str(" bshd")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_visibility_is_bottom_right() {
        let p = Problem::new(1, 1, 3, 5, 64).with_causal(true);
        assert_eq!(
            (0..3).map(|i| p.visible_keys(i)).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        let p = Problem::new(1, 1, 5, 3, 64).with_causal(true);
        assert_eq!(
            (0..5).map(|i| p.visible_keys(i)).collect::<Vec<_>>(),
            [0, 0, 1, 2, 3]
        );
    }

    #[test]
    fn causal_flops_count_visible_scores() {
        for (sq, sk) in [(4, 4), (3, 7), (7, 3), (1, 1), (1, 9), (9, 1)] {
            let p = Problem::new(1, 1, sq, sk, 8).with_causal(true);
            let visible: usize = (0..sq).map(|i| p.visible_keys(i)).sum();
            assert_eq!(p.flops(), 4.0 * visible as f64 * 8.0, "{sq}x{sk}");
        }
    }

    #[test]
    fn windows_and_top_left_see_their_bands() {
        let vis = |m: Mask, sq, sk| (0..sq).map(|i| m.visible(i, sq, sk)).collect::<Vec<_>>();
        assert_eq!(vis(Mask::CausalTopLeft, 3, 5), [0..1, 0..2, 0..3]);
        assert_eq!(vis(Mask::CausalTopLeft, 4, 2), [0..1, 0..2, 0..2, 0..2]);
        let w = |l, r| Mask::Window { left: l, right: r };
        // Diagonal of row i at i + 2 (sq 3, sk 5).
        assert_eq!(vis(w(Some(1), Some(0)), 3, 5), [1..3, 2..4, 3..5]);
        assert_eq!(vis(w(Some(0), Some(1)), 3, 5), [2..4, 3..5, 4..5]);
        assert_eq!(
            vis(w(None, Some(0)), 3, 5),
            vis(Mask::CausalBottomRight, 3, 5)
        );
        assert_eq!(vis(w(None, None), 3, 5), vis(Mask::None, 3, 5));
        // seq_q > seq_k: the diagonal starts below key 0, early rows see nothing.
        assert_eq!(vis(w(Some(1), Some(0)), 4, 2), [0..0, 0..0, 0..1, 0..2]);
        assert_eq!(vis(w(Some(0), Some(0)), 4, 2), [0..0, 0..0, 0..1, 1..2]);
        assert_eq!(w(None, Some(0)).canonical(), Mask::CausalBottomRight);
        assert_eq!(w(None, None).canonical(), Mask::None);
    }

    #[test]
    fn chunks_see_their_own_keys_causally() {
        let vis = |m: Mask, sq, sk| (0..sq).map(|i| m.visible(i, sq, sk)).collect::<Vec<_>>();
        let c = |size| Mask::Chunked { size };
        assert_eq!(vis(c(2), 5, 5), [0..1, 0..2, 2..3, 2..4, 4..5]);
        // Diagonal of row i at i + 3 (sq 3, sk 6): chunks [0, 4), [4, 8).
        assert_eq!(vis(c(4), 3, 6), [0..4, 4..5, 4..6]);
        // seq_q > seq_k: rows before the diagonal see nothing.
        assert_eq!(vis(c(2), 4, 3), [0..0, 0..1, 0..2, 2..3]);
        // A chunk as long as the keys is causal.
        assert_eq!(vis(c(6), 3, 6), vis(Mask::CausalBottomRight, 3, 6));
        let p = Problem::new(1, 2, 5, 5, 8).with_mask(c(2));
        assert_eq!(p.flops(), 4.0 * 2.0 * 7.0 * 8.0); // 7 visible scores a head
        let e = Problem::new(1, 1, 4, 4, 8)
            .with_mask(c(0))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("chunks of at least 1 key"), "{e}");
    }

    #[test]
    fn masks_parse_as_they_print() {
        for m in [
            Mask::None,
            Mask::CausalBottomRight,
            Mask::CausalTopLeft,
            Mask::Window {
                left: Some(1024),
                right: Some(0),
            },
            Mask::Window {
                left: None,
                right: Some(3),
            },
            Mask::Chunked { size: 8192 },
        ] {
            assert_eq!(m.name().parse::<Mask>().unwrap(), m);
        }
        for bad in ["chunked(0)", "chunked(-1)", "chunked(x)"] {
            let e = bad.parse::<Mask>().unwrap_err().to_string();
            assert!(e.contains("chunk size"), "{bad}: {e}");
        }
        assert_eq!(
            "1024,0".parse::<Mask>().unwrap(),
            Mask::Window {
                left: Some(1024),
                right: Some(0)
            }
        );
        let e = "-2,0".parse::<Mask>().unwrap_err().to_string();
        assert!(e.contains("-2"), "{e}");
    }

    #[test]
    fn window_flops_count_the_band() {
        let p = Problem::new(1, 1, 6, 6, 8).with_mask(Mask::Window {
            left: Some(2),
            right: Some(0),
        });
        // Rows see 1, 2, 3, 3, 3, 3 keys.
        assert_eq!(p.flops(), 4.0 * 15.0 * 8.0);
        let e = Problem::new(1, 1, 4, 4, 64).with_softcap(0.0).validate();
        assert!(e.unwrap_err().to_string().contains("softcap"));
    }

    #[test]
    fn strides_address_every_element_once() {
        for layout in [Layout::Bhsd, Layout::Bshd] {
            let p = Problem::new(2, 3, 5, 5, 4).with_layout(layout);
            let s = p.q_strides();
            let mut seen = vec![false; p.q_len().unwrap()];
            for b in 0..2 {
                for h in 0..3 {
                    for i in 0..5 {
                        for d in 0..4 {
                            let o = s.offset(b, h, i, d);
                            assert!(!seen[o], "{layout:?} offset {o} twice");
                            seen[o] = true;
                        }
                    }
                }
            }
            assert!(seen.into_iter().all(|x| x));
        }
    }

    #[test]
    fn fp8_modes_parse_as_they_print() {
        for m in Fp8Mode::ALL {
            assert_eq!(m.name().parse::<Fp8Mode>().unwrap(), m);
            assert_eq!(m.to_string(), m.name());
        }
        assert_eq!("FAST".parse::<Fp8Mode>().unwrap(), Fp8Mode::Fast);
        assert_eq!(Fp8Mode::default(), Fp8Mode::Accurate);
        assert_eq!(Problem::new(1, 1, 4, 4, 64).fp8_mode, Fp8Mode::Accurate);
        let e = "quick".parse::<Fp8Mode>().unwrap_err();
        assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e:?}");
        assert!(
            e.to_string()
                .contains("\"quick\" (expected accurate or fast)"),
            "{e}"
        );
    }

    /// Fast mode is an e4m3 property: on f16/bf16 a typed error naming the dtype; on e4m3 valid,
    /// shown in the problem's name, and gone from the dequantized (16-bit) problem.
    #[test]
    fn fast_fp8_mode_needs_e4m3() {
        for dtype in DType::ALL {
            let p = Problem::new(1, 1, 4, 4, 64)
                .with_dtype(dtype)
                .with_fp8_mode(Fp8Mode::Fast);
            let e = p.validate().unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e:?}");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!(
                    "fp8 mode fast needs e4m3 inputs, the problem is {dtype}"
                )),
                "{msg}"
            );
            assert!(!p.is_fp8_fast());
        }
        let p = Problem::new(1, 2, 4, 4, 64).with_dtype(DType::E4m3);
        assert_eq!(p.to_string(), "B1 H2 S4 D64 e4m3/head->f16");
        let fast = p.with_fp8_mode(Fp8Mode::Fast).with_causal(true);
        fast.validate().unwrap();
        assert!(fast.is_fp8_fast());
        assert_eq!(fast.to_string(), "B1 H2 S4 D64 e4m3/head->f16 fast causal");
        let sim = fast.as_dequantized();
        assert_eq!((sim.dtype, sim.fp8_mode), (DType::F16, Fp8Mode::Accurate));
        sim.validate().unwrap();
        assert_ne!(fast, p.with_causal(true), "the mode tells problems apart");
    }

    /// f32 is an output type of f16/bf16 inputs only: f32 inputs and an f32 output of e4m3
    /// inputs are typed errors that name the rule; the problem's name shows the output type.
    #[test]
    fn f32_is_an_output_type_of_16_bit_inputs() {
        let p = Problem::new(1, 4, 8, 8, 64).with_kv_heads(2);
        for dtype in DType::ALL {
            let ok = p.with_dtype(dtype).with_out_dtype(DType::F32);
            ok.validate().unwrap();
            assert_eq!(ok.output_dtype(), DType::F32);
            assert_eq!(ok.to_string(), format!("B1 H4/2 S8 D64 {dtype}->f32"));
            assert_eq!(ok.as_dequantized(), ok, "not an e4m3 problem");
        }
        let bad = |p: Problem, fragment: &str| {
            let e = p.validate().unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)), "{p}: {e:?}");
            assert!(e.to_string().contains(fragment), "{p}: {e}");
        };
        bad(p.with_dtype(DType::F32), "f32 is an output type only");
        bad(
            p.with_dtype(DType::F32).with_out_dtype(DType::F32),
            "f32 is an output type only",
        );
        bad(
            p.with_dtype(DType::E4m3).with_out_dtype(DType::F32),
            "the output of e4m3 inputs is f16 or bf16, got f32",
        );
        bad(
            p.with_out_dtype(DType::Bf16),
            "output dtype bf16 differs from input dtype f16",
        );
        bad(p.with_out_dtype(DType::E4m3), "got e4m3");
    }

    /// f32 parses by its usual names, prints as "f32", takes 4 bytes and rounds at 2^-24; it
    /// is an output dtype, not an input one.
    #[test]
    fn f32_parses_and_sizes_as_an_output_type() {
        for name in ["f32", "fp32", "float32", "F32", "Float32"] {
            assert_eq!(name.parse::<DType>().unwrap(), DType::F32, "{name}");
        }
        assert_eq!(DType::F32.name(), "f32");
        assert_eq!(DType::F32.to_string(), "f32");
        assert_eq!(DType::F32.size(), 4);
        assert_eq!(DType::F32.unit_roundoff(), f64::from(f32::EPSILON) / 2.0);
        assert!(!DType::INPUTS.contains(&DType::F32));
        assert!(DType::OUTPUTS.contains(&DType::F32));
        assert!(!DType::OUTPUTS.contains(&DType::E4m3));
        for d in DType::INPUTS {
            assert!(d.is_input(), "{d}");
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        for d in DType::OUTPUTS {
            assert!(d.is_output(), "{d}");
        }
        assert!(!DType::F32.is_input() && !DType::E4m3.is_output());
        let e = "f64".parse::<DType>().unwrap_err();
        assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains("e4m3 or f32"), "{e}");
    }

    #[test]
    fn validation_names_the_offending_value() {
        let e = Problem::new(1, 6, 4, 4, 64).with_kv_heads(4).validate();
        assert!(e.unwrap_err().to_string().contains("kv_heads (4)"));
        let e = Problem::new(1, 1, 4, 0, 64).validate();
        assert!(e.unwrap_err().to_string().contains("seq_k"));
        let e = Problem::new(1, 1, 4, 4, 64).with_scale(f32::NAN).validate();
        assert!(e.unwrap_err().to_string().contains("NaN"));
        let e = Problem::new(1 << 20, 1 << 10, 1 << 10, 1 << 10, 64).validate();
        assert!(e.unwrap_err().to_string().contains("2^40"));
    }
}
