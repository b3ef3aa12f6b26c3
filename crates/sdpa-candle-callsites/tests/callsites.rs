//! The call sites on the CPU (sdpa's float64 reference) against candle's own attention
//! (`attention_unfused_windowed`: matmul, softmax, matmul in f32) on the same inputs, and on GPU
//! 0 with the `cuda` feature against the CPU.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use sdpa_candle::attention_unfused_windowed;
use sdpa_candle_callsites::{candle_transformers, mistralrs, tei};

fn randn(shape: impl Into<candle_core::Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)
}

/// ‖a − b‖ / ‖b‖ in f32.
fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (
        a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
        b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
    );
    let num = (&a - &b)?.sqr()?.sum_all()?.sqrt()?;
    (num / b.sqr()?.sum_all()?.sqrt()?)?.to_scalar::<f32>()
}

fn tol(dtype: DType) -> f32 {
    if dtype == DType::F16 { 3e-3 } else { 2e-2 }
}

/// Each call site on `dev`, checked against `want` (candle's attention on the CPU, or the
/// call site itself on the CPU); returns the call sites checked.
fn call_sites(dev: &Device, against_cpu: bool) -> Result<usize> {
    let cpu = Device::Cpu;
    let mut checked = 0;
    let mut check = |name: &str, got: &Tensor, want: &Tensor, dtype: DType| -> Result<()> {
        assert_eq!(got.dims(), want.dims(), "{name}");
        let rel = rel_diff(got, want)?;
        assert!(rel < tol(dtype), "{name}: {rel:e}");
        checked += 1;
        Ok(())
    };
    // candle-transformers' Llama: (b, h, s, d) in, (b, s, h · d) out, grouped-query, causal.
    for dtype in [DType::F16, DType::BF16] {
        let (q, k, v) = (
            randn((2, 8, 33, 64), dtype, dev)?,
            randn((2, 2, 33, 64), dtype, dev)?,
            randn((2, 2, 33, 64), dtype, dev)?,
        );
        let got = candle_transformers::llama_attention(&q, &k, &v)?;
        let want = if against_cpu {
            let c = |t: &Tensor| t.to_device(&cpu);
            candle_transformers::llama_attention(&c(&q)?, &c(&k)?, &c(&v)?)?
        } else {
            let t = |t: &Tensor| t.transpose(1, 2);
            attention_unfused_windowed(&t(&q)?, &t(&k)?, &t(&v)?, 0.125, None, None, Some(0))?
                .reshape((2, 33, 8 * 64))?
        };
        check("llama", &got, &want, dtype)?;
        let got = candle_transformers::struct_literal_causal(
            &q.transpose(1, 2)?,
            &k.transpose(1, 2)?,
            &v.transpose(1, 2)?,
            0.125,
        )?;
        check(
            "struct literal",
            &got.reshape((2, 33, 8 * 64))?,
            &want,
            dtype,
        )?;
    }
    // Stable Diffusion: (b · h, s, d) f32 in, run in f16.
    let (q, k, v) = (
        randn((6, 40, 64), DType::F32, dev)?,
        randn((6, 77, 64), DType::F32, dev)?,
        randn((6, 77, 64), DType::F32, dev)?,
    );
    let got = candle_transformers::stable_diffusion_attention(&q, &k, &v, 0.125)?;
    let want = if against_cpu {
        let c = |t: &Tensor| t.to_device(&cpu);
        candle_transformers::stable_diffusion_attention(&c(&q)?, &c(&k)?, &c(&v)?, 0.125)?
    } else {
        let t = |t: &Tensor| t.to_dtype(DType::F16)?.unsqueeze(0)?.transpose(1, 2);
        attention_unfused_windowed(&t(&q)?, &t(&k)?, &t(&v)?, 0.125, None, None, None)?
            .transpose(1, 2)?
            .squeeze(0)?
    };
    check("stable diffusion", &got, &want, DType::F16)?;

    // TEI: a packed QKV projection of three sequences, each layer kind, and JinaBERT's ALiBi.
    let lens = [7u32, 30, 1];
    let batch = tei::Batch::new(&lens, dev)?;
    let qkv = randn((38, 3 * 4, 64), DType::F16, dev)?;
    let slopes = tei::alibi_head_slopes(4, dev)?;
    let layers = [
        (tei::Layer::Bert, None, "bert"),
        (
            tei::Layer::ModernBertLocal { local_attention: 8 },
            None,
            "modernbert local",
        ),
        (
            tei::Layer::Causal {
                sliding_window: Some(5),
            },
            None,
            "mistral embedder",
        ),
        (tei::Layer::Bert, Some(&slopes), "jina alibi"),
    ];
    for (layer, alibi, name) in layers {
        let got = tei::attention(&qkv, &batch, layer, alibi)?;
        assert_eq!(got.dims(), &[38, 4 * 64]);
        if against_cpu {
            let cb = tei::Batch::new(&lens, &cpu)?;
            let cs = alibi.map(|s| s.to_device(&cpu)).transpose()?;
            let want = tei::attention(&qkv.to_device(&cpu)?, &cb, layer, cs.as_ref())?;
            check(name, &got, &want, DType::F16)?;
        } else {
            // Each sequence alone through candle's attention (with ALiBi, through the dense
            // op, which tests/forms.rs checks against candle's ops).
            let (left, right) = match layer {
                tei::Layer::Bert => (None, None),
                tei::Layer::ModernBertLocal { local_attention } => {
                    (Some(local_attention / 2), Some(local_attention / 2))
                }
                tei::Layer::Causal { sliding_window } => (sliding_window, Some(0)),
            };
            let mut at = 0;
            for &l in &lens {
                let l = l as usize;
                let part = |i: usize| qkv.i((at..at + l, 4 * i..4 * i + 4))?.unsqueeze(0);
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                let want = match alibi {
                    Some(s) => sdpa_candle::flash_attn_alibi(&q, &k, &v, s, 0.125, false)?,
                    None => attention_unfused_windowed(&q, &k, &v, 0.125, None, left, right)?,
                }
                .squeeze(0)?
                .flatten_from(1)?;
                check(name, &got.narrow(0, at, l)?, &want, DType::F16)?;
                at += l;
            }
        }
    }

    // mistral.rs: Gemma 2 (softcap, sliding window) dense and varlen, and the paged layer.
    let params = mistralrs::SdpaParams {
        softcap: Some(50.0),
        sliding_window: Some(16),
        softmax_scale: 0.125,
    };
    let (q, k, v) = (
        randn((2, 24, 8, 64), DType::BF16, dev)?,
        randn((2, 24, 4, 64), DType::BF16, dev)?,
        randn((2, 24, 4, 64), DType::BF16, dev)?,
    );
    let dense = mistralrs::flash_attn_v2(&q, &k, &v, None, &params, true)?;
    let fp = mistralrs::FlashParams {
        max_q: 24,
        max_k: 24,
        cumulative_seqlens_q: mistralrs::cumulative(&[24, 24], dev)?,
        cumulative_seqlens_k: mistralrs::cumulative(&[24, 24], dev)?,
    };
    let varlen = mistralrs::flash_attn_v2(&q, &k, &v, Some(&fp), &params, true)?;
    let want = if against_cpu {
        let c = |t: &Tensor| t.to_device(&cpu);
        mistralrs::flash_attn_v2(&c(&q)?, &c(&k)?, &c(&v)?, None, &params, true)?
    } else {
        attention_unfused_windowed(&q, &k, &v, 0.125, Some(50.0), Some(16), Some(0))?
    };
    check("gemma2 dense", &dense, &want, DType::BF16)?;
    check("gemma2 varlen", &varlen, &want, DType::BF16)?;

    // The paged layer: the same K and V in blocks of 16 rows, each sequence padded to two
    // blocks, the blocks stored in reverse order, each head's rows of a block together.
    let pages = |t: &Tensor| -> Result<Tensor> {
        let padded = t.pad_with_zeros(1, 0, 8)?.reshape((4, 16, 4, 64))?;
        padded
            .index_select(&Tensor::new(&[3u32, 2, 1, 0], dev)?, 0)?
            .transpose(1, 2)?
            .contiguous()
    };
    let (kc, vc) = (pages(&k)?, pages(&v)?);
    let table = Tensor::new(&[[3u32, 2], [1, 0]], dev)?;
    let paged = mistralrs::paged_attention(
        &q.transpose(1, 2)?,
        &kc,
        &vc,
        &table,
        &[24, 24],
        &[24, 24],
        16,
        &params,
    )?;
    check("paged layer", &paged.transpose(1, 2)?, &want, DType::BF16)?;
    Ok(checked)
}

#[test]
fn cpu_call_sites_compute_attention() -> Result<()> {
    assert_eq!(call_sites(&Device::Cpu, false)?, 20);
    Ok(())
}

#[test]
fn gpu_call_sites_match_the_cpu() -> Result<()> {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) if std::env::var("SDPA_REQUIRE_GPU").as_deref() != Ok("1") => {
            eprintln!("gpu call sites: skipped (no CUDA device: {e})");
            return Ok(());
        }
        Err(e) => panic!("SDPA_REQUIRE_GPU=1 but candle has no CUDA device: {e}"),
    };
    assert_eq!(call_sites(&dev, true)?, 12);
    Ok(())
}
