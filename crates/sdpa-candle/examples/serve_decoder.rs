//! A server's batch on a small Llama/Qwen-style decoder in candle (random bf16 weights, GPU 0):
//! eight requests of different prompt lengths prefilled together as one packed batch, then
//! greedy decode steps, one token a request each.
//!
//! - sdpa: prefill through `sdpa_candle::flash_attn_varlen` on the packed rows (u32 offsets, no
//!   padding), each layer's K/V written into a paged cache (vLLM's `(2, pages, page_size,
//!   kv_heads, head_dim)`, pages shuffled) by `sdpa_candle::write_kv`; each decode step writes
//!   its K/V rows by slot and attends through `sdpa_candle::flash_attn_varlen_paged_windowed`
//!   (a block table, each request's keys). The decode step also runs captured once as a CUDA
//!   graph and replayed (with candle's `enable_cuda_graph_htod_cache` on while capturing), and
//!   must give the eager loop's tokens.
//! - candle's own attention, as candle-transformers' Llama writes it without flash-attn: a
//!   left-padded `(batch, seq)` batch, dense `(batch, kv_heads, seq, head_dim)` K/V caches grown
//!   by `Tensor::cat`, K/V heads repeated, f32 scores, a causal and padding mask, softmax.
//!
//! It prints tokens/s of prefill and decode and milliseconds a decode step for each, the largest
//! difference of the prefill logits, and how many greedy steps give the same tokens as candle's
//! (random bf16 weights amplify rounding differences, so the two may part after a while; the
//! first step must agree). Each loop is timed once, after a warm-up prefill.
//!
//!     bash scripts/candle-cuda-env.sh cargo run --release -p sdpa-candle --features cuda \
//!       --example serve_decoder

use candle_core::{D, DType, Device, IndexOp, Result, Tensor, bail};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use std::time::Instant;

const LAYERS: usize = 4;
const HIDDEN: usize = 2048;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 128;
const FFN: usize = 5632;
const VOCAB: usize = 32000;
/// Prompt lengths of the batch's requests.
const PROMPTS: [usize; 8] = [100, 229, 357, 486, 614, 743, 871, 1000];
const STEPS: usize = 64;
/// Rows a cache page holds: one key tile of the sm_90 kernels at head_dim 128, so that a
/// prefill against the cache (a chunked prefill) could run there too.
const PAGE: usize = 128;
const BATCH: usize = PROMPTS.len();

/// A bias-free linear layer's weight, `(out, in)`.
struct Linear(Tensor);

impl Linear {
    fn new(out: usize, inp: usize, dev: &Device) -> Result<Self> {
        let w = (Tensor::randn(0f32, 1.0, (out, inp), dev)? / (inp as f64).sqrt())?;
        Ok(Linear(w.to_dtype(DType::BF16)?))
    }

    /// `x · Wᵀ` for `x` `(rows, in)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.0.t()?)
    }
}

/// RMSNorm with unit weights, in f32.
fn rms_norm(x: &Tensor) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let rms = (x32.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
    x32.broadcast_div(&rms)?.to_dtype(x.dtype())
}

struct Layer {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Model {
    embed: Tensor,
    layers: Vec<Layer>,
    lm_head: Linear,
    /// cos and sin of the rotary angles, `(positions, head_dim)`.
    cos: Tensor,
    sin: Tensor,
}

/// How a layer attends: given this pass's Q `(n, heads, head_dim)` and K/V `(n, kv_heads,
/// head_dim)` rows (rotated), store K/V and return the attention output `(n, heads, head_dim)`.
trait Attention {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
}

impl Model {
    fn new(dev: &Device, max_pos: usize) -> Result<Self> {
        let layers = (0..LAYERS)
            .map(|_| {
                Ok(Layer {
                    wq: Linear::new(HEADS * HEAD_DIM, HIDDEN, dev)?,
                    wk: Linear::new(KV_HEADS * HEAD_DIM, HIDDEN, dev)?,
                    wv: Linear::new(KV_HEADS * HEAD_DIM, HIDDEN, dev)?,
                    wo: Linear::new(HIDDEN, HEADS * HEAD_DIM, dev)?,
                    gate: Linear::new(FFN, HIDDEN, dev)?,
                    up: Linear::new(FFN, HIDDEN, dev)?,
                    down: Linear::new(HIDDEN, FFN, dev)?,
                })
            })
            .collect::<Result<_>>()?;
        let inv: Vec<f32> = (0..HEAD_DIM / 2)
            .map(|i| 1.0 / 1_000_000f32.powf(2.0 * i as f32 / HEAD_DIM as f32))
            .collect();
        let inv = Tensor::from_vec(inv, (1, HEAD_DIM / 2), dev)?;
        let pos = Tensor::arange(0u32, max_pos as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((max_pos, 1))?;
        let angles = pos.broadcast_mul(&inv)?;
        let angles = Tensor::cat(&[&angles, &angles], D::Minus1)?;
        Ok(Model {
            embed: Tensor::randn(0f32, 1.0, (VOCAB, HIDDEN), dev)?.to_dtype(DType::BF16)?,
            layers,
            lm_head: Linear::new(VOCAB, HIDDEN, dev)?,
            cos: angles.cos()?.to_dtype(DType::BF16)?,
            sin: angles.sin()?.to_dtype(DType::BF16)?,
        })
    }

    /// Rotary embeddings (rotate-half) of `x` `(n, heads, head_dim)` at `cos`, `sin` `(n, 1,
    /// head_dim)`.
    fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let half = HEAD_DIM / 2;
        let (x1, x2) = (
            x.narrow(D::Minus1, 0, half)?,
            x.narrow(D::Minus1, half, half)?,
        );
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
    }

    /// The final hidden states `(n, hidden)` of tokens `(n,)` u32 at positions `(n,)` u32.
    fn forward(&self, tokens: &Tensor, pos: &Tensor, attn: &mut dyn Attention) -> Result<Tensor> {
        let n = tokens.dim(0)?;
        let mut x = self.embed.index_select(tokens, 0)?;
        let cos = self.cos.index_select(pos, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(pos, 0)?.unsqueeze(1)?;
        for (i, l) in self.layers.iter().enumerate() {
            let h = rms_norm(&x)?;
            let q = l.wq.forward(&h)?.reshape((n, HEADS, HEAD_DIM))?;
            let k = l.wk.forward(&h)?.reshape((n, KV_HEADS, HEAD_DIM))?;
            let v = l.wv.forward(&h)?.reshape((n, KV_HEADS, HEAD_DIM))?;
            let (q, k) = (Self::rotary(&q, &cos, &sin)?, Self::rotary(&k, &cos, &sin)?);
            let o = attn.attend(i, &q, &k, &v)?;
            x = (x + l.wo.forward(&o.reshape((n, HEADS * HEAD_DIM))?)?)?;
            let h = rms_norm(&x)?;
            let mlp = (l.gate.forward(&h)?.silu()? * l.up.forward(&h)?)?;
            x = (x + l.down.forward(&mlp)?)?;
        }
        rms_norm(&x)
    }

    /// Logits `(rows, vocab)` in f32 of hidden states `(rows, hidden)`.
    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(h)?.to_dtype(DType::F32)
    }
}

const SCALE: f32 = 0.088_388_35; // 1 / sqrt(HEAD_DIM)

/// sdpa's side: one paged cache a layer, K and V its two halves, and this pass's metadata.
struct Paged {
    kv: Vec<Tensor>,
    /// i64 `(n,)`: where each of this pass's rows goes in the cache.
    slots: Tensor,
    /// u32 offsets of each request's queries in this pass's rows.
    cu_q: Tensor,
    max_q: usize,
    /// Prefill: u32 offsets of each request's keys in this pass's rows (packed K/V). Decode:
    /// each request's keys in the cache as offsets, read through `table`.
    cu_k: Tensor,
    max_k: usize,
    /// u32 `(batch, pages_per_seq)` for decode; `None` for prefill.
    table: Option<Tensor>,
}

impl Attention for Paged {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (kc, vc) = (self.kv[layer].get(0)?, self.kv[layer].get(1)?);
        sdpa_candle::write_kv(&kc, &vc, k, v, &self.slots)?;
        match &self.table {
            None => sdpa_candle::flash_attn_varlen(
                q, k, v, &self.cu_q, &self.cu_k, self.max_q, self.max_k, SCALE, true,
            ),
            Some(table) => sdpa_candle::flash_attn_varlen_paged_windowed(
                q,
                &kc,
                &vc,
                &self.cu_q,
                &self.cu_k,
                table,
                None,
                self.max_q,
                self.max_k,
                SCALE,
                None,
                Some(0),
                PAGE,
                None,
            ),
        }
    }
}

/// candle's side: dense `(batch, kv_heads, seq, head_dim)` caches a layer grown by
/// `Tensor::cat`, and an additive f32 mask `(batch, 1, seq_q, seq_k)` for this pass.
struct Dense {
    kv: Vec<Option<(Tensor, Tensor)>>,
    mask: Tensor,
}

impl Attention for Dense {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let s = q.dim(0)? / BATCH;
        let heads_first = |t: &Tensor, h: usize| {
            t.reshape((BATCH, s, h, HEAD_DIM))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (
            heads_first(q, HEADS)?,
            heads_first(k, KV_HEADS)?,
            heads_first(v, KV_HEADS)?,
        );
        let (k, v) = match self.kv[layer].take() {
            None => (k, v),
            Some((kc, vc)) => (Tensor::cat(&[&kc, &k], 2)?, Tensor::cat(&[&vc, &v], 2)?),
        };
        self.kv[layer] = Some((k.clone(), v.clone()));
        // candle-transformers' repeat_kv, then attention in f32.
        let repeat = |t: &Tensor| {
            let (b, h, n, d) = t.dims4()?;
            Tensor::cat(&[t; HEADS / KV_HEADS], 2)?.reshape((b, h * HEADS / KV_HEADS, n, d))
        };
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            repeat(&k)?.to_dtype(DType::F32)?,
            repeat(&v)?.to_dtype(DType::F32)?,
        );
        let scores = (q.matmul(&k.t()?)? * f64::from(SCALE))?.broadcast_add(&self.mask)?;
        let e = scores
            .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
            .exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        p.matmul(&v)?
            .to_dtype(DType::BF16)?
            .transpose(1, 2)?
            .reshape((BATCH * s, HEADS, HEAD_DIM))
    }
}

/// Deterministic prompt tokens.
fn prompt(b: usize, len: usize) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ b as u64;
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % VOCAB as u64) as u32
        })
        .collect()
}

/// u32 offsets `0, a₀, a₀ + a₁, ..` of lengths `a`.
fn offsets(lens: impl IntoIterator<Item = usize>, dev: &Device) -> Result<Tensor> {
    let mut cu = vec![0u32];
    for l in lens {
        cu.push(cu[cu.len() - 1] + l as u32);
    }
    Tensor::new(cu, dev)
}

/// Seconds `f` takes, the device synchronised before and after.
fn timed<T>(dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    dev.synchronize()?;
    let t0 = Instant::now();
    let out = f()?;
    dev.synchronize()?;
    Ok((out, t0.elapsed().as_secs_f64()))
}

/// Where each request's pages are: request b's `j`-th page is `table[b][j]`; the pages are
/// handed out shuffled, as a server's allocator leaves them.
struct Pages {
    table: Vec<Vec<u32>>,
    per_seq: usize,
    total: usize,
}

impl Pages {
    fn new() -> Self {
        let per_seq = (PROMPTS[BATCH - 1] + STEPS).div_ceil(PAGE);
        let need: Vec<usize> = PROMPTS
            .iter()
            .map(|&l| (l + STEPS).div_ceil(PAGE))
            .collect();
        let total: usize = need.iter().sum();
        // A fixed permutation of 0..total (7 is coprime with every total here but multiples
        // of 7, which the assertion below refuses).
        assert!(!total.is_multiple_of(7), "pick another stride");
        let mut next = (0..total).map(|i| ((i * 7) % total) as u32);
        let table = need
            .iter()
            .map(|&n| {
                let mut row: Vec<u32> = next.by_ref().take(n).collect();
                row.resize(per_seq, 0);
                row
            })
            .collect();
        Pages {
            table,
            per_seq,
            total,
        }
    }

    /// The slot of request b's position `pos`.
    fn slot(&self, b: usize, pos: usize) -> i64 {
        (self.table[b][pos / PAGE] as usize * PAGE + pos % PAGE) as i64
    }

    fn tensor(&self, dev: &Device) -> Result<Tensor> {
        Tensor::new(self.table.concat(), dev)?.reshape((BATCH, self.per_seq))
    }
}

/// What one run gives: the prefill's last-token logits, each step's tokens, and its times.
struct Run {
    logits: Tensor,
    tokens: Vec<Vec<u32>>,
    prefill_s: f64,
    decode_s: f64,
}

fn run_sdpa(model: &Model, dev: &Device, pages: &Pages, graph: bool) -> Result<Run> {
    let max_prompt = PROMPTS[BATCH - 1];
    let tokens: Vec<u32> = (0..BATCH).flat_map(|b| prompt(b, PROMPTS[b])).collect();
    let pos: Vec<u32> = PROMPTS.iter().flat_map(|&l| 0..l as u32).collect();
    let slots: Vec<i64> = (0..BATCH)
        .flat_map(|b| (0..PROMPTS[b]).map(move |p| pages.slot(b, p)))
        .collect();
    let cu = offsets(PROMPTS, dev)?;
    let last = Tensor::new(
        PROMPTS
            .iter()
            .scan(0u32, |end, &l| {
                *end += l as u32;
                Some(*end - 1)
            })
            .collect::<Vec<_>>(),
        dev,
    )?;
    let kv = (0..LAYERS)
        .map(|_| Tensor::zeros((2, pages.total, PAGE, KV_HEADS, HEAD_DIM), DType::BF16, dev))
        .collect::<Result<Vec<_>>>()?;
    let mut attn = Paged {
        kv,
        slots: Tensor::new(slots, dev)?,
        cu_q: cu.clone(),
        max_q: max_prompt,
        cu_k: cu,
        max_k: max_prompt,
        table: None,
    };
    let (tokens, pos) = (Tensor::new(tokens, dev)?, Tensor::new(pos, dev)?);
    let prefill = |attn: &mut Paged| -> Result<Tensor> {
        let h = model.forward(&tokens, &pos, attn)?;
        model.logits(&h.index_select(&last, 0)?)
    };
    prefill(&mut attn)?; // warm-up (the cache's rows are rewritten alike)
    let (logits, prefill_s) = timed(dev, || prefill(&mut attn))?;

    // Decode: every request feeds its last token at position len_b, the cache read through the
    // block table.
    attn.table = Some(pages.tensor(dev)?);
    attn.cu_q = Tensor::arange(0u32, BATCH as u32 + 1, dev)?;
    attn.max_q = 1;
    // The longest sequence bounds the keys a step reads: the cache's capacity a request, fixed
    // for every step, as a graph's kernel arguments must be (and alike in both loops, so that
    // they run the same kernels and pick the same tokens).
    attn.max_k = pages.per_seq * PAGE;
    let mut next = logits.argmax(D::Minus1)?;
    let mut steps = Vec::with_capacity(STEPS);
    let decode_s = if graph {
        decode_graph(model, dev, pages, &mut attn, &next, &mut steps)?
    } else {
        let decode = |attn: &mut Paged, next: &mut Tensor, steps: &mut Vec<Tensor>| -> Result<()> {
            for s in 0..STEPS {
                let at: Vec<usize> = PROMPTS.iter().map(|&l| l + s).collect();
                let slots: Vec<i64> = (0..BATCH).map(|b| pages.slot(b, at[b])).collect();
                attn.slots = Tensor::new(slots, dev)?;
                attn.cu_k = offsets(at.iter().map(|&p| p + 1), dev)?;
                let pos = Tensor::new(at.iter().map(|&p| p as u32).collect::<Vec<_>>(), dev)?;
                let h = model.forward(next, &pos, attn)?;
                *next = model.logits(&h)?.argmax(D::Minus1)?;
                steps.push(next.clone());
            }
            Ok(())
        };
        timed(dev, || decode(&mut attn, &mut next, &mut steps))?.1
    };
    Ok(Run {
        logits,
        tokens: steps
            .iter()
            .map(|t| t.to_vec1::<u32>())
            .collect::<Result<_>>()?,
        prefill_s,
        decode_s,
    })
}

/// The decode loop as one CUDA graph captured from the eager step and replayed: this step's
/// tokens, positions and key offsets live in device tensors the step itself advances, its slots
/// are derived from them and the block table on the device. Each step's tokens are copied out
/// after its replay.
fn decode_graph(
    model: &Model,
    dev: &Device,
    pages: &Pages,
    attn: &mut Paged,
    next: &Tensor,
    steps: &mut Vec<Tensor>,
) -> Result<f64> {
    let Device::Cuda(cuda) = dev else {
        bail!("the graph needs a CUDA device");
    };
    let table = pages.tensor(dev)?;
    let start_at = Tensor::new(PROMPTS.map(|l| l as u32).as_slice(), dev)?;
    let start_cu_k = offsets(PROMPTS.map(|l| l + 1), dev)?;
    let (at, cu_k, tokens) = (start_at.copy()?, start_cu_k.copy()?, next.copy()?);
    let ramp = Tensor::arange(0u32, BATCH as u32 + 1, dev)?;
    let (one, page) = (
        Tensor::new(&[1u32], dev)?,
        Tensor::new(&[PAGE as u32], dev)?,
    );
    let history = Tensor::zeros((STEPS, BATCH), DType::U32, dev)?;
    attn.cu_k = cu_k.clone();
    // Every tensor the step makes is dropped within it, so that a captured step leaves no
    // allocation of the graph alive between replays.
    let outside = attn.slots.clone();
    let step = |attn: &mut Paged| -> Result<()> {
        let page_of = at.broadcast_div(&page)?;
        let first = table.gather(&page_of.unsqueeze(1)?, 1)?.squeeze(1)?;
        let offset = (&at - page_of.broadcast_mul(&page)?)?;
        attn.slots = (first.broadcast_mul(&page)? + offset)?.to_dtype(DType::I64)?;
        let h = model.forward(&tokens, &at, attn)?;
        let out = model.logits(&h)?.argmax(D::Minus1)?;
        tokens.slice_set(&out, 0, 0)?;
        at.slice_set(&at.broadcast_add(&one)?, 0, 0)?;
        cu_k.slice_set(&(&cu_k + &ramp)?, 0, 0)?;
        attn.slots = outside.clone();
        Ok(())
    };
    // candle uploads a strided or broadcast op's dims and strides from a host vector at each
    // launch, which a replay would read after it is freed; with this cache on, each vector is
    // uploaded once into a buffer that stays, and the capture reuses it.
    let htod_cache = cuda.enable_cuda_graph_htod_cache();
    // One eager step first: it fills that cache, loads every kernel and sizes sdpa's and
    // cuBLAS's scratch for these shapes, none of which may happen inside a capture; then the
    // state goes back.
    step(attn)?;
    tokens.slice_set(next, 0, 0)?;
    at.slice_set(&start_at, 0, 0)?;
    cu_k.slice_set(&start_cu_k, 0, 0)?;
    let stream = cuda.cuda_stream();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(candle_core::Error::wrap)?;
    let captured = step(attn);
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(candle_core::Error::wrap)?;
    drop(htod_cache);
    captured?;
    let Some(graph) = graph else {
        bail!("the capture made no graph");
    };
    let ((), seconds) = timed(dev, || {
        for s in 0..STEPS {
            graph.launch().map_err(candle_core::Error::wrap)?;
            history.slice_set(&tokens.unsqueeze(0)?, 0, s)?;
        }
        Ok(())
    })?;
    steps.extend(
        (0..STEPS)
            .map(|s| history.i(s))
            .collect::<Result<Vec<_>>>()?,
    );
    Ok(seconds)
}

fn run_dense(model: &Model, dev: &Device) -> Result<Run> {
    let max_prompt = PROMPTS[BATCH - 1];
    // Left padding: request b's prompt ends at column max_prompt − 1; its pad keys are masked
    // and its pad rows see only themselves (a row that sees no key would be NaN).
    let pad = PROMPTS.map(|l| max_prompt - l);
    let tokens: Vec<u32> = (0..BATCH)
        .flat_map(|b| {
            let mut t = vec![0u32; pad[b]];
            t.extend(prompt(b, PROMPTS[b]));
            t
        })
        .collect();
    let pos: Vec<u32> = (0..BATCH)
        .flat_map(|b| (0..max_prompt).map(move |j| j.saturating_sub(pad[b]) as u32))
        .collect();
    let mask: Vec<f32> = (0..BATCH)
        .flat_map(|b| {
            let p = pad[b];
            (0..max_prompt).flat_map(move |i| {
                (0..max_prompt).map(move |j| {
                    let seen = (j <= i && j >= p) || (i < p && j == i);
                    if seen { 0.0 } else { f32::NEG_INFINITY }
                })
            })
        })
        .collect();
    let mut attn = Dense {
        kv: vec![None; LAYERS],
        mask: Tensor::from_vec(mask, (BATCH, 1, max_prompt, max_prompt), dev)?,
    };
    let (tokens, pos) = (Tensor::new(tokens, dev)?, Tensor::new(pos, dev)?);
    let last = Tensor::new(
        (0..BATCH)
            .map(|b| ((b + 1) * max_prompt - 1) as u32)
            .collect::<Vec<_>>(),
        dev,
    )?;
    let prefill = |attn: &mut Dense| -> Result<Tensor> {
        attn.kv = vec![None; LAYERS];
        let h = model.forward(&tokens, &pos, attn)?;
        model.logits(&h.index_select(&last, 0)?)
    };
    prefill(&mut attn)?; // warm-up
    let (logits, prefill_s) = timed(dev, || prefill(&mut attn))?;

    // Decode: one column a step; each request's pad keys stay masked.
    let pad_mask: Vec<f32> = (0..BATCH)
        .flat_map(|b| {
            (0..max_prompt).map(move |j| if j < pad[b] { f32::NEG_INFINITY } else { 0.0 })
        })
        .collect();
    let pad_mask = Tensor::from_vec(pad_mask, (BATCH, 1, 1, max_prompt), dev)?;
    let zero = Tensor::zeros((BATCH, 1, 1, 1), DType::F32, dev)?;
    let mut next = logits.argmax(D::Minus1)?;
    let mut steps = Vec::with_capacity(STEPS);
    let decode = |attn: &mut Dense, next: &mut Tensor, steps: &mut Vec<Tensor>| -> Result<()> {
        let mut mask = pad_mask.clone();
        for s in 0..STEPS {
            mask = Tensor::cat(&[&mask, &zero], 3)?;
            attn.mask = mask.clone();
            let pos = Tensor::new(PROMPTS.map(|l| (l + s) as u32).as_slice(), dev)?;
            let h = model.forward(next, &pos, attn)?;
            *next = model.logits(&h)?.argmax(D::Minus1)?;
            steps.push(next.clone());
        }
        Ok(())
    };
    let ((), decode_s) = timed(dev, || decode(&mut attn, &mut next, &mut steps))?;
    Ok(Run {
        logits,
        tokens: steps
            .iter()
            .map(|t| t.to_vec1::<u32>())
            .collect::<Result<_>>()?,
        prefill_s,
        decode_s,
    })
}

fn report(name: &str, r: &Run) {
    let prompt_tokens: usize = PROMPTS.iter().sum();
    println!(
        "{name:<28} prefill {:>8.0} tokens/s ({:>6.2} ms)   decode {:>6.0} tokens/s ({:.3} ms/step)",
        prompt_tokens as f64 / r.prefill_s,
        r.prefill_s * 1e3,
        (BATCH * STEPS) as f64 / r.decode_s,
        r.decode_s * 1e3 / STEPS as f64,
    );
}

/// Steps from the first whose tokens agree for every request.
fn agreeing_steps(a: &Run, b: &Run) -> usize {
    a.tokens
        .iter()
        .zip(&b.tokens)
        .take_while(|(x, y)| x == y)
        .count()
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let pages = Pages::new();
    let model = Model::new(&dev, pages.per_seq * PAGE)?;
    println!(
        "decoder: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads ({KV_HEADS} KV) of {HEAD_DIM}, \
         FFN {FFN}, vocab {VOCAB}, bf16, random weights"
    );
    println!(
        "batch: {BATCH} requests, prompts {PROMPTS:?} ({} tokens), {STEPS} greedy steps; paged \
         cache of {} pages of {PAGE}",
        PROMPTS.iter().sum::<usize>(),
        pages.total
    );
    let ours = run_sdpa(&model, &dev, &pages, false)?;
    // A capture that fails is reported, not fatal: the other two runs still compare.
    let graph = run_sdpa(&model, &dev, &pages, true);
    let dense = run_dense(&model, &dev)?;
    report("sdpa (varlen + paged)", &ours);
    match &graph {
        Ok(g) => report("sdpa, decode as CUDA graph", g),
        Err(e) => println!("sdpa, decode as CUDA graph: failed: {e}"),
    }
    report("candle attention (dense)", &dense);
    let diff = (&ours.logits - &dense.logits)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let scale = dense.logits.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("prefill logits: max |sdpa − candle| {diff:.3e} (largest |logit| {scale:.3e})");
    println!(
        "greedy tokens: sdpa and candle agree for the first {} of {STEPS} steps",
        agreeing_steps(&ours, &dense)
    );
    if let Ok(g) = &graph {
        let same = agreeing_steps(&ours, g);
        println!("greedy tokens: the graph replay and the eager sdpa steps agree for {same}");
        if same != STEPS {
            bail!("the graph replay's tokens differ from the eager steps'");
        }
    }
    if agreeing_steps(&ours, &dense) == 0 {
        bail!("sdpa's first greedy tokens differ from candle's");
    }
    Ok(())
}
