//! candle-flash-attn's ALiBi and paged forms, the log-sum-exp the ops also give, and their
//! backward (the CPU's; none on a GPU yet): on the CPU against candle's own ops (or the packed form the
//! paged one must equal), and on GPU 0 with the `cuda` feature against the CPU op (sdpa's
//! float64 reference) on the same inputs.

mod common;

use candle_core::{D, DType, Device, IndexOp, Result, Tensor, Var};
use common::{cpu, gpu, max_abs, offsets, randn, rel_diff, seqlens};
use sdpa_candle::{
    FlashAttn, FlashAttnVarLen, attention_unfused_windowed, flash_attn, flash_attn_alibi,
    flash_attn_alibi_windowed_softcap, flash_attn_varlen, flash_attn_varlen_alibi,
    flash_attn_varlen_paged_windowed, flash_attn_varlen_windowed,
};

/// Slopes of `heads` heads as ALiBi's paper gives them (2^(−8h/heads)), f32 `(heads)`.
fn slopes(heads: usize, dev: &Device) -> Result<Tensor> {
    let s: Vec<f32> = (1..=heads)
        .map(|h| 2f32.powf(-8.0 * h as f32 / heads as f32))
        .collect();
    Tensor::new(s.as_slice(), dev)
}

/// Attention with ALiBi from candle's ops in f32 on `(batch, seq, heads, head_dim)` tensors:
/// scores plus `−slope · |i + sk − sq − j|`, causal bottom-right when asked; and each row's
/// log-sum-exp `(batch, heads, seq_q)`.
fn unfused_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    slopes: Option<&Tensor>,
    scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let (_, sq, h, _) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let heads_first = |t: &Tensor, g: usize| -> Result<Tensor> {
        let t = t.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
        let (b, n, s, d) = t.dims4()?;
        t.unsqueeze(2)?
            .broadcast_as((b, n, g, s, d))?
            .reshape((b, n * g, s, d))
    };
    let (q, k, v) = (
        heads_first(q, 1)?,
        heads_first(k, h / hk)?,
        heads_first(v, h / hk)?,
    );
    let mut scores = (q.matmul(&k.t()?)? * f64::from(scale))?;
    let diag = sk as i64 - sq as i64;
    if let Some(s) = slopes {
        let dist: Vec<f32> = (0..sq as i64)
            .flat_map(|i| (0..sk as i64).map(move |j| (i + diag - j).abs() as f32))
            .collect();
        let dist = Tensor::from_vec(dist, (1, 1, sq, sk), q.device())?;
        let bias = dist.broadcast_mul(&s.reshape((1, h, 1, 1))?)?.neg()?;
        scores = scores.broadcast_add(&bias)?;
    }
    if causal {
        let mask: Vec<f32> = (0..sq as i64)
            .flat_map(|i| {
                (0..sk as i64).map(move |j| {
                    if j <= i + diag {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(mask, (sq, sk), q.device())?)?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let lse = (sum.log()? + &max)?.squeeze(D::Minus1)?;
    let out = e.broadcast_div(&sum)?.matmul(&v)?.transpose(1, 2)?;
    Ok((out, lse))
}

/// The same cache stored head after head within each page (HND), viewed in the
/// `(pages, page_size, kv_heads, head_dim)` shape, as a `(pages, kv_heads, page_size, head_dim)`
/// cache transposed.
fn hnd(t: &Tensor) -> Result<Tensor> {
    t.transpose(1, 2)?.contiguous()?.transpose(1, 2)
}

/// The tolerance of a dtype's rounding against f32 or f64 math.
fn tol(dtype: DType) -> f32 {
    if dtype == DType::F16 { 2e-3 } else { 1.5e-2 }
}

#[test]
fn alibi_is_flash_attentions_bias() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F16, DType::BF16] {
        for causal in [false, true] {
            // Q strided (transposed), grouped-query, more keys than queries.
            let q = randn((2, 6, 24, 64), dtype, &dev)?.transpose(1, 2)?;
            let (k, v) = (
                randn((2, 40, 2, 64), dtype, &dev)?,
                randn((2, 40, 2, 64), dtype, &dev)?,
            );
            let s = slopes(6, &dev)?;
            let ours = flash_attn_alibi(&q, &k, &v, &s, 0.125, causal)?;
            let (theirs, _) = unfused_alibi(&q, &k, &v, Some(&s), 0.125, causal)?;
            let rel = rel_diff(&ours, &theirs)?;
            assert!(rel < tol(dtype), "{dtype:?} causal {causal}: {rel:e}");
            // The bias changes the result.
            let plain = flash_attn(&q, &k, &v, 0.125, causal)?;
            assert!(
                rel_diff(&plain, &theirs)? > 0.05,
                "the slopes changed nothing"
            );
        }
    }
    Ok(())
}

/// Two sequences of (queries, keys): one prefill-like, one with more keys than queries.
const LENS: [(usize, usize); 2] = [(9, 9), (5, 30)];

/// A packed batch of LENS: Q `(total_q, heads, d)`, K and V `(total_k, kv_heads, d)`.
fn packed(dev: &Device, dtype: DType) -> Result<(Tensor, Tensor, Tensor, Tensor, Tensor)> {
    let (lq, lk): (Vec<usize>, Vec<usize>) = LENS.iter().copied().unzip();
    let (tq, tk) = (lq.iter().sum::<usize>(), lk.iter().sum::<usize>());
    Ok((
        randn((tq, 4, 64), dtype, dev)?,
        randn((tk, 2, 64), dtype, dev)?,
        randn((tk, 2, 64), dtype, dev)?,
        seqlens(&lq, dev)?,
        seqlens(&lk, dev)?,
    ))
}

#[test]
fn varlen_alibi_is_dense_alibi_per_sequence() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v, sq, sk) = packed(&dev, DType::BF16)?;
    let s = slopes(4, &dev)?;
    let ours = flash_attn_varlen_alibi(&q, &k, &v, &s, &sq, &sk, 9, 30, 0.125, true)?;
    let (lq, lk): (Vec<usize>, Vec<usize>) = LENS.iter().copied().unzip();
    let (qa, ka) = (offsets(&lq), offsets(&lk));
    for b in 0..LENS.len() {
        let one = |t: &Tensor, at: &[usize], n| t.narrow(0, at[b], n)?.unsqueeze(0);
        let dense = flash_attn_alibi(
            &one(&q, &qa, lq[b])?,
            &one(&k, &ka, lk[b])?,
            &one(&v, &ka, lk[b])?,
            &s,
            0.125,
            true,
        )?;
        let mine = ours.narrow(0, qa[b], lq[b])?.unsqueeze(0)?;
        assert_eq!(rel_diff(&mine, &dense)?, 0.0, "sequence {b}");
    }
    Ok(())
}

/// Packed K or V `(total_k, kv_heads, d)` of LENS as a paged cache of `pages` pages of
/// `page_size` rows, each sequence's pages in a scrambled order; the block table of `dtype`.
fn paged(
    kv: &Tensor,
    page_size: usize,
    table_dtype: DType,
) -> Result<(Tensor, Tensor, Tensor, usize)> {
    let lk: Vec<usize> = LENS.iter().map(|l| l.1).collect();
    let per_seq = lk.iter().max().unwrap().div_ceil(page_size);
    let pages = per_seq * LENS.len() + 1;
    let (_, h, d) = kv.dims3()?;
    // Sequence b's page i is page (pages - 1 - (b * per_seq + i)): reversed, page 0 unused.
    let page_of = |b: usize, i: usize| pages - 1 - (b * per_seq + i);
    let mut cache = Tensor::zeros((pages, page_size, h, d), kv.dtype(), kv.device())?;
    let at = offsets(&lk);
    let mut table = vec![0u32; LENS.len() * per_seq];
    for (b, &n) in lk.iter().enumerate() {
        for i in 0..per_seq {
            table[b * per_seq + i] = page_of(b, i) as u32;
            let rows = n.saturating_sub(i * page_size).min(page_size);
            if rows > 0 {
                let src = kv.narrow(0, at[b] + i * page_size, rows)?.unsqueeze(0)?;
                cache = cache.slice_assign(
                    &[page_of(b, i)..page_of(b, i) + 1, 0..rows, 0..h, 0..d],
                    &src,
                )?;
            }
        }
    }
    let table =
        Tensor::from_vec(table, (LENS.len(), per_seq), kv.device())?.to_dtype(table_dtype)?;
    let cache_v = cache.clone();
    Ok((cache, cache_v, table, page_size))
}

#[test]
fn paged_is_packed() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v, sq, sk) = packed(&dev, DType::F16)?;
    let want = flash_attn_varlen_windowed(&q, &k, &v, &sq, &sk, 9, 30, 0.125, Some(7), Some(0))?;
    for (page_size, table_dtype) in [(16, DType::U32), (32, DType::I32)] {
        let (kc, _, table, ps) = paged(&k, page_size, table_dtype)?;
        let (vc, _, _, _) = paged(&v, page_size, table_dtype)?;
        let got = flash_attn_varlen_paged_windowed(
            &q,
            &hnd(&kc)?,
            &hnd(&vc)?,
            &sq,
            &sk,
            &table,
            None,
            9,
            30,
            0.125,
            Some(7),
            Some(0),
            ps,
            None,
        )?;
        assert_eq!(rel_diff(&got, &want)?, 0.0, "HND pages of {page_size}");
        let got = flash_attn_varlen_paged_windowed(
            &q,
            &kc,
            &vc,
            &sq,
            &sk,
            &table,
            None,
            9,
            30,
            0.125,
            Some(7),
            Some(0),
            ps,
            None,
        )?;
        assert_eq!(rel_diff(&got, &want)?, 0.0, "pages of {page_size}");
    }
    Ok(())
}

#[test]
fn lse_is_each_rows_log_sum_exp() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn((2, 12, 4, 64), DType::BF16, &dev)?;
    let (k, v) = (
        randn((2, 20, 4, 64), DType::BF16, &dev)?,
        randn((2, 20, 4, 64), DType::BF16, &dev)?,
    );
    let op = FlashAttn {
        softmax_scale: 0.125,
        alibi_slopes: None,
        window_size_left: None,
        window_size_right: Some(0),
        softcap: None,
    };
    let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
    assert_eq!(lse.dims(), &[2, 4, 12]);
    assert_eq!(lse.dtype(), DType::F32);
    assert_eq!(rel_diff(&out, &op.clone().forward(&q, &k, &v)?)?, 0.0);
    let (_, want) = unfused_alibi(&q, &k, &v, None, 0.125, true)?;
    assert!(max_abs(&(&lse - &want)?)? < 1e-3, "{lse} vs {want}");

    // Packed Q: (heads, total_q), each sequence's rows where its queries are.
    let (q, k, v, sq, sk) = packed(&dev, DType::F16)?;
    let op = FlashAttnVarLen::new(&sq, &sk, 9, 30, 0.125).window(None, Some(0));
    let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
    assert_eq!(lse.dims(), &[4, 14]);
    assert_eq!(
        rel_diff(
            &out,
            &flash_attn_varlen(&q, &k, &v, &sq, &sk, 9, 30, 0.125, true)?
        )?,
        0.0
    );
    let (_, second) = unfused_alibi(
        &q.narrow(0, 9, 5)?.unsqueeze(0)?,
        &k.narrow(0, 9, 30)?.unsqueeze(0)?,
        &v.narrow(0, 9, 30)?.unsqueeze(0)?,
        None,
        0.125,
        true,
    )?;
    let rows = lse.narrow(1, 9, 5)?;
    assert!(max_abs(&(&rows - &second.squeeze(0)?)?)? < 1e-3);
    Ok(())
}

#[test]
fn a_softcap_of_zero_is_none() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn((1, 8, 2, 64), DType::F16, &dev)?;
    let capped = flash_attn_alibi_windowed_softcap(&q, &q, &q, None, 0.5, None, Some(0), 0.0)?;
    assert_eq!(rel_diff(&capped, &flash_attn(&q, &q, &q, 0.5, true)?)?, 0.0);
    let capped = flash_attn_alibi_windowed_softcap(&q, &q, &q, None, 0.5, None, Some(0), 2.0)?;
    assert!(rel_diff(&capped, &flash_attn(&q, &q, &q, 0.5, true)?)? > 1e-2);
    Ok(())
}

/// The gradients of a loss Σ w ∘ out through the op on the CPU (sdpa's float64 reference
/// gradient) against the same through candle's own attention: GQA, causal, a sliding window, a
/// softcap.
#[test]
fn backward_on_the_cpu_matches_candles_attention() -> Result<()> {
    let dev = Device::Cpu;
    for (left, right, softcap) in [
        (None, None, None),
        (None, Some(0), None),
        (Some(3), Some(0), None),
        (None, None, Some(2.0)),
    ] {
        let q = Var::from_tensor(&randn((2, 6, 4, 16), DType::F16, &dev)?)?;
        let k = Var::from_tensor(&randn((2, 9, 2, 16), DType::F16, &dev)?)?;
        let v = Var::from_tensor(&randn((2, 9, 2, 16), DType::F16, &dev)?)?;
        let w = randn((2, 6, 4, 16), DType::F32, &dev)?;
        let loss = |out: Tensor| (out.to_dtype(DType::F32)? * &w)?.sum_all();
        let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
        let cap = softcap.unwrap_or(0.0);
        let ours = loss(flash_attn_alibi_windowed_softcap(
            qt, kt, vt, None, 0.25, left, right, cap,
        )?)?
        .backward()?;
        let theirs = loss(attention_unfused_windowed(
            qt, kt, vt, 0.25, softcap, left, right,
        )?)?
        .backward()?;
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let (a, b) = (ours.get(x).unwrap(), theirs.get(x).unwrap());
            let d = rel_diff(a, b)?;
            assert!(d < 5e-3, "{name} ({left:?}, {right:?}, {softcap:?}): {d}");
            assert!(max_abs(b)? > 0.0);
        }
    }
    Ok(())
}

/// A packed batch's gradients are its sequences' own: the varlen op against the dense op on
/// each sequence's rows (narrowed out of the same variables).
#[test]
fn backward_of_a_packed_batch_is_its_sequences() -> Result<()> {
    let dev = Device::Cpu;
    let (lq, lk) = ([3usize, 1, 4], [5usize, 2, 4]);
    let (oq, ok) = (offsets(&lq), offsets(&lk));
    let q = Var::from_tensor(&randn((8, 4, 16), DType::BF16, &dev)?)?;
    let k = Var::from_tensor(&randn((11, 2, 16), DType::BF16, &dev)?)?;
    let v = Var::from_tensor(&randn((11, 2, 16), DType::BF16, &dev)?)?;
    let w = randn((8, 4, 16), DType::F32, &dev)?;
    let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
    let packed = flash_attn_varlen(
        qt,
        kt,
        vt,
        &seqlens(&lq, &dev)?,
        &seqlens(&lk, &dev)?,
        4,
        5,
        0.25,
        true,
    )?;
    let ours = (packed.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
    let mut loss = Tensor::zeros((), DType::F32, &dev)?;
    for s in 0..3 {
        let rows = |t: &Tensor, o: &[usize], l: &[usize]| t.narrow(0, o[s], l[s])?.unsqueeze(0);
        let out = flash_attn(
            &rows(qt, &oq, &lq)?,
            &rows(kt, &ok, &lk)?,
            &rows(vt, &ok, &lk)?,
            0.25,
            true,
        )?;
        let ws = w.narrow(0, oq[s], lq[s])?.unsqueeze(0)?;
        loss = (loss + (out.to_dtype(DType::F32)? * ws)?.sum_all()?)?;
    }
    let each = loss.backward()?;
    for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let d = rel_diff(ours.get(x).unwrap(), each.get(x).unwrap())?;
        assert!(d < 1e-2, "{name}: {d}");
    }
    Ok(())
}

/// On a GPU a backward pass through the op (sdpa's backward) gives the gradients the CPU op
/// (sdpa's float64 reference gradient) gives on the same inputs: grouped-query causal
/// attention, Q, K and V strided views of one buffer.
#[test]
fn gpu_backward_matches_the_cpu_reference() -> Result<()> {
    let Some(dev) = gpu("gpu_backward_matches_the_cpu_reference") else {
        return Ok(());
    };
    let qkv = randn((2, 40, 8, 64), DType::F16, &Device::Cpu)?;
    let w = randn((2, 40, 4, 64), DType::F32, &Device::Cpu)?;
    let grads = |d: &Device| -> Result<Vec<Tensor>> {
        let x = Var::from_tensor(&qkv.to_device(d)?)?;
        let (q, k, v) = (
            x.as_tensor().narrow(2, 0, 4)?,
            x.as_tensor().narrow(2, 4, 2)?,
            x.as_tensor().narrow(2, 6, 2)?,
        );
        let out = flash_attn(&q, &k, &v, 0.125, true)?;
        let loss = (out.to_dtype(DType::F32)? * w.to_device(d)?)?.sum_all()?;
        let g = loss.backward()?;
        Ok(vec![cpu(g.get(&x).expect("a gradient for the buffer"))?])
    };
    let (on_gpu, on_cpu) = (grads(&dev)?, grads(&Device::Cpu)?);
    let d = rel_diff(&on_gpu[0], &on_cpu[0])?;
    assert!(d < 5e-3, "the GPU gradient is {d} from the CPU reference's");
    Ok(())
}

#[test]
fn unsupported_forms_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v, sq, sk) = packed(&dev, DType::F16)?;
    let (kc, _, table, ps) = paged(&k, 16, DType::U32)?;
    let (vc, _, _, _) = paged(&v, 16, DType::U32)?;
    let ranges = Tensor::new(&[[[0i64, 2]], [[0, 2]]], &dev)?;
    let s = slopes(4, &dev)?;
    let paged = |ranges, ps| {
        flash_attn_varlen_paged_windowed(
            &q,
            &kc,
            &vc,
            &sq,
            &sk,
            &table,
            ranges,
            9,
            30,
            0.125,
            None,
            Some(0),
            ps,
            None,
        )
    };
    let cases = [
        (
            paged(Some(&ranges), ps),
            "mm_prefix_ranges are not supported",
        ),
        (
            paged(None, 32),
            "page_block_size is Some(32); the paged k is",
        ),
        (
            flash_attn_varlen_alibi(
                &q,
                &k,
                &v,
                &s.to_dtype(DType::F16)?,
                &sq,
                &sk,
                9,
                30,
                0.1,
                true,
            ),
            "alibi_slopes are F16; they must be f32",
        ),
        (
            flash_attn_varlen_alibi(&q, &k, &v, &s.i(..3)?, &sq, &sk, 9, 30, 0.1, true),
            "they must be (4) or (2, 4)",
        ),
        (
            flash_attn_varlen_paged_windowed(
                &q,
                &kc.narrow(1, 0, 8)?,
                &vc.narrow(1, 0, 8)?,
                &sq,
                &sk,
                &table,
                None,
                9,
                30,
                0.125,
                None,
                Some(0),
                8,
                None,
            ),
            "pages must be stored row after row (NHD) or head after head",
        ),
    ];
    for (i, (got, fragment)) in cases.into_iter().enumerate() {
        let e = got.expect_err("a bad input was accepted");
        assert!(e.to_string().contains(fragment), "case {i}: {e}");
    }
    Ok(())
}

/// Every form on `dev` against the same call on the CPU (sdpa's float64 reference). Returns the
/// calls compared.
fn matches_the_cpu_op(dev: &Device) -> Result<usize> {
    let mut ran = 0;
    let mut check = |name: &str, gpu: &Tensor, want: &Tensor, tol: f32| -> Result<()> {
        assert_eq!(gpu.dims(), want.dims(), "{name}");
        let rel = rel_diff(&cpu(gpu)?, want)?;
        assert!(rel < tol, "{name}: GPU vs the float64 reference: {rel:e}");
        ran += 1;
        Ok(())
    };
    for dtype in [DType::F16, DType::BF16] {
        let t = tol(dtype) / 2.0;
        // ALiBi, dense.
        let q = randn((2, 300, 8, 128), dtype, dev)?;
        let (k, v) = (
            randn((2, 400, 2, 128), dtype, dev)?,
            randn((2, 400, 2, 128), dtype, dev)?,
        );
        let s = slopes(8, dev)?;
        for causal in [false, true] {
            let gpu = flash_attn_alibi(&q, &k, &v, &s, 0.09, causal)?;
            let want = flash_attn_alibi(&cpu(&q)?, &cpu(&k)?, &cpu(&v)?, &cpu(&s)?, 0.09, causal)?;
            check("alibi", &gpu, &want, t)?;
        }
        // ALiBi over a packed batch, and with a cap.
        let (q, k, v, sq, sk) = packed(dev, dtype)?;
        let s = slopes(4, dev)?;
        let on_cpu = [&q, &k, &v, &sq, &sk, &s].map(|t| cpu(t).unwrap());
        let gpu = flash_attn_varlen_alibi(&q, &k, &v, &s, &sq, &sk, 9, 30, 0.125, true)?;
        let [cq, ck, cv, csq, csk, cs] = &on_cpu;
        let want = flash_attn_varlen_alibi(cq, ck, cv, cs, csq, csk, 9, 30, 0.125, true)?;
        check("varlen alibi", &gpu, &want, t)?;
        // Paged, prefill and decode (one query a sequence), NHD and HND pages, pages smaller
        // than some kernels' key tiles and pages that hold whole ones.
        for (page_size, heads_first) in [
            (16, false),
            (64, true),
            (128, true),
            (256, false),
            (256, true),
        ] {
            let (kc, _, table, ps) = paged(&k, page_size, DType::U32)?;
            let (vc, _, _, _) = paged(&v, page_size, DType::U32)?;
            let (kc, vc) = match heads_first {
                true => (hnd(&kc)?, hnd(&vc)?),
                false => (kc, vc),
            };
            let (ckc, cvc, ctable) = (cpu(&kc)?, cpu(&vc)?, cpu(&table)?);
            let gpu = flash_attn_varlen_paged_windowed(
                &q,
                &kc,
                &vc,
                &sq,
                &sk,
                &table,
                None,
                9,
                30,
                0.125,
                None,
                Some(0),
                ps,
                Some(20.0),
            )?;
            let want = flash_attn_varlen_paged_windowed(
                cq,
                &ckc,
                &cvc,
                csq,
                csk,
                &ctable,
                None,
                9,
                30,
                0.125,
                None,
                Some(0),
                ps,
                Some(20.0),
            )?;
            check("paged prefill", &gpu, &want, t)?;
            let one = seqlens(&[1, 1], dev)?;
            let q1 = randn((2, 4, 64), dtype, dev)?;
            let gpu = flash_attn_varlen_paged_windowed(
                &q1,
                &kc,
                &vc,
                &one,
                &sk,
                &table,
                None,
                1,
                30,
                0.125,
                None,
                Some(0),
                ps,
                None,
            )?;
            let want = flash_attn_varlen_paged_windowed(
                &cpu(&q1)?,
                &ckc,
                &cvc,
                &cpu(&one)?,
                csk,
                &ctable,
                None,
                1,
                30,
                0.125,
                None,
                Some(0),
                ps,
                None,
            )?;
            check("paged decode", &gpu, &want, t)?;
        }
        // The log-sum-exp, dense and packed.
        let op = FlashAttnVarLen::new(&sq, &sk, 9, 30, 0.125).window(None, Some(0));
        let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
        let cop = FlashAttnVarLen::new(csq, csk, 9, 30, 0.125).window(None, Some(0));
        let (want, want_lse) = cop.forward_with_lse(cq, ck, cv)?;
        check("varlen with lse", &out, &want, t)?;
        assert!(max_abs(&(cpu(&lse)? - &want_lse)?)? < 1e-2, "varlen lse");
        let q = randn((2, 100, 4, 64), dtype, dev)?;
        let op = FlashAttn {
            softmax_scale: 0.125,
            alibi_slopes: Some(slopes(4, dev)?),
            window_size_left: Some(30),
            window_size_right: Some(0),
            softcap: None,
        };
        let (out, lse) = op.forward_with_lse(&q, &q, &q)?;
        let cop = FlashAttn {
            alibi_slopes: Some(slopes(4, &Device::Cpu)?),
            ..op.clone()
        };
        let (want, want_lse) = cop.forward_with_lse(&cpu(&q)?, &cpu(&q)?, &cpu(&q)?)?;
        check("dense with lse", &out, &want, t)?;
        assert!(max_abs(&(cpu(&lse)? - &want_lse)?)? < 1e-2, "dense lse");
    }
    Ok(ran)
}

#[test]
fn gpu_forms_match_the_cpu_op() -> Result<()> {
    let Some(dev) = gpu("gpu forms") else {
        return Ok(());
    };
    assert_eq!(matches_the_cpu_op(&dev)?, 2 * (2 + 1 + 10 + 2));
    Ok(())
}
