//! The 32-bit limits of the GPU backends are checked on the problem alone, so they hold with no
//! GPU: a valid problem over a limit gets `Error::Unsupported` naming the value and the limit,
//! and one at the limit passes (without a device the backend's only objection left is then the
//! missing GPU or build). Each pair sits as close to the boundary as the problem allows.

mod common;

use sdpa::{Backend, DType, Error, Layout, Problem};
use std::io::Write;

const INT_MAX: usize = i32::MAX as usize;

/// What `supports(None, _)` may still say about a problem within every limit.
const NOT_A_LIMIT: [&str; 3] = ["needs a GPU", "no CUTLASS headers", "without 90a"];

fn bshd(batch: usize, heads: usize, seq: usize, head_dim: usize) -> Problem {
    Problem::new(batch, heads, seq, seq, head_dim).with_layout(Layout::Bshd)
}

/// `p` is valid, and `backend` rejects it as unsupported with every fragment in its reason.
fn rejects(backend: Backend, p: &Problem, fragments: &[&str]) {
    p.validate()
        .unwrap_or_else(|e| panic!("{p} must be valid: {e}"));
    match backend.supports(None, p) {
        Err(Error::Unsupported { backend: b, reason }) => {
            assert_eq!(b, backend.name(), "{p}: {reason}");
            for f in fragments {
                assert!(reason.contains(f), "{backend} {p}: {reason:?} lacks {f:?}");
            }
        }
        other => panic!("{backend} {p}: expected Unsupported, got {other:?}"),
    }
}

/// `p` is valid and within every limit of `backend`.
fn passes(backend: Backend, p: &Problem) {
    p.validate()
        .unwrap_or_else(|e| panic!("{p} must be valid: {e}"));
    match backend.supports(None, p) {
        Ok(()) => {}
        Err(Error::Unsupported { reason, .. })
            if NOT_A_LIMIT.iter().any(|r| reason.contains(r)) => {}
        Err(e) => panic!("{backend} {p}: expected no limit to apply, got {e}"),
    }
}

/// BSHD with heads x head_dim >= 2^31: cuBLAS's leading dimension would not fit its int; the
/// grid-y kernels stop at 65535 heads; the sm_90a kernel addresses rows through 64-bit TMA
/// strides and takes it.
#[test]
fn bshd_rows_of_2_pow_31_elements() {
    let p = bshd(1, 1 << 24, 1, 128);
    rejects(
        Backend::Cublas,
        &p,
        &["heads x head_dim", "= 2147483648", "2^31 - 1"],
    );
    for b in [Backend::Scalar, Backend::Wmma, Backend::CutlassSm80] {
        rejects(b, &p, &["heads (16777216)", "65535"]);
    }
    passes(Backend::Cutlass, &p);
    // Auto finds no backend without a GPU, and passes on each one's reason.
    let e = Backend::Auto.supports(None, &p).unwrap_err().to_string();
    assert!(e.contains("heads x head_dim"), "{e}");
}

#[test]
fn cublas_leading_dimension() {
    // heads x head_dim = 2^31 against 2^31 - 2 (2^31 - 1 is prime: 1 x (2^31 - 1) is head_dim).
    rejects(
        Backend::Cublas,
        &bshd(1, 2, 3, 1 << 30),
        &["row stride of Q and O", "= 2147483648", "2^31 - 1"],
    );
    passes(Backend::Cublas, &bshd(1, 2, 3, (1 << 30) - 1));
    passes(Backend::Cublas, &bshd(1, 1, 3, INT_MAX));
}

#[test]
fn cublas_gemm_dimensions() {
    rejects(
        Backend::Cublas,
        &Problem::new(1, 1, 1, 1, INT_MAX + 1),
        &["head_dim", "= 2147483648", "2^31 - 1"],
    );
    passes(Backend::Cublas, &Problem::new(1, 1, 1, 1, INT_MAX));
    rejects(
        Backend::Cublas,
        &Problem::new(1, 1, INT_MAX + 1, 1, 1),
        &["seq_q", "= 2147483648", "2^31 - 1"],
    );
    rejects(
        Backend::Cublas,
        &Problem::new(1, 1, 1, INT_MAX + 1, 1),
        &["seq_k", "= 2147483648", "2^31 - 1"],
    );
    passes(Backend::Cublas, &Problem::new(1, 1, INT_MAX, INT_MAX, 1));
}

#[test]
fn cublas_batch_count_and_softmax_rows() {
    // BHSD batches every (batch, kv_head) pair in one call.
    rejects(
        Backend::Cublas,
        &Problem::new(2, 1 << 30, 1, 1, 1),
        &["batch count", "= 2147483648", "2^31 - 1"],
    );
    passes(Backend::Cublas, &Problem::new(1, INT_MAX, 1, 1, 1));
    // One softmax CTA per score row (batch x heads x seq_q) on grid x.
    rejects(
        Backend::Cublas,
        &Problem::new(2, 2, 1 << 29, 1, 1),
        &["2147483648 score rows", "2^31 - 1"],
    );
    passes(Backend::Cublas, &Problem::new(2, 2, (1 << 29) - 1, 1, 1));
}

#[test]
fn grid_y_and_z_of_the_fused_kernels() {
    for b in [Backend::Scalar, Backend::Wmma, Backend::CutlassSm80] {
        rejects(
            b,
            &Problem::new(1, 65536, 1, 1, 64),
            &["heads (65536)", "65535"],
        );
        rejects(
            b,
            &Problem::new(65536, 1, 1, 1, 64),
            &["batch (65536)", "65535"],
        );
        passes(b, &Problem::new(65535, 65535, 1, 1, 64));
    }
    // The sm_90a kernel flattens (query tile, head, batch) into grid x.
    passes(Backend::Cutlass, &Problem::new(1, 65536, 1, 1, 64));
    passes(Backend::Cutlass, &Problem::new(65536, 1, 1, 1, 64));
}

#[test]
fn wmma_key_tile_offsets() {
    let over = Problem::new(1, 1, 1, (1 << 30) + 1, 64);
    rejects(Backend::Wmma, &over, &["seq_k = 1073741825", "2^30"]);
    passes(Backend::Wmma, &Problem::new(1, 1, 1, 1 << 30, 64));
    // e4m3 runs the 16-bit kernel on dequantized copies: the same limit.
    rejects(
        Backend::Wmma,
        &over.with_dtype(DType::E4m3),
        &["seq_k = 1073741825", "2^30"],
    );
    // The other kernels take it.
    for b in [Backend::Scalar, Backend::CutlassSm80, Backend::Cutlass] {
        passes(b, &over);
    }
}

#[test]
fn cutlass_sequence_lengths() {
    // Rows and keys are indexed up to a tile past the end: 2^31 less the kernel's largest tile
    // (cutlass at D = 64 takes 192 query rows on three consumer warpgroups). One query against
    // many keys is a decode step, whose kernel's tile is 128: the 192-row kernel's key limit is
    // checked with a tile of queries.
    for (b, d, tile, queries) in [
        (Backend::CutlassSm80, 64, 128, 1),
        (Backend::Cutlass, 128, 128, 1),
        (Backend::Cutlass, 64, 192, 64),
    ] {
        let at = INT_MAX - (tile - 1);
        let limit = format!("2^31 - {tile}");
        rejects(
            b,
            &Problem::new(1, 1, at + 1, 1, d),
            &[&format!("seq_q = {}", at + 1), &limit],
        );
        rejects(
            b,
            &Problem::new(1, 1, queries, at + 1, d),
            &[&format!("seq_k = {}", at + 1), &limit],
        );
        passes(b, &Problem::new(1, 1, at, at, d));
    }
    // Scalar holds rows and keys in 64 bits.
    let at = INT_MAX - 127;
    passes(Backend::Scalar, &Problem::new(1, 1, at + 1, at + 1, 64));
}

#[test]
fn sm90_causal_diagonal() {
    let p = Problem::new(1, 1, 1 << 30, 1 << 30, 64).with_causal(true);
    rejects(
        Backend::Cutlass,
        &p,
        &["seq_q + seq_k = 2147483648", "2^31 - 1"],
    );
    passes(
        Backend::Cutlass,
        &Problem {
            seq_k: (1 << 30) - 1,
            ..p
        },
    );
    passes(Backend::Cutlass, &p.with_causal(false));
}

#[test]
fn sm90_work_tiles() {
    // One 128-row tile per (batch, head): the element cap of `validate` leaves longer rows far
    // from this limit.
    rejects(
        Backend::Cutlass,
        &Problem::new(1, (1 << 30) + 1, 1, 1, 64),
        &["1073741825 work tiles", "2^30"],
    );
    passes(Backend::Cutlass, &Problem::new(1, 1 << 30, 1, 1, 64));
    passes(Backend::Cutlass, &Problem::new(1 << 15, 1 << 15, 1, 1, 64));
}

#[test]
fn sm90_tma_strides() {
    // 2^20 (batch, head) pairs of 4096 x 128 f16 elements: Q and K are 2^40 bytes.
    let p = Problem::new(1 << 10, 1 << 10, 4096, 4096, 128);
    rejects(Backend::Cutlass, &p, &["Q is 1099511627776 bytes", "2^40"]);
    passes(
        Backend::Cutlass,
        &Problem {
            seq_q: 4095,
            seq_k: 4095,
            ..p
        },
    );
    // e4m3: one byte an element, but at head_dim 128 the kernel reads V through an f16 copy.
    let e4m3 = p.with_dtype(DType::E4m3);
    rejects(
        Backend::Cutlass,
        &e4m3,
        &["V is 1099511627776 bytes", "2^40"],
    );
    passes(
        Backend::Cutlass,
        &Problem {
            seq_k: 4095,
            ..e4m3
        },
    );
}

/// On a GPU the limits still come first (cuBLAS names its leading dimension, not memory), and
/// the sm_90a kernel, which has no grid y or z, computes more than 65535 heads or batch entries
/// correctly (e4m3 with per-head scales too). Skips without a GPU, and the sm_90a part off
/// sm_90.
#[test]
fn on_a_gpu_limits_come_first_and_sm90_runs_past_65535() {
    let Some(dev) = common::device("index limits on a GPU") else {
        return;
    };
    let e = Backend::Cublas
        .supports(Some(&dev), &bshd(1, 1 << 24, 1, 128))
        .unwrap_err();
    assert!(e.to_string().contains("heads x head_dim"), "{e}");
    for p in [
        Problem::new(1, 65537, 2, 3, 64).with_causal(true),
        Problem::new(65537, 2, 2, 2, 64)
            .with_kv_heads(1)
            .with_layout(Layout::Bshd),
        Problem::new(65537, 1, 1, 2, 128).with_dtype(DType::E4m3),
    ] {
        if let Err(e) = Backend::Cutlass.supports(Some(&dev), &p) {
            let _ = writeln!(std::io::stderr(), "cutlass {p}: skipped ({e})");
            continue;
        }
        let r = sdpa_harness::check::check_backend(Some(&dev), &p, Backend::Cutlass, 7).unwrap();
        assert!(r.pass(), "cutlass {p}: {r:?}");
    }
}

/// A window whose sides are near `usize::MAX` (as wide as unbounded) is no narrow window: the
/// band kernels' check of left + right + 1 against their key tile must not overflow into a
/// refusal (which sent `Auto` to scalar).
#[test]
fn windows_near_the_limits_are_not_narrow() {
    for side in [usize::MAX, i64::MAX as usize, (i64::MAX / 2 + 1) as usize] {
        let p = Problem::new(1, 2, 300, 300, 64).with_mask(sdpa::Mask::Window {
            left: Some(side),
            right: Some(side),
        });
        for b in [Backend::Cutlass, Backend::CutlassSm80] {
            passes(b, &p);
        }
    }
}
