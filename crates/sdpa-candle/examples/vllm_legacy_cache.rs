//! vLLM's legacy paged cache (the layout of its own paged-attention kernels: K
//! `(pages, kv_heads, head_dim / x, page_size, x)`, x the elements of 16 bytes, and V
//! `(pages, kv_heads, head_dim, page_size)`) converted with candle's own ops into the NHD pages
//! `flash_attn_varlen_paged_windowed` reads, on GPU 0: the conversion checked exact, a decode
//! step on the converted cache checked against the CPU, and the conversion's time for a cache
//! of about 1 GB.
//!
//! sdpa does not read the legacy layout in place: a key row lies in `head_dim / x` pieces of 16
//! bytes, `page_size · 16` bytes apart, which no row-major tile of the fused kernels (TMA boxes,
//! cp.async rows) describes. vLLM's own engine allocates NHD pages for its FlashAttention and
//! FlashInfer backends, and those sdpa reads as they are.
//!
//!     bash scripts/candle-cuda-env.sh cargo run --release -p sdpa-candle --features cuda \
//!         --example vllm_legacy_cache

use candle_core::{DType, Device, Result, Tensor};
use std::time::Instant;

const KV_HEADS: usize = 8;
const HEADS: usize = 32;
const HEAD_DIM: usize = 128;
const PAGE: usize = 16;
/// bf16 elements in 16 bytes: vLLM's `x`.
const X: usize = 8;

/// K in the legacy layout from NHD pages `(pages, page, kv_heads, head_dim)`.
fn legacy_k(k: &Tensor) -> Result<Tensor> {
    let (pages, page, heads, d) = k.dims4()?;
    k.reshape((pages, page, heads, d / X, X))?
        .permute((0, 2, 3, 1, 4))?
        .contiguous()
}

/// V in the legacy layout from NHD pages.
fn legacy_v(v: &Tensor) -> Result<Tensor> {
    v.permute((0, 2, 3, 1))?.contiguous()
}

/// The conversion a server runs once on a legacy cache: NHD pages from its K and V.
fn nhd_from_legacy(k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    let (pages, heads, chunks, page, x) = k.dims5()?;
    let k = k
        .permute((0, 3, 1, 2, 4))?
        .contiguous()?
        .reshape((pages, page, heads, chunks * x))?;
    let v = v.permute((0, 3, 1, 2))?.contiguous()?;
    Ok((k, v))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar()
}

/// One decode step (a query token for each of `lens`' sequences) over the cache on `dev`.
fn decode(q: &Tensor, k: &Tensor, v: &Tensor, lens: &[u32], table: &[u32]) -> Result<Tensor> {
    let dev = q.device();
    let mut cu_k = vec![0u32];
    for l in lens {
        cu_k.push(cu_k.last().unwrap() + l);
    }
    let cu_q: Vec<u32> = (0..=lens.len() as u32).collect();
    let pages_per_seq = table.len() / lens.len();
    sdpa_candle::flash_attn_varlen_paged_windowed(
        q,
        k,
        v,
        &Tensor::new(cu_q.as_slice(), dev)?,
        &Tensor::new(cu_k.as_slice(), dev)?,
        &Tensor::new(table, dev)?.reshape((lens.len(), pages_per_seq))?,
        None,
        1,
        *lens.iter().max().unwrap() as usize,
        1.0 / (HEAD_DIM as f32).sqrt(),
        None,
        Some(0),
        PAGE,
        None,
    )
}

fn main() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let randn = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        Tensor::randn(0f32, 1.0, shape, &gpu)?.to_dtype(DType::BF16)
    };

    // Correctness on a small cache: three sequences over shuffled pages.
    let pages = 24;
    let (k, v) = (
        randn((pages, PAGE, KV_HEADS, HEAD_DIM))?,
        randn((pages, PAGE, KV_HEADS, HEAD_DIM))?,
    );
    let (k_back, v_back) = nhd_from_legacy(&legacy_k(&k)?, &legacy_v(&v)?)?;
    let exact = max_abs_diff(&k, &k_back)?.max(max_abs_diff(&v, &v_back)?);
    assert_eq!(exact, 0.0, "the converted cache differs from the original");
    let lens = [37u32, 128, 5];
    let table: Vec<u32> = (0..24u32).rev().collect();
    let q = Tensor::randn(0f32, 1.0, (lens.len(), HEADS, HEAD_DIM), &gpu)?.to_dtype(DType::BF16)?;
    let on_gpu = decode(&q, &k_back, &v_back, &lens, &table)?;
    let cpu = Device::Cpu;
    let on_cpu = decode(
        &q.to_device(&cpu)?,
        &k.to_device(&cpu)?,
        &v.to_device(&cpu)?,
        &lens,
        &table,
    )?;
    let err = max_abs_diff(&on_gpu.to_device(&cpu)?, &on_cpu)?;
    println!("conversion exact; decode on the converted cache vs the CPU: max |diff| {err:.2e}");
    assert!(err < 2e-2, "decode on the converted cache is off by {err}");

    // Cost on a cache of about 1 GB (K and V, bf16).
    let pages = 16384;
    let (k, v) = (
        legacy_k(&randn((pages, PAGE, KV_HEADS, HEAD_DIM))?)?,
        legacy_v(&randn((pages, PAGE, KV_HEADS, HEAD_DIM))?)?,
    );
    let bytes = 2 * k.elem_count() * DType::BF16.size_in_bytes();
    nhd_from_legacy(&k, &v)?;
    gpu.synchronize()?;
    let runs = 10;
    let start = Instant::now();
    for _ in 0..runs {
        nhd_from_legacy(&k, &v)?;
    }
    gpu.synchronize()?;
    let secs = start.elapsed().as_secs_f64() / runs as f64;
    println!(
        "converting {:.2} GB of K and V: {:.2} ms ({:.0} GB/s read + written)",
        bytes as f64 / 1e9,
        secs * 1e3,
        2.0 * bytes as f64 / secs / 1e9
    );
    Ok(())
}
