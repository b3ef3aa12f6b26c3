//! A serving loop: prefill four prompts of different lengths (packed, varlen attention), copy
//! their keys and values into a paged cache, then decode: each step appends one new key/value row
//! a sequence and attends with one new query token, the whole step captured once in a CUDA graph
//! and replayed. Every output is checked against the float64 reference on the cache as it stands.
//!
//! ```sh
//! cargo run --release -p sdpa --example decode_loop
//! ```

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use sdpa::{
    Backend, DType, Device, Extras, KvAppend, Plan, Problem, SeqMeta, Tensor, Tensors, append_kv,
};

const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;
const PAGE: usize = 64;
const STEPS: usize = 16;
const DTYPE: DType = DType::Bf16;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// ||got - want|| / ||want||.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    (num / den).sqrt()
}

fn main() -> sdpa::Result<()> {
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("decode_loop: no GPU ({e}); nothing to run");
            return Ok(());
        }
    };
    let stream = dev.stream().clone();
    let prompts = [300usize, 77, 512, 129];
    let batch = prompts.len();
    let max_prompt = *prompts.iter().max().unwrap();

    // Prefill: the prompts packed (Q [total, heads, D], K/V [total, kv_heads, D]), causal.
    let total: usize = prompts.iter().sum();
    let cu: Vec<i32> = std::iter::once(0)
        .chain(prompts.iter().scan(0, |s, &l| {
            *s += l as i32;
            Some(*s)
        }))
        .collect();
    let prefill = Problem::new(batch, HEADS, max_prompt, max_prompt, D)
        .with_kv_heads(KV_HEADS)
        .with_causal(true)
        .with_dtype(DTYPE)
        .with_packed_q(total)
        .with_packed_kv(total);
    let (q_host, k_host, v_host) = (
        values(total * HEADS * D, 1),
        values(total * KV_HEADS * D, 2),
        values(total * KV_HEADS * D, 3),
    );
    let q = Tensor::from_f32(&dev, DTYPE, &q_host)?;
    let (k, v) = (
        Tensor::from_f32(&dev, DTYPE, &k_host)?,
        Tensor::from_f32(&dev, DTYPE, &v_host)?,
    );
    let mut out = Tensor::poisoned(&dev, DTYPE, prefill.q_len().unwrap())?;
    let cu_dev = stream.clone_htod(&cu)?;
    let extras = Extras {
        cu_seqlens_q: Some(cu_dev.as_view()),
        cu_seqlens_k: Some(cu_dev.as_view()),
        ..Extras::default()
    };
    let t = Tensors {
        q: &q,
        k: &k,
        v: &v,
        out: &mut out,
    };
    let used = sdpa::Backend::Auto.resolve(Some(&dev), &prefill)?;
    sdpa::forward(&dev, &prefill, Backend::Auto, t, extras)?;
    let meta = SeqMeta {
        cu_seqlens_q: Some(cu.clone()),
        cu_seqlens_k: Some(cu.clone()),
        ..SeqMeta::default()
    };
    let [qr, kr, vr] = [&q, &k, &v].map(|t| t.to_f64(&dev));
    let want = sdpa::reference_seqs(&prefill, &qr?, &kr?, &vr?, None, None, &meta)?;
    let err = rel_err(&out.to_f64(&dev)?, &want.out);
    println!("prefill: {batch} prompts, {total} tokens on {used}: rel_err {err:.2e}");
    assert!(err < 2e-2, "prefill rel_err {err}");

    // The cache: room for the longest prompt and every step, each sequence's pages scattered.
    let pages_per_seq = (max_prompt + STEPS).div_ceil(PAGE);
    let pages = batch * pages_per_seq;
    let capacity = pages_per_seq * PAGE;
    let decode = Problem::new(batch, HEADS, 1, capacity, D)
        .with_kv_heads(KV_HEADS)
        .with_causal(true)
        .with_dtype(DTYPE)
        .with_layout(sdpa::Layout::Bshd)
        .with_paged_kv(pages, PAGE, pages_per_seq);
    let table: Vec<i32> = (0..pages as i32).map(|i| (i * 7) % pages as i32).collect();
    let table_dev = stream.clone_htod(&table)?;
    let mut seqused = stream.clone_htod(&vec![0i32; batch])?;
    let mut k_cache = Tensor::zeros(&dev, DTYPE, decode.k_len().unwrap())?;
    let mut v_cache = Tensor::zeros(&dev, DTYPE, decode.k_len().unwrap())?;

    // The prompts' keys and values into the cache: padded to the longest prompt, appended at
    // once, then each sequence's length set to its prompt's.
    let row = KV_HEADS * D;
    let mut kp = vec![0f32; batch * max_prompt * row];
    let mut vp = kp.clone();
    for b in 0..batch {
        let src = cu[b] as usize * row;
        let n = prompts[b] * row;
        kp[b * max_prompt * row..][..n].copy_from_slice(&k_host[src..][..n]);
        vp[b * max_prompt * row..][..n].copy_from_slice(&v_host[src..][..n]);
    }
    let (kp, vp) = (
        Tensor::from_f32(&dev, DTYPE, &kp)?,
        Tensor::from_f32(&dev, DTYPE, &vp)?,
    );
    append_kv(
        &dev,
        &decode,
        KvAppend {
            k_new: &kp,
            v_new: &vp,
            n_new: max_prompt,
            k_cache: &mut k_cache,
            v_cache: &mut v_cache,
            block_table: table_dev.as_view(),
            seqused_k: seqused.as_view_mut(),
        },
    )?;
    let lengths: Vec<i32> = prompts.iter().map(|&l| l as i32).collect();
    stream.memcpy_htod(&lengths, &mut seqused)?;

    // One decode step: append this step's key/value row, attend with this step's query. Captured
    // once; every replay appends at the advanced lengths and reads the grown cache.
    let q_new = Tensor::zeros(&dev, DTYPE, batch * HEADS * D)?;
    let (k_new, v_new) = (
        Tensor::zeros(&dev, DTYPE, batch * row)?,
        Tensor::zeros(&dev, DTYPE, batch * row)?,
    );
    let mut out = Tensor::zeros(&dev, DTYPE, decode.q_len().unwrap())?;
    let backend = Plan::new(&dev, &decode, Backend::Auto)?
        .reserve()?
        .backend();
    let mut step = |k_cache: &mut Tensor, v_cache: &mut Tensor, out: &mut Tensor| {
        append_kv(
            &dev,
            &decode,
            KvAppend {
                k_new: &k_new,
                v_new: &v_new,
                n_new: 1,
                k_cache: &mut *k_cache,
                v_cache: &mut *v_cache,
                block_table: table_dev.as_view(),
                seqused_k: seqused.as_view_mut(),
            },
        )?;
        let extras = Extras {
            seqused_k: Some(seqused.as_view()),
            block_table: Some(table_dev.as_view()),
            ..Extras::default()
        };
        let t = Tensors {
            q: &q_new,
            k: k_cache,
            v: v_cache,
            out,
        };
        sdpa::forward(&dev, &decode, backend, t, extras)
    };
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = step(&mut k_cache, &mut v_cache, &mut out);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
    captured?;
    let graph = graph.ok_or_else(|| sdpa::Error::Cuda("the capture made no graph".into()))?;

    let mut worst: f64 = 0.0;
    let mut q_new = q_new;
    let (mut k_new, mut v_new) = (k_new, v_new);
    for s in 0..STEPS {
        // This step's new token: its query, key and value rows (uploaded outside the graph).
        let seed = 100 + 3 * s as u64;
        q_new.write_bits(&dev, &sdpa::encode(DTYPE, &values(batch * HEADS * D, seed)))?;
        k_new.write_bits(&dev, &sdpa::encode(DTYPE, &values(batch * row, seed + 1)))?;
        v_new.write_bits(&dev, &sdpa::encode(DTYPE, &values(batch * row, seed + 2)))?;
        graph.launch()?;
        // The reference on the cache as the step left it.
        let meta = SeqMeta {
            seqused_k: Some(stream.clone_dtoh(&seqused)?),
            block_table: Some(table.clone()),
            ..SeqMeta::default()
        };
        let want = sdpa::reference_seqs(
            &decode,
            &q_new.to_f64(&dev)?,
            &k_cache.to_f64(&dev)?,
            &v_cache.to_f64(&dev)?,
            None,
            None,
            &meta,
        )?;
        worst = worst.max(rel_err(&out.to_f64(&dev)?, &want.out));
    }
    let lengths = stream.clone_dtoh(&seqused)?;
    println!(
        "decode: {STEPS} steps replayed from one CUDA graph on {backend}, lengths now \
         {lengths:?}: worst rel_err {worst:.2e}"
    );
    assert!(worst < 2e-2, "decode rel_err {worst}");
    Ok(())
}
