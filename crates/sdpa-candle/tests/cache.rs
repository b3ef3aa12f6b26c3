//! `write_kv` on the CPU: rows land at their slots in separate, stacked and HND caches, padding
//! and out-of-range slots write nothing, and bad inputs are errors.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use sdpa_candle::write_kv;

mod common;

const PAGES: usize = 3;
const PAGE: usize = 16;
const HEADS: usize = 2;
const D: usize = 8;

/// `rows` new rows whose every value names its tensor, row, head and element (distinct in bf16).
fn new_rows(rows: usize, tag: f32) -> Result<Tensor> {
    let values: Vec<f32> = (0..rows * HEADS * D)
        .map(|i| tag + i as f32 / 8.0)
        .collect();
    Tensor::from_vec(values, (rows, HEADS, D), &Device::Cpu)?.to_dtype(DType::BF16)
}

/// The cache after the write as expected: zeros, with row i of `new` at `slots[i]`.
fn expected(new: &Tensor, slots: &[i64]) -> Result<Tensor> {
    let mut rows = vec![Tensor::zeros((HEADS, D), new.dtype(), &Device::Cpu)?; PAGES * PAGE];
    for (i, &s) in slots.iter().enumerate() {
        if s >= 0 && (s as usize) < PAGES * PAGE {
            rows[s as usize] = new.i(i)?;
        }
    }
    Tensor::stack(&rows, 0)?.reshape((PAGES, PAGE, HEADS, D))
}

fn assert_same(a: &Tensor, b: &Tensor) -> Result<()> {
    let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert_eq!(diff, 0.0, "the cache differs from the expected placement");
    Ok(())
}

/// Slots across pages, a padding row (-1) and one past the cache.
const SLOTS: [i64; 5] = [17, -1, 0, 47, 48];

#[test]
fn rows_land_at_their_slots_in_separate_caches() -> Result<()> {
    let dev = Device::Cpu;
    let k_cache = Tensor::zeros((PAGES, PAGE, HEADS, D), DType::BF16, &dev)?;
    let v_cache = Tensor::zeros((PAGES, PAGE, HEADS, D), DType::BF16, &dev)?;
    let (k_new, v_new) = (new_rows(5, 1.0)?, new_rows(5, 100.0)?);
    let slots = Tensor::new(&SLOTS, &dev)?;
    write_kv(&k_cache, &v_cache, &k_new, &v_new, &slots)?;
    assert_same(&k_cache, &expected(&k_new, &SLOTS)?)?;
    assert_same(&v_cache, &expected(&v_new, &SLOTS)?)
}

#[test]
fn rows_land_at_their_slots_in_a_stacked_cache() -> Result<()> {
    let dev = Device::Cpu;
    // vLLM's layout: K and V the two halves of one tensor.
    let kv = Tensor::zeros((2, PAGES, PAGE, HEADS, D), DType::BF16, &dev)?;
    let (k_new, v_new) = (new_rows(5, 1.0)?, new_rows(5, 100.0)?);
    let slots = Tensor::new(&SLOTS, &dev)?;
    write_kv(&kv.get(0)?, &kv.get(1)?, &k_new, &v_new, &slots)?;
    assert_same(&kv.get(0)?, &expected(&k_new, &SLOTS)?)?;
    assert_same(&kv.get(1)?, &expected(&v_new, &SLOTS)?)?;
    // V before K in the storage is written as well.
    let kv = Tensor::zeros((2, PAGES, PAGE, HEADS, D), DType::BF16, &dev)?;
    write_kv(&kv.get(1)?, &kv.get(0)?, &k_new, &v_new, &slots)?;
    assert_same(&kv.get(1)?, &expected(&k_new, &SLOTS)?)?;
    assert_same(&kv.get(0)?, &expected(&v_new, &SLOTS)?)
}

#[test]
fn rows_land_at_their_slots_in_hnd_pages_and_from_strided_rows() -> Result<()> {
    let dev = Device::Cpu;
    // Pages stored head after head, passed transposed as the paged attention takes them.
    let k_hnd = Tensor::zeros((PAGES, HEADS, PAGE, D), DType::F16, &dev)?;
    let v_hnd = Tensor::zeros((PAGES, HEADS, PAGE, D), DType::F16, &dev)?;
    // New rows as views of a fused K/V projection: (rows, 2 · heads, D), K then V heads.
    let fused = Tensor::cat(&[new_rows(5, 1.0)?, new_rows(5, 100.0)?], 1)?.to_dtype(DType::F16)?;
    let (k_new, v_new) = (fused.narrow(1, 0, HEADS)?, fused.narrow(1, HEADS, HEADS)?);
    let slots = Tensor::new(&SLOTS, &dev)?;
    write_kv(
        &k_hnd.transpose(1, 2)?,
        &v_hnd.transpose(1, 2)?,
        &k_new,
        &v_new,
        &slots,
    )?;
    assert_same(&k_hnd.transpose(1, 2)?, &expected(&k_new, &SLOTS)?)?;
    assert_same(&v_hnd.transpose(1, 2)?, &expected(&v_new, &SLOTS)?)
}

fn message(r: Result<()>) -> String {
    match r {
        Ok(()) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let cache = || Tensor::zeros((PAGES, PAGE, HEADS, D), DType::BF16, &dev);
    let (kc, vc) = (cache()?, cache()?);
    let (kn, vn) = (new_rows(2, 1.0)?, new_rows(2, 2.0)?);
    let slots = Tensor::new(&[0i64, 1], &dev)?;
    let cases: Vec<(Result<()>, &str)> = vec![
        (
            write_kv(&kc, &vc, &kn, &vn, &Tensor::new(&[0u32, 1], &dev)?),
            "i64",
        ),
        (
            write_kv(&kc, &vc, &kn, &vn, &Tensor::new(&[0i64], &dev)?),
            "one slot a row",
        ),
        (
            write_kv(&kc, &vc, &kn.to_dtype(DType::F16)?, &vn, &slots),
            "must match",
        ),
        (write_kv(&kc, &kc, &kn, &vn, &slots), "overlap"),
        (
            write_kv(&kc, &vc, &kc.i((0, 0..2))?, &vn, &slots),
            "shares its storage",
        ),
        (
            write_kv(&kc, &vc, &new_rows(2, 1.0)?.narrow(2, 0, 4)?, &vn, &slots),
            "must be (rows",
        ),
        (
            write_kv(&kc.narrow(1, 0, 8)?, &vc.narrow(1, 0, 8)?, &kn, &vn, &slots),
            "contiguous",
        ),
        (
            write_kv(
                &Tensor::zeros((PAGES, 24, HEADS, D), DType::BF16, &dev)?,
                &Tensor::zeros((PAGES, 24, HEADS, D), DType::BF16, &dev)?,
                &kn,
                &vn,
                &slots,
            ),
            "power of two",
        ),
    ];
    for (i, (r, want)) in cases.into_iter().enumerate() {
        let m = message(r);
        assert!(m.contains(want), "case {i}: {m:?} does not say {want:?}");
    }
    // Nothing was written by the refused calls.
    assert_eq!(
        kc.abs()?
            .sum_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?,
        0.0
    );
    Ok(())
}

/// The three cache forms on the GPU: the same placement as expected on the host.
#[cfg(feature = "cuda")]
#[test]
fn gpu_rows_land_at_their_slots() -> Result<()> {
    let Some(dev) = common::gpu("gpu write_kv") else {
        return Ok(());
    };
    let cpu = common::cpu;
    let (k_new, v_new) = (new_rows(5, 1.0)?, new_rows(5, 100.0)?);
    let (kg, vg) = (k_new.to_device(&dev)?, v_new.to_device(&dev)?);
    let slots = Tensor::new(&SLOTS, &dev)?;
    let (want_k, want_v) = (expected(&k_new, &SLOTS)?, expected(&v_new, &SLOTS)?);

    let (kc, vc) = (
        Tensor::zeros((PAGES, PAGE, HEADS, D), DType::BF16, &dev)?,
        Tensor::zeros((PAGES, PAGE, HEADS, D), DType::BF16, &dev)?,
    );
    write_kv(&kc, &vc, &kg, &vg, &slots)?;
    assert_same(&cpu(&kc)?, &want_k)?;
    assert_same(&cpu(&vc)?, &want_v)?;

    for k_first in [true, false] {
        let kv = Tensor::zeros((2, PAGES, PAGE, HEADS, D), DType::BF16, &dev)?;
        let (k, v) = if k_first { (0, 1) } else { (1, 0) };
        write_kv(&kv.get(k)?, &kv.get(v)?, &kg, &vg, &slots)?;
        assert_same(&cpu(&kv.get(k)?)?, &want_k)?;
        assert_same(&cpu(&kv.get(v)?)?, &want_v)?;
    }

    let hnd = || Tensor::zeros((PAGES, HEADS, PAGE, D), DType::BF16, &dev);
    let (kh, vh) = (hnd()?, hnd()?);
    write_kv(&kh.transpose(1, 2)?, &vh.transpose(1, 2)?, &kg, &vg, &slots)?;
    assert_same(&cpu(&kh.transpose(1, 2)?)?, &want_k)?;
    assert_same(&cpu(&vh.transpose(1, 2)?)?, &want_v)
}
