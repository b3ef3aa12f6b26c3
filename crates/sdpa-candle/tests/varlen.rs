//! `flash_attn_varlen` against the dense `flash_attn` run on each sequence alone (a slice of Q
//! and of K/V each): on the CPU, where both run sdpa's float64 reference, to the bit; on GPU 0
//! with the `cuda` feature, to within the dtype's rounding, and against the CPU op. Sequences of
//! mixed lengths (with no queries, with no keys, more queries than keys), causal or not, sliding
//! windows, softcap, grouped-query, a strided Q, sinks; and the errors bad inputs give.

mod common;

use candle_core::{DType, Device, Error, Result, Tensor};
use common::{max_abs, offsets, rel_diff, seqlens};
use sdpa_candle::{
    FlashAttn, FlashAttnVarLen, flash_attn_varlen, flash_attn_varlen_alibi_windowed_softcap,
};

/// Queries and keys of each sequence: one with no queries, one with no keys, one with more
/// queries than keys (its first causal rows see no key), one of a single query.
const Q_LENS: [usize; 6] = [5, 0, 17, 1, 9, 12];
const K_LENS: [usize; 6] = [7, 3, 17, 4, 0, 6];

/// A packed batch: Q `(total_q, heads, d)` (strided: a transposed heads-first tensor), K and V
/// `(total_k, kv_heads, d)`, and the u32 offsets of `q_lens` and `k_lens`.
struct Batch {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    q_lens: Vec<usize>,
    k_lens: Vec<usize>,
}

fn batch(
    dev: &Device,
    dtype: DType,
    (heads, kv_heads, d): (usize, usize, usize),
    q_lens: &[usize],
    k_lens: &[usize],
) -> Result<Batch> {
    let (total_q, total_k) = (q_lens.iter().sum(), k_lens.iter().sum());
    let q = Tensor::randn(0f32, 1.0, (heads, total_q, d), dev)?
        .to_dtype(dtype)?
        .transpose(0, 1)?;
    let k = Tensor::randn(0f32, 1.0, (total_k, kv_heads, d), dev)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, (total_k, kv_heads, d), dev)?.to_dtype(dtype)?;
    Ok(Batch {
        q,
        k,
        v,
        seqlens_q: seqlens(q_lens, dev)?,
        seqlens_k: seqlens(k_lens, dev)?,
        q_lens: q_lens.to_vec(),
        k_lens: k_lens.to_vec(),
    })
}

/// Mask and cap variants: (window left, window right, softcap).
type Variant = (Option<usize>, Option<usize>, Option<f32>);
const VARIANTS: [Variant; 4] = [
    (None, None, None),
    (None, Some(0), None),
    (Some(4), Some(0), None),
    (Some(6), Some(2), Some(8.0)),
];

/// The packed op on `b` against the dense op on each of its sequences, to a relative difference
/// of at most `tol`; a sequence with queries and no keys is zeros. Returns the sequences
/// compared.
fn matches_dense_per_sequence(b: &Batch, (left, right, cap): Variant, tol: f32) -> Result<usize> {
    let (max_q, max_k) = (b.q_lens.iter().max(), b.k_lens.iter().max());
    let scale = 1.0 / (b.q.dim(2)? as f32).sqrt();
    let packed = flash_attn_varlen_alibi_windowed_softcap(
        &b.q,
        &b.k,
        &b.v,
        None,
        &b.seqlens_q,
        &b.seqlens_k,
        *max_q.unwrap(),
        *max_k.unwrap(),
        scale,
        left,
        right,
        cap.unwrap_or(0.0),
    )?;
    assert_eq!(packed.dims(), b.q.dims());
    assert_eq!(packed.dtype(), b.q.dtype());
    assert!(packed.is_contiguous());
    let (q_at, k_at) = (offsets(&b.q_lens), offsets(&b.k_lens));
    let mut compared = 0;
    for (s, (&lq, &lk)) in b.q_lens.iter().zip(&b.k_lens).enumerate() {
        if lq == 0 {
            continue;
        }
        let ours = packed.narrow(0, q_at[s], lq)?;
        if lk == 0 {
            assert_eq!(max_abs(&ours)?, 0.0, "sequence {s} has no keys");
            continue;
        }
        let one = |t: &Tensor, at: &[usize], len: usize| t.narrow(0, at[s], len)?.unsqueeze(0);
        let dense = FlashAttn {
            softmax_scale: scale,
            alibi_slopes: None,
            window_size_left: left,
            window_size_right: right,
            softcap: cap,
        }
        .forward(
            &one(&b.q, &q_at, lq)?,
            &one(&b.k, &k_at, lk)?,
            &one(&b.v, &k_at, lk)?,
        )?
        .squeeze(0)?;
        assert!(
            max_abs(&dense)? > 0.1,
            "sequence {s}: the dense op gave zeros"
        );
        let rel = rel_diff(&ours, &dense)?;
        assert!(
            rel <= tol,
            "sequence {s} ({lq} queries, {lk} keys), window ({left:?}, {right:?}), softcap \
             {cap:?}: relative difference {rel:e}"
        );
        compared += 1;
    }
    Ok(compared)
}

/// Every variant, f16 and bf16, grouped-query and not, on `dev`; `tol` per dtype. Returns the
/// sequences compared.
fn varlen_cases(dev: &Device, tol: impl Fn(DType) -> f32) -> Result<usize> {
    let mut compared = 0;
    for dtype in [DType::F16, DType::BF16] {
        for heads in [(4, 2, 64), (2, 2, 128)] {
            let b = batch(dev, dtype, heads, &Q_LENS, &K_LENS)?;
            assert!(!b.q.is_contiguous(), "the test means to pass a strided Q");
            for variant in VARIANTS {
                compared += matches_dense_per_sequence(&b, variant, tol(dtype))?;
            }
        }
    }
    Ok(compared)
}

#[test]
fn cpu_varlen_is_each_sequence_attended_alone() -> Result<()> {
    // Both sides run the float64 reference on the same sequence: equal to the bit.
    let compared = varlen_cases(&Device::Cpu, |_| 0.0)?;
    // Four sequences of each batch have queries and keys; 2 dtypes x 2 head shapes x 4 variants.
    assert_eq!(compared, 4 * 16);
    Ok(())
}

#[test]
fn causal_masks_align_to_each_sequences_own_end() -> Result<()> {
    // One sequence of 3 queries and 5 keys: its last query row sees every key, its first the
    // first three (bottom-right). Causal and non-causal then differ in rows 0 and 1 only.
    let dev = Device::Cpu;
    let b = batch(&dev, DType::F16, (2, 2, 64), &[4, 3], &[2, 5])?;
    let run = |causal| {
        flash_attn_varlen(
            &b.q,
            &b.k,
            &b.v,
            &b.seqlens_q,
            &b.seqlens_k,
            4,
            5,
            0.125,
            causal,
        )
    };
    let (causal, full) = (run(true)?, run(false)?);
    let row_diff =
        |row| -> Result<f32> { max_abs(&(causal.narrow(0, row, 1)? - full.narrow(0, row, 1)?)?) };
    // The second sequence holds rows 4, 5 and 6 of Q.
    assert!(row_diff(4)? > 1e-3 && row_diff(5)? > 1e-3);
    assert_eq!(row_diff(6)?, 0.0);
    // The first sequence (4 queries, 2 keys): rows 0 and 1 see no key when causal.
    assert_eq!(max_abs(&causal.narrow(0, 0, 2)?)?, 0.0);
    assert!(max_abs(&causal.narrow(0, 2, 2)?)? > 0.1);
    assert_eq!(row_diff(3)?, 0.0);
    Ok(())
}

#[test]
fn batches_with_no_queries_or_no_keys() -> Result<()> {
    let dev = Device::Cpu;
    // No queries at all: an empty output.
    let q = Tensor::zeros((0, 4, 64), DType::BF16, &dev)?;
    let kv = Tensor::ones((5, 2, 64), DType::BF16, &dev)?;
    let (sq, sk) = (seqlens(&[0, 0], &dev)?, seqlens(&[2, 3], &dev)?);
    let out = flash_attn_varlen(&q, &kv, &kv, &sq, &sk, 0, 3, 0.125, false)?;
    assert_eq!(out.dims(), &[0, 4, 64]);
    // No keys at all: every row sees none, zeros.
    let q = Tensor::ones((6, 4, 64), DType::BF16, &dev)?;
    let kv = Tensor::zeros((0, 2, 64), DType::BF16, &dev)?;
    let (sq, sk) = (seqlens(&[2, 4], &dev)?, seqlens(&[0, 0], &dev)?);
    let out = flash_attn_varlen(&q, &kv, &kv, &sq, &sk, 4, 0, 0.125, true)?;
    assert_eq!((out.dims(), out.dtype()), (&[6, 4, 64][..], DType::BF16));
    assert_eq!(max_abs(&out)?, 0.0);
    Ok(())
}

/// The error beneath candle's backtrace and context wrappers.
fn innermost(e: &Error) -> &Error {
    match e {
        Error::WithBacktrace { inner, .. } | Error::Context { inner, .. } => innermost(inner),
        e => e,
    }
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let b = batch(&dev, DType::F16, (4, 2, 64), &[3, 5], &[4, 6])?;
    let (q, k, v) = (&b.q, &b.k, &b.v);
    let (sq, sk) = (&b.seqlens_q, &b.seqlens_k);
    let u32s = |x: &[u32]| Tensor::new(x, &dev);
    let run = |q: &Tensor, k: &Tensor, v: &Tensor, sq: &Tensor, sk: &Tensor, max_q| {
        flash_attn_varlen(q, k, v, sq, sk, max_q, 6, 0.125, true)
    };
    run(q, k, v, sq, sk, 5).expect("the good batch");

    // Typed candle errors: the offsets' dtype, and ranks.
    let e = run(q, k, v, &sq.to_dtype(DType::I64)?, sk, 5).unwrap_err();
    assert!(
        matches!(
            innermost(&e),
            Error::UnexpectedDType {
                expected: DType::U32,
                got: DType::I64,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("seqlens_q holds u32 offsets"), "{e}");
    let e = run(q, k, v, sq, &sk.reshape((1, 3))?, 5).unwrap_err();
    assert!(
        matches!(
            innermost(&e),
            Error::UnexpectedNumberOfDims {
                expected: 1,
                got: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("seqlens_k must be (batch + 1,)"),
        "{e}"
    );
    let e = run(&q.unsqueeze(0)?, k, v, sq, sk, 5).unwrap_err();
    assert!(
        matches!(
            innermost(&e),
            Error::UnexpectedNumberOfDims {
                expected: 3,
                got: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("q must be (total_q, heads, head_dim)"),
        "{e}"
    );

    // Shapes and dtypes of Q, K and V.
    let strided_offsets = u32s(&[0, 0, 3, 3, 8, 8])?
        .reshape((3, 2))?
        .narrow(1, 0, 1)?;
    let narrow_d = |t: &Tensor| t.narrow(2, 0, 32);
    let cases = [
        (
            run(&q.to_dtype(DType::F32)?, k, v, sq, sk, 5),
            "they must match",
        ),
        (
            run(
                &q.to_dtype(DType::F32)?,
                &k.to_dtype(DType::F32)?,
                &v.to_dtype(DType::F32)?,
                sq,
                sk,
                5,
            ),
            "F32 tensors are not supported",
        ),
        (run(q, k, &v.narrow(0, 0, 9)?, sq, sk, 5), "they must match"),
        (
            run(q, &narrow_d(k)?, &narrow_d(v)?, sq, sk, 5),
            "q's head_dim is 64 and k's 32",
        ),
        (
            run(
                q,
                &k.narrow(1, 0, 1)?.repeat((1, 3, 1))?,
                &v.narrow(1, 0, 1)?.repeat((1, 3, 1))?,
                sq,
                sk,
                5,
            ),
            "k and v have 3 heads, which must divide q's 4",
        ),
        // The offsets tensors.
        (
            run(q, k, v, sq, &u32s(&[0, 10])?, 5),
            "seqlens_q holds 3 offsets and seqlens_k 2",
        ),
        (
            run(
                &q.narrow(0, 0, 0)?,
                &k.narrow(0, 0, 0)?,
                &v.narrow(0, 0, 0)?,
                &u32s(&[0])?,
                &u32s(&[0])?,
                5,
            ),
            "hold 1 offsets; batch + 1 is at least 2",
        ),
        (
            run(q, k, v, &strided_offsets.squeeze(1)?, sk, 5),
            "seqlens_q must be contiguous",
        ),
        // The offsets' values, which the CPU op checks.
        (
            run(q, k, v, &u32s(&[1, 3, 8])?, sk, 5),
            "cu_seqlens_q[0] must be 0",
        ),
        (
            run(q, k, v, sq, &u32s(&[0, 6, 4])?, 5),
            "cu_seqlens_k decreases at sequence 1",
        ),
        (
            run(q, k, v, &u32s(&[0, 3, 9])?, sk, 6),
            "cu_seqlens_q[2] = 9 is past the 8 packed rows",
        ),
        (
            run(q, k, v, sq, sk, 4),
            "sequence 1 has 5 rows in cu_seqlens_q, more than the problem's maximum 4",
        ),
        (
            run(q, k, v, &u32s(&[0, 3, 1 << 31])?, sk, 5),
            "seqlens_q[2] = 2147483648 does not fit i32",
        ),
        (run(q, k, v, sq, sk, 0), "seq_q must be at least 1"),
    ];
    for (i, (got, fragment)) in cases.into_iter().enumerate() {
        let e = got.expect_err("a bad input was accepted");
        assert!(e.to_string().contains(fragment), "case {i}: {e}");
    }
    Ok(())
}

#[test]
fn the_op_can_be_applied_directly() -> Result<()> {
    // The struct, as a model holding it would apply it, gives what the function gives.
    let dev = Device::Cpu;
    let b = batch(&dev, DType::BF16, (4, 1, 64), &[3, 5], &[4, 6])?;
    let op = FlashAttnVarLen {
        checked: true,
        ..FlashAttnVarLen::new(&b.seqlens_q, &b.seqlens_k, 5, 6, 0.1).window(None, Some(0))
    };
    let direct = b.q.apply_op3_no_bwd(&b.k, &b.v, &op)?;
    let via_fn = flash_attn_varlen(
        &b.q,
        &b.k,
        &b.v,
        &b.seqlens_q,
        &b.seqlens_k,
        5,
        6,
        0.1,
        true,
    )?;
    assert_eq!(max_abs(&(direct - &via_fn)?)?, 0.0);
    assert!(max_abs(&via_fn)? > 0.1);
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_varlen_matches_dense_and_the_cpu_op() -> Result<()> {
    let Some(dev) = common::gpu("gpu varlen") else {
        return Ok(());
    };
    let tol = |dtype| if dtype == DType::F16 { 2e-3 } else { 1.5e-2 };
    assert_eq!(varlen_cases(&dev, tol)?, 4 * 16);

    // The GPU op and the CPU op (sdpa's float64 reference) on the same longer sequences.
    let (q_lens, k_lens) = ([300, 0, 77, 512, 1], [300, 40, 1000, 512, 129]);
    let b = batch(&dev, DType::BF16, (8, 2, 128), &q_lens, &k_lens)?;
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
    for causal in [false, true] {
        let run = |q: &Tensor, k: &Tensor, v: &Tensor, sq: &Tensor, sk: &Tensor| {
            flash_attn_varlen(q, k, v, sq, sk, 512, 1000, 0.08, causal)
        };
        let gpu = run(&b.q, &b.k, &b.v, &b.seqlens_q, &b.seqlens_k)?;
        let reference = run(
            &cpu(&b.q)?,
            &cpu(&b.k)?,
            &cpu(&b.v)?,
            &cpu(&b.seqlens_q)?,
            &cpu(&b.seqlens_k)?,
        )?;
        let rel = rel_diff(&cpu(&gpu)?, &reference)?;
        assert!(
            rel < 1e-2,
            "causal {causal}: GPU vs float64 reference: {rel:e}"
        );
    }

    // A batch with no keys: zeros, no kernel.
    let q = Tensor::ones((6, 4, 64), DType::F16, &dev)?;
    let kv = Tensor::zeros((0, 2, 64), DType::F16, &dev)?;
    let (sq, sk) = (seqlens(&[2, 4], &dev)?, seqlens(&[0, 0], &dev)?);
    let out = flash_attn_varlen(&q, &kv, &kv, &sq, &sk, 4, 0, 0.125, true)?;
    assert_eq!(max_abs(&out)?, 0.0);

    // Offsets on the host are an error, and the checked op reads a u32 past 2^31 as the negative
    // i32 it is on the device.
    let e = flash_attn_varlen(
        &b.q,
        &b.k,
        &b.v,
        &cpu(&b.seqlens_q)?,
        &b.seqlens_k,
        512,
        1000,
        0.08,
        true,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("seqlens_q must be on the GPU"),
        "{e}"
    );
    let mut huge: Vec<u32> = offsets(&q_lens).iter().map(|&x| x as u32).collect();
    huge[5] = 1 << 31;
    let huge = Tensor::new(huge.as_slice(), &dev)?;
    let op = FlashAttnVarLen {
        checked: true,
        ..FlashAttnVarLen::new(&huge, &b.seqlens_k, 512, 1000, 0.08)
    };
    let e = b.q.apply_op3_no_bwd(&b.k, &b.v, &op).unwrap_err();
    assert!(
        e.to_string()
            .contains("cu_seqlens_q decreases at sequence 4"),
        "{e}"
    );
    Ok(())
}

/// On a GPU a backward pass through the packed op (sdpa's backward over the sequences'
/// metadata) gives the gradients the CPU op (sdpa's float64 reference gradient) gives on the
/// same batch: sequences with and without queries or keys, GQA, causal, Q strided.
#[cfg(feature = "cuda")]
#[test]
fn gpu_varlen_backward_matches_the_cpu_reference() -> Result<()> {
    let Some(dev) = common::gpu("gpu varlen backward") else {
        return Ok(());
    };
    let (q_lens, k_lens) = ([70, 0, 33, 128], [90, 40, 33, 150]);
    let b = batch(&Device::Cpu, DType::BF16, (8, 2, 64), &q_lens, &k_lens)?;
    let w = Tensor::randn(0f32, 1.0, b.q.shape(), &Device::Cpu)?;
    let grads = |d: &Device| -> Result<Vec<Tensor>> {
        let vars = [&b.q, &b.k, &b.v].map(|t| candle_core::Var::from_tensor(&t.to_device(d)?));
        let [q, k, v] = vars;
        let (q, k, v) = (q?, k?, v?);
        let out = flash_attn_varlen(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            &b.seqlens_q.to_device(d)?,
            &b.seqlens_k.to_device(d)?,
            128,
            150,
            0.125,
            true,
        )?;
        let g = (out.to_dtype(DType::F32)? * w.to_device(d)?)?
            .sum_all()?
            .backward()?;
        [&q, &k, &v]
            .iter()
            .map(|x| {
                g.get(x.as_tensor())
                    .expect("a gradient")
                    .to_device(&Device::Cpu)
            })
            .collect()
    };
    let (on_gpu, on_cpu) = (grads(&dev)?, grads(&Device::Cpu)?);
    for (name, (a, r)) in ["dq", "dk", "dv"].iter().zip(on_gpu.iter().zip(&on_cpu)) {
        let d = rel_diff(a, r)?;
        assert!(
            d < 1e-2,
            "{name}: the GPU gradient is {d} from the CPU reference's"
        );
    }
    Ok(())
}

/// Sinks by their definition: with a sink s of its head a row's log-sum-exp is ln(e^lse + e^s)
/// and its output the one without sinks times e^(lse − lse_with); a row that sees no key gets
/// output 0 and log-sum-exp s; a -inf sink changes nothing. Wrong sinks are errors.
fn sinks_match_their_definition(dev: &Device, tol: f32) -> Result<()> {
    let b = batch(dev, DType::F16, (4, 2, 64), &Q_LENS, &K_LENS)?;
    let sinks = [0.5f32, 2.0, f32::NEG_INFINITY, -1.0];
    let plain = FlashAttnVarLen::new(&b.seqlens_q, &b.seqlens_k, 17, 17, 0.2).window(None, Some(0));
    let with = FlashAttnVarLen {
        sinks: Some(Tensor::new(&sinks, dev)?),
        ..plain.clone()
    };
    let (o0, l0) = plain.forward_with_lse(&b.q, &b.k, &b.v)?;
    let (o1, l1) = with.forward_with_lse(&b.q, &b.k, &b.v)?;
    let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (o0, o1, l0, l1) = (flat(&o0)?, flat(&o1)?, flat(&l0)?, flat(&l1)?);
    let (heads, total_q, d) = (4, Q_LENS.iter().sum::<usize>(), 64);
    let mut checked = 0;
    for h in 0..heads {
        for i in 0..total_q {
            let (a, w, s) = (l0[h * total_q + i], l1[h * total_q + i], sinks[h]);
            let want = f64::from(a).exp() + f64::from(s).exp();
            let want = if want == 0.0 {
                f64::NEG_INFINITY
            } else {
                want.ln()
            };
            assert!(
                (f64::from(w) - want).abs() <= 2e-3 * want.abs().max(1.0) || f64::from(w) == want,
                "head {h} row {i}: lse {w}, want {want}"
            );
            let f = if w == f32::NEG_INFINITY {
                0.0
            } else {
                (a - w).exp()
            };
            for c in 0..d {
                let at = (i * heads + h) * d + c;
                let (x, y) = (o0[at], o1[at]);
                assert!(
                    (y - x * f).abs() <= tol,
                    "head {h} row {i}: {y} vs {x} · {f}"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, heads * total_q);
    // Sinks of another shape or type are errors.
    for bad in [
        Tensor::new(&[0f32; 3], dev)?,
        Tensor::new(&[0f32; 4], dev)?.to_dtype(DType::F16)?,
        Tensor::new(&[[0f32; 4]], dev)?,
    ] {
        let op = FlashAttnVarLen {
            sinks: Some(bad),
            ..plain.clone()
        };
        let e = b.q.apply_op3_no_bwd(&b.k, &b.v, &op).unwrap_err();
        assert!(e.to_string().contains("sinks"), "{e}");
    }
    Ok(())
}

#[test]
fn cpu_sinks_match_their_definition() -> Result<()> {
    sinks_match_their_definition(&Device::Cpu, 5e-3)
}

#[test]
fn gpu_sinks_match_their_definition() -> Result<()> {
    let Some(dev) = common::gpu("gpu sinks") else {
        return Ok(());
    };
    sinks_match_their_definition(&dev, 1e-2)
}
