//! Batches of sequences of different lengths on the GPU against the float64 reference: packed
//! (varlen) Q and K/V, a paged K/V cache for decode and for prefill against a cache, seqused_k;
//! with every mask, GQA, the log-sum-exp, softcap and ALiBi, on scalar, cutlass-sm80 and cutlass
//! (Hopper). Fresh inputs every run; the metadata's typed errors, and the backends that refuse
//! such batches.

mod common;

use sdpa::{Alibi, Backend, DType, Mask, Problem, SeqMeta};
use sdpa_harness::check::{compare, compare_lse};
use sdpa_harness::inputs::{Inputs, fresh_seed, random_inputs};
use sdpa_harness::seqs::{paged, varlen};

/// The backends that run packed and paged batches on `dev`: each of scalar, cutlass-sm80 and
/// cutlass that runs here at all (a refusal of any fails the test).
fn seq_backends(dev: &sdpa::Device) -> Vec<Backend> {
    let p = varlen(Problem::new(1, 2, 1, 1, 64), &[3, 5], &[4, 2]).0;
    let runs: Vec<Backend> = common::expected_backends(dev)
        .into_iter()
        .filter(|b| b.supports(Some(dev), &p).is_ok())
        .collect();
    for b in [Backend::Scalar, Backend::CutlassSm80, Backend::Cutlass] {
        if common::expected_backends(dev).contains(&b) {
            assert!(
                runs.contains(&b),
                "{b} refuses {p}: {:?}",
                b.supports(Some(dev), &p)
            );
        }
    }
    runs
}

/// Runs `b` on `inputs` and compares output and log-sum-exp with the reference; a failure's
/// description, or None.
fn check(
    dev: &sdpa::Device,
    p: &Problem,
    b: Backend,
    inputs: &Inputs,
) -> sdpa::Result<Option<String>> {
    let want = inputs.reference(p)?;
    let (got, lse) =
        sdpa_harness::check::run_backend_with_lse(Some(dev), p, b, inputs, Some(&want))?;
    let r = compare(&got, &want.out, p.dtype, 0);
    if !r.pass() {
        return Ok(Some(format!("{b} {p}: {r:?}")));
    }
    if let Some(lse) = lse {
        let (err, bad) = compare_lse(&lse, &want.lse);
        if bad > 0 || err > sdpa_harness::check::LSE_TOLERANCE {
            return Ok(Some(format!("{b} {p}: lse {err} ({bad} rows off)")));
        }
    }
    Ok(None)
}

fn inputs(p: &Problem, meta: SeqMeta) -> Inputs {
    random_inputs(p, fresh_seed()).unwrap().with_meta(meta)
}

/// Packed Q and K/V: empty sequences, one-row ones, seq_q above and below seq_k, every mask, GQA,
/// D = 64, 128, 256, softcap and ALiBi on some, the log-sum-exp ([heads, total_q]).
#[test]
fn varlen_matches_the_reference() {
    let Some(dev) = common::device("varlen") else {
        return;
    };
    let lengths: [(&[usize], &[usize]); 3] = [
        (&[1, 77, 0, 300, 5], &[1, 77, 40, 120, 0]),
        (&[130, 64, 2], &[700, 64, 3]),
        (&[257], &[257]),
    ];
    let masks = [
        Mask::None,
        Mask::CausalBottomRight,
        Mask::CausalTopLeft,
        Mask::Window {
            left: Some(100),
            right: Some(0),
        },
        Mask::Window {
            left: Some(200),
            right: Some(30),
        },
        Mask::Chunked { size: 128 },
    ];
    let backends = seq_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    for (i, &mask) in masks.iter().enumerate() {
        for (j, &(ql, kl)) in lengths.iter().enumerate() {
            let n = i * lengths.len() + j;
            let d = [64, 128, 256][n % 3];
            let mut base = Problem::new(1, 4, 1, 1, d)
                .with_kv_heads([2, 4][n % 2])
                .with_mask(mask)
                .with_dtype(DType::ALL[n % 2])
                .with_lse(true);
            if n % 4 == 1 {
                base = base.with_softcap(20.0);
            } else if n % 4 == 3 {
                base = base.with_alibi(Alibi::PerBatchHead);
            }
            let (p, meta) = varlen(base, ql, kl);
            let x = inputs(&p, meta);
            for &b in &backends {
                if refuses_as_documented(&dev, &p, b) {
                    continue;
                }
                ran.push((b, p));
                if let Some(f) = check(&dev, &p, b, &x).unwrap() {
                    failures.push(f);
                }
            }
        }
    }
    common::assert_ran("varlen", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A paged cache: decode (1, 4 and 16 queries a sequence, causal: the queries are the newest
/// keys) and prefill against a cache, page sizes 16 to 256, sequences of 0 keys, of whole pages
/// and of a page and one key, GQA.
#[test]
fn paged_matches_the_reference() {
    let Some(dev) = common::device("paged") else {
        return;
    };
    let backends = seq_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    let k_lens: &[usize] = &[300, 16, 0, 257, 64, 1];
    for (n, &(seq_q, page_size)) in [(1, 16), (4, 64), (16, 128), (100, 256), (1, 256), (33, 32)]
        .iter()
        .enumerate()
    {
        let base = Problem::new(1, 8, seq_q, 1, [128, 64][n % 2])
            .with_kv_heads(2)
            .with_mask(match n {
                4 => Mask::None,
                3 => Mask::Chunked { size: 256 },
                _ => Mask::CausalBottomRight,
            })
            .with_dtype(DType::ALL[n % 2])
            .with_layout([sdpa::Layout::Bshd, sdpa::Layout::Bhsd][n % 2])
            .with_lse(n % 2 == 0);
        let (p, meta) = paged(base, k_lens, page_size, fresh_seed());
        let x = inputs(&p, meta);
        for &b in &backends {
            if refuses_as_documented(&dev, &p, b) {
                continue;
            }
            ran.push((b, p));
            if let Some(f) = check(&dev, &p, b, &x).unwrap() {
                failures.push(f);
            }
        }
    }
    common::assert_ran("paged", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Whether `b` is cutlass refusing `p` for one of its documented limits, a cache's pages smaller
/// than its key tile (it loads a tile with one TMA copy), a window narrower than it or chunks
/// that split its query tiles (its non-finite V check): the typed refusal, asserted;
/// cutlass-sm80 and scalar run those. Any other refusal fails.
fn refuses_as_documented(dev: &sdpa::Device, p: &Problem, b: Backend) -> bool {
    match b.supports(Some(dev), p) {
        Ok(()) => false,
        Err(sdpa::Error::Unsupported { reason, .. })
            if b == Backend::Cutlass
                && (reason.contains("paged cache's pages of")
                    || reason.contains("narrower")
                    || reason.contains("would split")) =>
        {
            true
        }
        Err(e) => panic!("{b} refuses {p}: {e}"),
    }
}

/// Packed queries against a paged cache (chunked prefill): each sequence's new queries are the
/// last of its keys in the cache.
#[test]
fn packed_queries_against_a_paged_cache() {
    let Some(dev) = common::device("packed queries, paged cache") else {
        return;
    };
    let k_lens: &[usize] = &[500, 40, 129];
    let q_lens: &[usize] = &[100, 40, 1];
    let mut ran = Vec::new();
    for page_size in [64, 128] {
        let base = Problem::new(1, 4, 100, 1, 128).with_causal(true);
        let (p, mut meta) = paged(base, k_lens, page_size, fresh_seed());
        let p = p.with_packed_q(q_lens.iter().sum());
        meta.cu_seqlens_q = Some(sdpa_harness::seqs::cu_seqlens(q_lens));
        let x = inputs(&p, meta);
        for b in seq_backends(&dev) {
            if refuses_as_documented(&dev, &p, b) {
                continue;
            }
            ran.push((b, p));
            assert_eq!(check(&dev, &p, b, &x).unwrap(), None);
        }
    }
    common::assert_ran("packed queries, paged cache", &ran);
}

/// Metadata the call needs and does not get, or gets and does not need, is a typed error before
/// any launch; with `Seqs::checked` bad values are too (offsets that decrease, pages out of the
/// cache). The dense-only backends say `Unsupported`.
#[test]
fn metadata_errors_are_typed() {
    let Some(dev) = common::device("metadata errors") else {
        return;
    };
    let (p, meta) = varlen(Problem::new(1, 2, 1, 1, 64), &[3, 5], &[4, 2]);
    let x = inputs(&p, meta.clone());
    let backend = seq_backends(&dev)[0];
    let run = |p: &Problem, meta: Option<&SeqMeta>| {
        let [q, k, v] = x.upload(&dev, p.dtype).unwrap();
        let mut out = sdpa::Tensor::poisoned(&dev, p.dtype, p.q_len().unwrap()).unwrap();
        let mut bufs = sdpa_harness::check::ExtraBuffers::new(&dev, p, None, None).unwrap();
        if let Some(m) = meta {
            bufs = bufs.with_meta(&dev, m).unwrap();
        }
        let t = sdpa::Tensors {
            q: &q,
            k: &k,
            v: &v,
            out: &mut out,
        };
        sdpa::forward(&dev, p, backend, t, bufs.extras())
    };
    run(&p, Some(&meta)).unwrap();
    let missing = SeqMeta {
        cu_seqlens_k: None,
        ..meta.clone()
    };
    let e = run(&p, Some(&missing)).unwrap_err().to_string();
    assert!(e.contains("needs cu_seqlens_k"), "{e}");
    let extra = SeqMeta {
        seqused_k: Some(vec![1, 1]),
        ..meta.clone()
    };
    let e = run(&p, Some(&extra)).unwrap_err().to_string();
    assert!(e.contains("seqused_k given"), "{e}");
    let decreasing = SeqMeta {
        cu_seqlens_q: Some(vec![0, 5, 3]),
        ..meta.clone()
    };
    let checked = p.with_seqs(p.seqs.with_checked(true));
    let e = run(&checked, Some(&decreasing)).unwrap_err();
    assert!(
        matches!(e, sdpa::Error::InvalidArgument(_)) && e.to_string().contains("decreases"),
        "{e}"
    );
    let runs = seq_backends(&dev);
    for b in common::expected_backends(&dev) {
        if runs.contains(&b) || b == Backend::Cpu {
            continue;
        }
        match b.supports(Some(&dev), &p) {
            Err(sdpa::Error::Unsupported { reason, .. }) => {
                assert!(reason.contains("dense sequences only"), "{b}: {reason}")
            }
            other => panic!("{b}: {other:?}"),
        }
    }
}

/// Decode steps (the decode kernel of cutlass-sm80, and of cutlass on Hopper: GQA groups packed,
/// keys split across CTAs and merged by their log-sum-exps): 1, 8 and 16 tokens against
/// thousands of keys, dense, paged and packed K/V, causal (the tokens are the newest keys) or not,
/// with the log-sum-exp.
#[test]
fn decode_matches_the_reference() {
    let Some(dev) = common::device("decode") else {
        return;
    };
    // cutlass (Hopper) runs decode steps on cutlass-sm80's decode kernel.
    let backends = seq_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    let mut run = |p: Problem, x: Inputs| {
        for &b in &backends {
            ran.push((b, p));
            if let Some(f) = check(&dev, &p, b, &x).unwrap() {
                failures.push(f);
            }
        }
    };
    for (n, &(seq_q, d, causal)) in [
        (1, 128, false),
        (8, 128, true),
        (16, 64, true),
        (1, 64, true),
    ]
    .iter()
    .enumerate()
    {
        let base = Problem::new(2, 8, seq_q, 3001, d)
            .with_kv_heads(2)
            .with_causal(causal)
            .with_dtype(DType::ALL[n % 2])
            .with_layout([sdpa::Layout::Bshd, sdpa::Layout::Bhsd][n % 2])
            .with_lse(true);
        run(base, random_inputs(&base, fresh_seed()).unwrap());
        let (p, meta) = paged(base, &[3001, 130, 0, 2000], 128, fresh_seed());
        run(p, inputs(&p, meta));
        let (p, meta) = varlen(base, &[seq_q, seq_q, seq_q], &[2999, 0, 700]);
        run(p, inputs(&p, meta));
    }
    // More GQA groups than SMs (waves of CTAs, a group each, no combine), dense and paged with
    // lengths that differ per sequence.
    let many = Problem::new(300, 2, 1, 512, 64)
        .with_kv_heads(1)
        .with_lse(true);
    run(many, random_inputs(&many, fresh_seed()).unwrap());
    let lens: Vec<usize> = (0..300).map(|i| 256 + (i * 37) % 257).collect();
    let (p, meta) = paged(many, &lens, 64, fresh_seed());
    run(p, inputs(&p, meta));
    // One group against many keys: more splits than a warp has lanes, merged by the combine.
    let long = Problem::new(1, 4, 1, 32768, 64)
        .with_kv_heads(1)
        .with_lse(true);
    run(long, random_inputs(&long, fresh_seed()).unwrap());
    // Few row blocks (on 132 SMs): 16 and 18 of them at 4 rows a CTA (1 token a sequence) take
    // 8 and 7 splits, 34 at 32 rows (8 tokens) 3, which Hopper merges in a cluster of each row
    // block's splits; 8 row blocks take 16 one-tile splits, merged by the combine.
    for (batch, seq_q, seq_k) in [(8, 1, 3001), (9, 1, 3001), (17, 8, 3001), (4, 1, 1000)] {
        let p = Problem::new(batch, 8, seq_q, seq_k, 128)
            .with_kv_heads(2)
            .with_causal(true)
            .with_lse(true);
        run(p, random_inputs(&p, fresh_seed()).unwrap());
    }
    common::assert_ran("decode", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Sinks on sequences of different lengths: packed Q and K/V with a sequence without keys (its
/// rows: output 0, log-sum-exp the sink) under causal, a 128-key window and no mask; queries
/// against a paged cache; decode steps whose keys split across CTAs, where the sink must join
/// each row once (in the combine), not once per split: gpt-oss's 64/8 heads at D = 64 and a
/// speculative step at D = 128, dense, paged and packed, and one group over 32k keys (more
/// splits than a warp has lanes).
#[test]
fn sinks_on_sequences_and_decode() {
    let Some(dev) = common::device("sinks on sequences") else {
        return;
    };
    let backends = seq_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    let mut run = |p: Problem, x: Inputs| {
        for &b in &backends {
            ran.push((b, p));
            if let Some(f) = check(&dev, &p, b, &x).unwrap() {
                failures.push(f);
            }
        }
    };
    let window = Mask::Window {
        left: Some(128),
        right: Some(0),
    };
    for (n, mask) in [Mask::CausalBottomRight, window, Mask::None]
        .into_iter()
        .enumerate()
    {
        let base = Problem::new(1, 8, 1, 1, 64)
            .with_kv_heads(2)
            .with_mask(mask)
            .with_dtype(DType::ALL[n % 2])
            .with_sinks(true)
            .with_lse(true);
        let (p, meta) = varlen(base, &[300, 5, 0, 77], &[300, 0, 10, 500]);
        run(p, inputs(&p, meta));
        let base = Problem::new(3, 8, 200, 1, 128)
            .with_kv_heads(4)
            .with_mask(mask)
            .with_dtype(DType::ALL[(n + 1) % 2])
            .with_sinks(true)
            .with_lse(true);
        let (p, meta) = paged(base, &[900, 200, 0], 128, fresh_seed());
        run(p, inputs(&p, meta));
    }
    for (n, &(seq_q, d)) in [(1, 64), (4, 128)].iter().enumerate() {
        let base = Problem::new(4, 64, seq_q, 8192, d)
            .with_kv_heads(8)
            .with_causal(true)
            .with_dtype(DType::ALL[n % 2])
            .with_layout([sdpa::Layout::Bshd, sdpa::Layout::Bhsd][n % 2])
            .with_sinks(true)
            .with_lse(true);
        run(base, random_inputs(&base, fresh_seed()).unwrap());
        let (p, meta) = paged(base, &[8192, 3000, 0, 100], 128, fresh_seed());
        run(p, inputs(&p, meta));
        let (p, meta) = varlen(base, &[seq_q; 4], &[5000, 0, 700, 8192]);
        run(p, inputs(&p, meta));
    }
    let long = Problem::new(1, 4, 1, 32768, 64)
        .with_kv_heads(1)
        .with_sinks(true)
        .with_lse(true);
    run(long, random_inputs(&long, fresh_seed()).unwrap());
    common::assert_ran("sinks on sequences", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// NaN and infinities in V at the newest keys, which the earlier draft tokens of a speculative
/// step do not see: each token gets what the reference gives it. 8 tokens of 4 heads are a CTA
/// of 32 rows; 4 tokens in 12 sequences a CTA of 16 rows, in splits of two tiles.
#[test]
fn decode_keeps_nonfinite_v_from_tokens_that_do_not_see_it() {
    let Some(dev) = common::device("decode nonfinite") else {
        return;
    };
    let mut ran = Vec::new();
    for (dtype, (batch, seq_q)) in DType::ALL
        .into_iter()
        .flat_map(|d| [(d, (1, 8)), (d, (12, 4))])
    {
        let p = Problem::new(batch, 4, seq_q, 1000, 128)
            .with_kv_heads(1)
            .with_causal(true)
            .with_dtype(dtype);
        let mut x = random_inputs(&p, fresh_seed()).unwrap();
        // Keys 997..999 are seen by the last tokens only (token i of n sees keys up to
        // 1000 - n + i); key 500 by every token.
        for (key, val) in [
            (997, f64::NAN),
            (998, f64::INFINITY),
            (999, f64::NEG_INFINITY),
            (500, f64::INFINITY),
        ] {
            x.set_value(2, key * 128 + 5, val, dtype);
        }
        for b in seq_backends(&dev) {
            ran.push((b, p));
            assert_eq!(check(&dev, &p, b, &x).unwrap(), None);
        }
    }
    common::assert_ran("decode nonfinite", &ran);
}

/// NaN and infinities in packed V near sequence boundaries: a kernel's key tile that runs past a
/// sequence's last key holds the next sequence's rows, whose non-finite values must not reach
/// the sequence; each sequence's rows get what the reference gives them.
#[test]
fn varlen_keeps_nonfinite_v_in_its_sequence() {
    let Some(dev) = common::device("varlen nonfinite") else {
        return;
    };
    // Packed rows: sequence 0 keys 0..50, sequence 1 50..250, sequence 2 250..280.
    let (q_lens, k_lens): (&[usize], &[usize]) = (&[50, 70, 1], &[50, 200, 30]);
    let masks = [
        Mask::None,
        Mask::CausalBottomRight,
        Mask::Window {
            left: Some(150),
            right: Some(0),
        },
    ];
    let mut ran = Vec::new();
    for (n, mask) in masks.into_iter().enumerate() {
        let base = Problem::new(1, 2, 1, 1, 128)
            .with_kv_heads(1)
            .with_mask(mask)
            .with_dtype(DType::ALL[n % 2]);
        let (p, meta) = varlen(base, q_lens, k_lens);
        let mut x = inputs(&p, meta);
        // Rows 60 and 120: sequence 1's keys 10 and 70, inside sequence 0's first 128-key tile;
        // row 255: sequence 2's key 5, inside sequence 1's second tile.
        for (row, val) in [
            (60, f64::NAN),
            (120, f64::INFINITY),
            (255, f64::NEG_INFINITY),
        ] {
            x.set_value(2, row * 128 + 7, val, p.dtype);
        }
        for b in seq_backends(&dev) {
            ran.push((b, p));
            assert_eq!(check(&dev, &p, b, &x).unwrap(), None);
        }
    }
    common::assert_ran("varlen nonfinite", &ran);
}

/// More query tiles than SMs, so that the cutlass (sm_90a) band kernel's persistent CTAs each
/// run several of them from the tile feed, one after another: packed sequences of uneven
/// lengths, causal and a window, GQA, D = 64, 128 and 256, the log-sum-exp, and non-finite V in
/// tiles that some rows see and others do not (the check's records of consecutive tiles of a
/// CTA), against the reference.
#[test]
fn varlen_on_a_persistent_grid() {
    let Some(dev) = common::device("varlen persistent") else {
        return;
    };
    let lens: &[usize] = &[700, 1300, 90, 1500, 513, 1];
    let mut ran = Vec::new();
    for (n, (d, mask)) in [
        (64, Mask::CausalBottomRight),
        (
            128,
            Mask::Window {
                left: Some(300),
                right: Some(0),
            },
        ),
        (256, Mask::CausalBottomRight),
    ]
    .into_iter()
    .enumerate()
    {
        let base = Problem::new(1, 16, 1, 1, d)
            .with_kv_heads(4)
            .with_mask(mask)
            .with_lse(true)
            .with_dtype(DType::ALL[n % 2]);
        let (p, meta) = varlen(base, lens, lens);
        // 128-row query tiles (64 where they would leave SMs idle): well over one a SM.
        let tiles: usize = lens.iter().map(|l| l.div_ceil(128)).sum::<usize>() * p.heads;
        assert!(
            tiles > 2 * dev.sm_count().unwrap() as usize,
            "{tiles} tiles"
        );
        let mut x = inputs(&p, meta);
        let row = p.kv_heads * d;
        // Keys 650 (sequence 0, seen by its last rows), 699 (its last key: the tail tile it
        // shares with sequence 1's first keys), 1000 (sequence 1's key 300) and 3000 (sequence
        // 3's key 910), in different heads and columns.
        for (key, head, val) in [
            (650, 0, f64::NAN),
            (699, 1, f64::INFINITY),
            (1000, 3, f64::NEG_INFINITY),
            (3000, 2, f64::NAN),
        ] {
            x.set_value(2, key * row + head * d + 5, val, p.dtype);
        }
        for b in seq_backends(&dev) {
            ran.push((b, p));
            assert_eq!(check(&dev, &p, b, &x).unwrap(), None);
        }
    }
    common::assert_ran("varlen persistent", &ran);
}

/// `append_kv` writes each sequence's new rows at its length's position through the block table
/// (across a page boundary too) and advances the lengths; attention on the grown cache matches
/// the reference; with `Seqs::checked` an append past the pages is a typed error.
#[test]
fn appends_land_where_the_block_table_says() {
    let Some(dev) = common::device("kv append") else {
        return;
    };
    // Lengths before the append, and after 3 new rows each (62 -> 65 crosses a 32-key page).
    let (k_lens, n_new): (&[usize], usize) = (&[62, 0, 130], 3);
    let grown: Vec<usize> = k_lens.iter().map(|l| l + n_new).collect();
    let base = Problem::new(1, 4, 3, 1, 64)
        .with_kv_heads(2)
        .with_causal(true);
    let (p, meta) = paged(base, &grown, 32, fresh_seed());
    let x = inputs(&p, meta.clone());
    let [q, mut kc, mut vc] = x.upload(&dev, p.dtype).unwrap();
    let stream = dev.stream();
    let table = stream
        .clone_htod(meta.block_table.as_ref().unwrap())
        .unwrap();
    let before: Vec<i32> = k_lens.iter().map(|&l| l as i32).collect();
    let mut used = stream.clone_htod(&before).unwrap();
    let row = p.kv_heads * p.head_dim;
    // New rows [3 sequences, n_new, kv_heads, 64]: a dense problem's K and V of that size.
    let new = random_inputs(&Problem::new(3, 2, n_new, n_new, 64), fresh_seed()).unwrap();
    let kn = sdpa::Tensor::from_bits(&dev, p.dtype, &new.bits[1]).unwrap();
    let vn = sdpa::Tensor::from_bits(&dev, p.dtype, &new.bits[2]).unwrap();
    let append = |n: usize,
                  p: &Problem,
                  kc: &mut sdpa::Tensor,
                  vc: &mut sdpa::Tensor,
                  used: &mut cudarc::driver::CudaSlice<i32>| {
        sdpa::append_kv(
            &dev,
            p,
            sdpa::KvAppend {
                k_new: &kn,
                v_new: &vn,
                n_new: n,
                k_cache: kc,
                v_cache: vc,
                block_table: table.as_view(),
                seqused_k: used.as_view_mut(),
            },
        )
    };
    append(n_new, &p, &mut kc, &mut vc, &mut used).unwrap();
    let after = stream.clone_dtoh(&used).unwrap();
    assert_eq!(after, grown.iter().map(|&l| l as i32).collect::<Vec<_>>());
    // Each new row sits at its position's page and row.
    let kh = kc.to_bits(&dev).unwrap();
    let table_h = meta.block_table.clone().unwrap();
    let sdpa::KvRows::Paged {
        page_size,
        pages_per_seq,
        ..
    } = p.seqs.kv
    else {
        unreachable!("a paged problem")
    };
    for (b, &l) in k_lens.iter().enumerate() {
        for i in 0..n_new {
            let pos = l + i;
            let page = table_h[b * pages_per_seq + pos / page_size] as usize;
            let at = (page * page_size + pos % page_size) * row;
            let src = (b * n_new + i) * row;
            assert_eq!(
                kh[at..][..row],
                new.bits[1][src..][..row],
                "sequence {b} row {i}"
            );
        }
    }
    // Attention over the grown cache.
    let grown_cache = Inputs::from_f32(
        p.dtype,
        &q.to_f32(&dev).unwrap(),
        &kc.to_f32(&dev).unwrap(),
        &vc.to_f32(&dev).unwrap(),
    )
    .with_meta(meta);
    let mut ran = Vec::new();
    for b in seq_backends(&dev) {
        if refuses_as_documented(&dev, &p, b) {
            continue;
        }
        ran.push((b, p));
        assert_eq!(check(&dev, &p, b, &grown_cache).unwrap(), None);
    }
    common::assert_ran("kv append", &ran);
    // Past the pages: refused before anything runs where the problem asks for checks.
    let checked = p.with_seqs(p.seqs.with_checked(true));
    let full = vec![(pages_per_seq * page_size - 1) as i32; 3];
    stream.memcpy_htod(&full, &mut used).unwrap();
    let e = append(n_new, &checked, &mut kc, &mut vc, &mut used).unwrap_err();
    assert!(e.to_string().contains("would hold"), "{e}");
}

/// Unchecked metadata that lies cannot fault the device: the kernels clamp what they read of it.
/// Sequence 0 of a paged decode step and of a paged prefill gets block-table entries far outside
/// the cache (2^20, `i32::MAX`) and negative ones, then `seqused_k` far past its pages, then a
/// negative one; a packed batch gets offsets that run past the packed rows, decrease, or are
/// negative. Every backend that runs such batches returns `Ok`; where sequence 1's metadata is
/// true its output is the reference's; and afterwards an honest call on the same context still
/// matches the reference (a device fault would have lost the context). Run under
/// compute-sanitizer's memcheck (scripts/sanitize.sh) this also shows no access outside the
/// call's buffers.
#[test]
fn lying_metadata_cannot_fault_the_device() {
    let Some(dev) = common::device("lying metadata") else {
        return;
    };
    let backends = seq_backends(&dev);
    let mut ran = Vec::new();
    // (query rows, page size): a decode step (the split-KV decode kernel) and a prefill against
    // the cache (the band kernels; 128-key pages hold cutlass's whole key tiles).
    for (seq_q, page_size) in [(1, 16), (64, 128)] {
        let base = Problem::new(1, 4, seq_q, 1, 128)
            .with_kv_heads(2)
            .with_causal(true);
        let seed = fresh_seed();
        let (p, meta) = paged(base, &[300, 280], page_size, seed);
        let sdpa::KvRows::Paged { pages_per_seq, .. } = p.seqs.kv else {
            unreachable!("a paged problem")
        };
        let lies: [(&str, Lie); 3] = [
            ("pages outside the cache", |m, pages_per_seq| {
                let row = &mut m.block_table.as_mut().unwrap()[..pages_per_seq];
                for (i, e) in row.iter_mut().enumerate() {
                    *e = [1 << 20, -1, i32::MAX, i32::MIN][i % 4];
                }
            }),
            ("seqused_k past the pages", |m, _| {
                m.seqused_k.as_mut().unwrap()[0] = i32::MAX
            }),
            ("negative seqused_k", |m, _| {
                m.seqused_k.as_mut().unwrap()[0] = -5
            }),
        ];
        let want = inputs_seeded(&p, meta.clone(), seed).reference(&p).unwrap();
        let half = p.q_len().unwrap() / 2; // sequence 1: the second batch entry of dense Q
        for (lie, corrupt) in &lies {
            let mut bad = meta.clone();
            corrupt(&mut bad, pages_per_seq);
            let x = inputs_seeded(&p, bad, seed);
            for &b in &backends {
                if refuses_as_documented(&dev, &p, b) {
                    continue;
                }
                let (got, _) =
                    sdpa_harness::check::run_backend_with_lse(Some(&dev), &p, b, &x, None)
                        .unwrap_or_else(|e| panic!("{b} {p}, {lie}: {e}"));
                dev.synchronize()
                    .unwrap_or_else(|e| panic!("{b} {p}, {lie}: the device faulted: {e}"));
                let r = compare(&got[half..], &want.out[half..], p.dtype, 0);
                assert!(r.pass(), "{b} {p}, {lie}: sequence 1 {r:?}");
                ran.push((b, p));
            }
        }
    }
    let (p, meta) = varlen(Problem::new(1, 4, 1, 1, 64), &[30, 70, 5], &[50, 20, 90]);
    let seed = fresh_seed();
    let (total_q, total_k) = (105, 160);
    for (lie, cu_q, cu_k) in [
        (
            "offsets past the rows",
            vec![0, 1 << 30, i32::MAX, 105],
            vec![0, 50, 70, 160],
        ),
        (
            "decreasing offsets",
            vec![0, 30, 100, 105],
            vec![0, 150, 20, 160],
        ),
        (
            "negative offsets",
            vec![-1 << 30, 30, 100, 105],
            vec![0, -50, 70, i32::MIN],
        ),
    ] {
        assert_eq!((cu_q[3], total_q, total_k), (105, 105, 160));
        let bad = SeqMeta {
            cu_seqlens_q: Some(cu_q),
            cu_seqlens_k: Some(cu_k),
            ..meta.clone()
        };
        let x = inputs_seeded(&p, bad, seed);
        for &b in &backends {
            sdpa_harness::check::run_backend_with_lse(Some(&dev), &p, b, &x, None)
                .unwrap_or_else(|e| panic!("{b} {p}, {lie}: {e}"));
            dev.synchronize()
                .unwrap_or_else(|e| panic!("{b} {p}, {lie}: the device faulted: {e}"));
            ran.push((b, p));
        }
    }
    // The context is intact: an honest call still matches the reference.
    let x = inputs(&p, meta);
    for &b in &backends {
        assert_eq!(check(&dev, &p, b, &x).unwrap(), None, "{b} after the lies");
    }
    common::assert_ran("lying metadata", &ran);
    for b in &backends {
        assert!(ran.iter().any(|(r, _)| r == b), "{b} ran no lie");
    }
}

/// A lie told about sequence 0's metadata (given the block table's columns).
type Lie = fn(&mut SeqMeta, usize);

fn inputs_seeded(p: &Problem, meta: SeqMeta, seed: u64) -> Inputs {
    random_inputs(p, seed).unwrap().with_meta(meta)
}

/// `append_kv` with lengths or a block table that lie, unchecked: a position past the pages is
/// dropped and the length stops at the pages' capacity (or at 0 from below), a block-table entry
/// outside the cache lands in the cache, and nothing faults. And a count of new rows whose
/// tensor length overflows (`batch x n_new x kv_heads x head_dim` past `usize::MAX`, which
/// wrapped to 0 before) is a typed error, not a launch reading past a one-element tensor.
#[test]
fn appends_with_lying_metadata_stay_in_the_cache() {
    let Some(dev) = common::device("lying appends") else {
        return;
    };
    let base = Problem::new(1, 2, 1, 1, 64).with_kv_heads(2);
    let (p, meta) = paged(base, &[40, 10], 16, fresh_seed());
    let sdpa::KvRows::Paged {
        page_size,
        pages_per_seq,
        ..
    } = p.seqs.kv
    else {
        unreachable!("a paged problem")
    };
    let capacity = (pages_per_seq * page_size) as i32;
    let x = inputs(&p, meta.clone());
    let [_, mut kc, mut vc] = x.upload(&dev, p.dtype).unwrap();
    let new = random_inputs(&Problem::new(2, 2, 3, 3, 64), fresh_seed()).unwrap();
    let kn = sdpa::Tensor::from_bits(&dev, p.dtype, &new.bits[1]).unwrap();
    let vn = sdpa::Tensor::from_bits(&dev, p.dtype, &new.bits[2]).unwrap();
    let stream = dev.stream();
    let mut table = meta.block_table.clone().unwrap();
    let mut append = |table: &[i32], used: &[i32], n_new: usize| -> Vec<i32> {
        let table = stream.clone_htod(table).unwrap();
        let mut used = stream.clone_htod(used).unwrap();
        sdpa::append_kv(
            &dev,
            &p,
            sdpa::KvAppend {
                k_new: &kn,
                v_new: &vn,
                n_new,
                k_cache: &mut kc,
                v_cache: &mut vc,
                block_table: table.as_view(),
                seqused_k: used.as_view_mut(),
            },
        )
        .unwrap();
        dev.synchronize().unwrap();
        stream.clone_dtoh(&used).unwrap()
    };
    // Lengths: one a row short of the capacity, one far below zero.
    let after = append(&table, &[capacity - 1, -100], 3);
    assert_eq!(after, [capacity, 0], "lengths past the pages or below 0");
    let after = append(&table, &[i32::MAX - 1, i32::MIN + 1], 3);
    assert_eq!(after, [capacity, 0], "lengths near the i32 limits");
    // Pages outside the cache.
    for (i, e) in table.iter_mut().enumerate() {
        *e = [1 << 20, -1, i32::MAX, i32::MIN][i % 4];
    }
    let after = append(&table, &[0, 5], 3);
    assert_eq!(after, [3, 8]);
    // The cache still serves an honest call.
    let x = inputs(&p, meta);
    let mut ran = Vec::new();
    for b in seq_backends(&dev) {
        if refuses_as_documented(&dev, &p, b) {
            continue;
        }
        assert_eq!(
            check(&dev, &p, b, &x).unwrap(),
            None,
            "{b} after the appends"
        );
        ran.push((b, p));
    }
    common::assert_ran("lying appends", &ran);

    // batch x n_new x kv_heads x head_dim = 2^15 x 2^26 x 2^15 x 2^8 = 2^64: 0 when it wraps.
    let big = Problem::new(1 << 15, 1 << 15, 1, 16, 256).with_paged_kv(1, 16, 1);
    let one = sdpa::Tensor::from_f32(&dev, big.dtype, &[0.0]).unwrap();
    let mut kc = sdpa::Tensor::zeros(&dev, big.dtype, big.k_len().unwrap()).unwrap();
    let mut vc = sdpa::Tensor::zeros(&dev, big.dtype, big.k_len().unwrap()).unwrap();
    let table = stream.alloc_zeros::<i32>(1 << 15).unwrap();
    let mut used = stream.alloc_zeros::<i32>(1 << 15).unwrap();
    let e = sdpa::append_kv(
        &dev,
        &big,
        sdpa::KvAppend {
            k_new: &one,
            v_new: &one,
            n_new: 1 << 26,
            k_cache: &mut kc,
            v_cache: &mut vc,
            block_table: table.as_view(),
            seqused_k: used.as_view_mut(),
        },
    )
    .unwrap_err();
    assert!(
        matches!(e, sdpa::Error::InvalidArgument(_)) && e.to_string().contains("more than"),
        "{e}"
    );
}

/// New rows `[rows, kv_heads, head_dim]` of K and V, `row` elements a row.
fn new_rows<'a, T>(
    k: &'a cudarc::driver::CudaSlice<T>,
    v: &'a cudarc::driver::CudaSlice<T>,
    row: usize,
    head_dim: usize,
) -> sdpa::NewRows<'a, T> {
    sdpa::NewRows {
        k: k.as_view(),
        v: v.as_view(),
        rows: k.len() / row,
        row_stride: row,
        head_stride: head_dim,
    }
}

/// The cache a paged problem `p` reads, in K and V.
fn paged_cache<'a, T>(
    k: cudarc::driver::CudaViewMut<'a, T>,
    v: cudarc::driver::CudaViewMut<'a, T>,
    p: &Problem,
) -> sdpa::PagedCache<'a, T> {
    let sdpa::KvRows::Paged {
        pages, page_size, ..
    } = p.seqs.kv
    else {
        unreachable!("a paged problem")
    };
    sdpa::PagedCache {
        k,
        v,
        pages,
        page_size,
        kv_heads: p.kv_heads,
        head_dim: p.head_dim,
        layout: p.seqs.page_layout,
    }
}

/// `write_kv` fills NHD and HND caches, part by slot (with padding slots that write nothing)
/// and part by per-sequence appends (different counts, one of none, across page boundaries);
/// every row lands where its slot or its sequence's block table says, the lengths advance, and
/// attention over the written cache, as a problem of that page layout, matches the reference of
/// the same keys in the original NHD cache: through owned tensors on each backend, and through
/// views of the written buffers.
#[test]
fn caches_written_by_slot_and_by_append_in_both_page_layouts() {
    let Some(dev) = common::device("kv write") else {
        return;
    };
    // Pages smaller than cutlass's key tile (which refuses them) and pages that hold whole ones.
    let ran: Vec<_> = [32, 128]
        .into_iter()
        .flat_map(|page_size| write_and_attend(&dev, page_size))
        .collect();
    assert!(
        ran.iter()
            .any(|(b, p)| *b == Backend::Cutlass && p.seqs.page_layout == sdpa::PageLayout::Hnd)
            || !common::expected_backends(&dev).contains(&Backend::Cutlass),
        "cutlass ran no HND cache"
    );
    common::assert_ran("kv write", &ran);
}

/// The writes and the attention of `caches_written_by_slot_and_by_append_in_both_page_layouts`
/// in pages of `page_size`: the backends that ran, and their problems.
fn write_and_attend(dev: &sdpa::Device, page_size: usize) -> Vec<(Backend, Problem)> {
    use half::bf16;
    use sdpa::{PageLayout, Placement};
    let dev = dev.clone();
    let stream = dev.stream();
    let k_lens: &[usize] = &[70, 0, 33, 129];
    let appended: &[usize] = &[3, 0, 5, 64];
    let base = Problem::new(1, 4, 5, 1, 64)
        .with_kv_heads(2)
        .with_dtype(DType::Bf16)
        .with_causal(true);
    let (p, meta) = paged(base, k_lens, page_size, fresh_seed());
    let x = inputs(&p, meta.clone());
    let want = x.reference(&p).unwrap();
    let sdpa::KvRows::Paged { pages_per_seq, .. } = p.seqs.kv else {
        unreachable!("a paged problem")
    };
    let (heads, d) = (p.kv_heads, p.head_dim);
    let table = meta.block_table.clone().unwrap();
    // Key j of sequence b: its page and offset, and its row of the original NHD cache.
    let place = |b: usize, j: usize| {
        (
            table[b * pages_per_seq + j / page_size] as usize,
            j % page_size,
        )
    };
    let nhd_row = |b: usize, j: usize| {
        let (page, off) = place(b, j);
        (page * page_size + off) * heads * d
    };
    let row = heads * d;
    let gather = |t: usize, rows: &[(usize, usize)]| -> Vec<bf16> {
        rows.iter()
            .flat_map(|&(b, j)| {
                x.bits[t][nhd_row(b, j)..][..row]
                    .iter()
                    .map(|&w| bf16::from_bits(w))
            })
            .collect()
    };
    // By slot: each sequence's first keys, and a padding row (slot -1) after every tenth.
    let (mut slot_rows, mut slots) = (Vec::new(), Vec::new());
    for (b, (&l, &a)) in k_lens.iter().zip(appended).enumerate() {
        for j in 0..l - a {
            let (page, off) = place(b, j);
            slot_rows.push((b, j));
            slots.push((page * page_size + off) as i64);
            if j % 10 == 9 {
                slot_rows.push((b, j));
                slots.push(-1);
            }
        }
    }
    // By append: each sequence's last `appended` keys, after its first.
    let append_rows: Vec<(usize, usize)> = k_lens
        .iter()
        .zip(appended)
        .enumerate()
        .flat_map(|(b, (&l, &a))| (l - a..l).map(move |j| (b, j)))
        .collect();
    let mut cu_new = vec![0i32];
    for &a in appended {
        cu_new.push(cu_new.last().unwrap() + a as i32);
    }
    let before: Vec<i32> = k_lens
        .iter()
        .zip(appended)
        .map(|(&l, &a)| (l - a) as i32)
        .collect();

    let mut ran = Vec::new();
    for layout in [PageLayout::Nhd, PageLayout::Hnd] {
        let pl = p.with_page_layout(layout);
        let len = pl.k_len().unwrap();
        let (mut kc, mut vc) = (
            stream.alloc_zeros::<bf16>(len).unwrap(),
            stream.alloc_zeros::<bf16>(len).unwrap(),
        );
        let (sk, sv) = (
            stream.clone_htod(&gather(1, &slot_rows)).unwrap(),
            stream.clone_htod(&gather(2, &slot_rows)).unwrap(),
        );
        let slots_d = stream.clone_htod(&slots).unwrap();
        sdpa::write_kv(
            &dev,
            paged_cache(kc.as_view_mut(), vc.as_view_mut(), &pl),
            new_rows(&sk, &sv, row, d),
            Placement::Slots(slots_d.as_view()),
        )
        .unwrap();
        let (ak, av) = (
            stream.clone_htod(&gather(1, &append_rows)).unwrap(),
            stream.clone_htod(&gather(2, &append_rows)).unwrap(),
        );
        let (cu_d, table_d) = (
            stream.clone_htod(&cu_new).unwrap(),
            stream.clone_htod(&table).unwrap(),
        );
        let mut used = stream.clone_htod(&before).unwrap();
        sdpa::write_kv(
            &dev,
            paged_cache(kc.as_view_mut(), vc.as_view_mut(), &pl),
            new_rows(&ak, &av, row, d),
            Placement::Append {
                cu_new: cu_d.as_view(),
                block_table: table_d.as_view(),
                pages_per_seq,
                seqused_k: used.as_view_mut(),
            },
        )
        .unwrap();
        let lens: Vec<i32> = k_lens.iter().map(|&l| l as i32).collect();
        assert_eq!(
            stream.clone_dtoh(&used).unwrap(),
            lens,
            "{layout:?} lengths"
        );
        // Every key where its page layout puts it.
        let (kh, vh) = (
            stream.clone_dtoh(&kc).unwrap(),
            stream.clone_dtoh(&vc).unwrap(),
        );
        for (b, &l) in k_lens.iter().enumerate() {
            for j in 0..l {
                let (page, off) = place(b, j);
                for h in 0..heads {
                    let at = match layout {
                        PageLayout::Nhd => ((page * page_size + off) * heads + h) * d,
                        PageLayout::Hnd => ((page * heads + h) * page_size + off) * d,
                    };
                    let src = nhd_row(b, j) + h * d;
                    for (t, got) in [(1, &kh), (2, &vh)] {
                        let got: Vec<u16> = got[at..][..d].iter().map(|e| e.to_bits()).collect();
                        assert_eq!(got, x.bits[t][src..][..d], "{layout:?} {b} {j} {h}");
                    }
                }
            }
        }
        // Attention over the written cache, as owned tensors on each backend.
        let f32s = |v: &[bf16]| v.iter().map(|e| e.to_f32()).collect::<Vec<_>>();
        let q32: Vec<f32> = x.values[0].iter().map(|&e| e as f32).collect();
        let written =
            Inputs::from_f32(DType::Bf16, &q32, &f32s(&kh), &f32s(&vh)).with_meta(meta.clone());
        assert_eq!(
            written.reference(&pl).unwrap().out,
            want.out,
            "{layout:?} reference"
        );
        for b in seq_backends(&dev) {
            if refuses_as_documented(&dev, &pl, b) {
                continue;
            }
            ran.push((b, pl));
            assert_eq!(
                check(&dev, &pl, b, &written).unwrap(),
                None,
                "{layout:?} {b}"
            );
        }
        // Through views of the written buffers.
        let qd = stream
            .clone_htod(
                &x.bits[0]
                    .iter()
                    .map(|&w| bf16::from_bits(w))
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        let mut out = stream.alloc_zeros::<bf16>(pl.q_len().unwrap()).unwrap();
        let used_d = stream.clone_htod(&lens).unwrap();
        sdpa::forward(
            &dev,
            &pl,
            Backend::Auto,
            sdpa::Views {
                q: sdpa::View::new(qd.as_view(), pl.q_strides()),
                k: sdpa::View::new(kc.as_view(), pl.k_strides()),
                v: sdpa::View::new(vc.as_view(), pl.k_strides()),
                out: sdpa::ViewMut::new(out.as_view_mut(), pl.q_strides()),
            },
            sdpa::Extras {
                seqused_k: Some(used_d.as_view()),
                block_table: Some(table_d.as_view()),
                ..sdpa::Extras::default()
            },
        )
        .unwrap();
        let got: Vec<f64> = stream
            .clone_dtoh(&out)
            .unwrap()
            .iter()
            .map(|e| f64::from(e.to_f32()))
            .collect();
        let r = compare(&got, &want.out, DType::Bf16, 0);
        assert!(r.pass(), "{layout:?} views: {r:?}");
    }
    ran
}
