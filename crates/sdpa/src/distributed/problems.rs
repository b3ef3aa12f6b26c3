//! What a ring call runs as single-GPU problems, and what it refuses: the ring problem's checks,
//! each rank's local problem and shards, each block's problem, and the fingerprint every rank
//! compares before a call.

use super::schedule::Block;
use super::shard::Shard;
use super::zigzag::Zigzag;
use crate::device::Device;
use crate::error::{Error, Result, invalid};
use crate::problem::{DType, Mask, Problem, Strides, TensorShape};
use cudarc::driver::{DevicePtr, DeviceSlice};

/// The single-GPU problem of one block: the block's rows and keys, the ring problem's heads,
/// scale and softcap, causal where the block is.
pub(crate) fn block_problem(p: &Problem, b: &Block) -> Problem {
    let mut bp = Problem::new(p.batch, p.heads, b.q.len(), b.k.len(), p.head_dim)
        .with_kv_heads(p.kv_heads)
        .with_dtype(p.dtype)
        .with_layout(p.layout)
        .with_scale(p.scale())
        .with_lse(true);
    if let Some(c) = p.softcap {
        bp = bp.with_softcap(c);
    }
    if b.causal {
        bp = bp.with_mask(Mask::CausalBottomRight);
    }
    bp
}

/// One rank's shard as a problem of its own: the local sequence against itself.
pub(crate) fn local_problem(p: &Problem, z: &Zigzag) -> Problem {
    let n = z.local_len();
    let mut lp = *p;
    lp.seq_q = n;
    lp.seq_k = n;
    lp
}

/// Whether a ring of `world` ranks can run `p`, and how its sequence splits.
pub fn check_problem(p: &Problem, world: usize) -> Result<Zigzag> {
    p.validate()?;
    let refuse = |reason: String| Error::Unsupported {
        backend: "ring",
        reason,
    };
    if !matches!(p.dtype, DType::F16 | DType::Bf16) || p.output_dtype() != p.dtype {
        return Err(refuse(format!(
            "ring attention runs f16 and bf16 (inputs and output alike), not {} -> {}",
            p.dtype,
            p.output_dtype()
        )));
    }
    if p.seq_q != p.seq_k {
        return Err(refuse(format!(
            "ring attention shards one sequence: seq_q {} must equal seq_k {}",
            p.seq_q, p.seq_k
        )));
    }
    if !matches!(
        p.mask.canonical(),
        Mask::None | Mask::CausalBottomRight | Mask::CausalTopLeft
    ) {
        return Err(refuse(format!(
            "ring attention takes no mask or the causal one, not {}",
            p.mask.name()
        )));
    }
    if p.alibi.is_some() {
        return Err(refuse(
            "ALiBi over a sharded sequence is not supported".into(),
        ));
    }
    // A sink must join each row's softmax once, not once per rank's block.
    if p.sinks {
        return Err(refuse(
            "sinks over a sharded sequence are not supported".into(),
        ));
    }
    // The merge of the ranks' blocks keeps one head dim for the partial outputs and K/V.
    if p.v_dim() != p.head_dim {
        return Err(refuse(format!(
            "ring attention takes one head dim, not head_dim {} with head_dim_v {}",
            p.head_dim,
            p.v_dim()
        )));
    }
    if p.v_in_k {
        return Err(refuse(
            "ring attention exchanges K and V as tensors of their own, not V read from K's rows"
                .into(),
        ));
    }
    if !p.seqs.is_dense() {
        return Err(refuse(
            "packed or paged sequences are not sharded; ring attention takes dense ones".into(),
        ));
    }
    Zigzag::new(p.seq_q, world)
}

/// That rank `rank`'s shard, on `dev`, holds what the local problem needs (and the
/// log-sum-exp where `lse` asks for it).
pub(crate) fn check_shard<T>(
    rank: usize,
    dev: &Device,
    s: &Shard<'_, T>,
    local: &Problem,
    lse: bool,
) -> Result<()> {
    let (ql, kl) = (
        local.q_len().expect("validated"),
        local.k_len().expect("validated"),
    );
    for (name, len, need, stream) in [
        ("q", s.q.len(), ql, s.q.stream()),
        ("k", s.k.len(), kl, s.k.stream()),
        ("v", s.v.len(), kl, s.v.stream()),
        ("out", s.out.len(), ql, s.out.stream()),
    ] {
        if len < need {
            return Err(invalid!(
                "rank {rank}'s {name} shard holds {len} elements, its {} positions need {need}",
                local.seq_q
            ));
        }
        if stream.context() != dev.ctx() {
            return Err(invalid!(
                "rank {rank}'s {name} shard lives on another GPU than the rank"
            ));
        }
    }
    let es = std::mem::size_of::<T>();
    let (q_rows, kv_rows) = (
        row_strides(local.q_shape(), local.q_strides()),
        row_strides(local.k_shape(), local.k_strides()),
    );
    for (name, ptr, rows, need) in [
        (
            "q",
            s.q.device_ptr(s.q.stream()).0,
            &q_rows,
            ATTENTION_ALIGN,
        ),
        (
            "k",
            s.k.device_ptr(s.k.stream()).0,
            &kv_rows,
            ATTENTION_ALIGN,
        ),
        (
            "v",
            s.v.device_ptr(s.v.stream()).0,
            &kv_rows,
            ATTENTION_ALIGN,
        ),
        (
            "out",
            s.out.device_ptr(s.out.stream()).0,
            &q_rows,
            MERGE_ALIGN,
        ),
    ] {
        if let Some(why) = misaligned(ptr, es, rows, need.bytes) {
            return Err(invalid!("rank {rank}'s {name} {why}: {}", need.reason));
        }
    }
    if let Some(l) = &s.lse
        && let Some(why) = misaligned(l.device_ptr(l.stream()).0, 4, &[], LSE_ALIGN.bytes)
    {
        return Err(invalid!("rank {rank}'s lse {why}: {}", LSE_ALIGN.reason));
    }
    match (&s.lse, lse) {
        (Some(l), true) => {
            if l.len() < local.lse_len() {
                return Err(invalid!(
                    "rank {rank}'s lse holds {} values, batch x heads x local positions = {}",
                    l.len(),
                    local.lse_len()
                ));
            }
            if l.stream().context() != dev.ctx() {
                return Err(invalid!(
                    "rank {rank}'s lse lives on another GPU than the rank"
                ));
            }
        }
        (None, false) => {}
        (None, true) => {
            return Err(invalid!(
                "the problem asks for the LSE; give each shard one"
            ));
        }
        (Some(_), false) => {
            return Err(invalid!(
                "lse given for a problem that does not ask for it (Problem::with_lse)"
            ));
        }
    }
    Ok(())
}

/// An alignment the kernels of a ring call need of an operand, in bytes, and why.
pub(crate) struct Align {
    pub(crate) bytes: usize,
    pub(crate) reason: &'static str,
}

/// Q, K and V: what every single-GPU call checks of its operands (`footprint::span`).
pub(crate) const ATTENTION_ALIGN: Align = Align {
    bytes: 16,
    reason: "the attention kernels read rows 16 bytes at a time",
};
/// The output: `merge_finish` (sdpa-sys/cpp/src/merge/merge.cu) stores it a pair of 16-bit elements
/// (32 bits) at a time.
pub(crate) const MERGE_ALIGN: Align = Align {
    bytes: 4,
    reason: "the merge writes the output two elements (4 bytes) at a time",
};
/// The log-sum-exp: f32, copied from the running result.
pub(crate) const LSE_ALIGN: Align = Align {
    bytes: 4,
    reason: "it holds f32 values",
};

/// The strides, in elements, between the rows of a tensor of `shape` at `strides` that the
/// kernels step over: those of dimensions with more than one row.
fn row_strides(shape: TensorShape, strides: Strides) -> Vec<usize> {
    [
        (shape.batch, strides.batch),
        (shape.heads, strides.head),
        (shape.seq, strides.seq),
    ]
    .into_iter()
    .filter(|&(n, _)| n > 1)
    .map(|(_, st)| st)
    .collect()
}

/// Why an operand at device address `ptr`, of `elem`-byte elements whose rows lie `rows`
/// elements apart, does not keep every row `align`-byte aligned, if it does not.
pub(crate) fn misaligned(ptr: u64, elem: usize, rows: &[usize], align: usize) -> Option<String> {
    if !ptr.is_multiple_of(align as u64) {
        return Some(format!("starts at {ptr:#x}, not {align}-byte aligned"));
    }
    rows.iter()
        .find(|&&st| {
            !st.checked_mul(elem)
                .is_some_and(|b| b.is_multiple_of(align))
        })
        .map(|st| {
            format!("has rows {st} elements of {elem} bytes apart, not a multiple of {align} bytes")
        })
}

/// What every rank must call with: a hash of the problem and the ring's size.
pub(crate) fn fingerprint(p: &Problem, world: usize) -> u64 {
    let key = format!(
        "{} {} {} {} {} {} {:?} {:08x} {:?} {} {:?} {}",
        p.batch,
        p.heads,
        p.kv_heads,
        p.seq_q,
        p.seq_k,
        p.head_dim,
        p.mask.canonical(),
        p.scale().to_bits(),
        p.softcap.map(f32::to_bits),
        p.dtype,
        p.layout,
        world
    );
    fnv1a(key.as_bytes())
}

/// FNV-1a, 64-bit: a hash every rank computes alike.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_a_ring_cannot_run_are_refused_with_the_reason() {
        let p = Problem::new(1, 4, 64, 64, 64).with_dtype(DType::Bf16);
        assert_eq!(check_problem(&p, 4).unwrap().chunk(), 8);
        assert_eq!(
            check_problem(&p.with_causal(true), 2).unwrap().local_len(),
            32
        );
        let why = |p: Problem, w: usize| check_problem(&p, w).unwrap_err().to_string();
        assert!(why(Problem::new(1, 4, 32, 64, 64), 2).contains("seq_q 32 must equal seq_k 64"));
        assert!(why(p, 3).contains("multiple of 2 x ranks = 6"));
        assert!(
            why(
                p.with_mask(Mask::Window {
                    left: Some(8),
                    right: Some(0)
                }),
                2
            )
            .contains("no mask or the causal one")
        );
        assert!(why(p.with_alibi(crate::Alibi::PerHead), 2).contains("ALiBi"));
        assert!(why(p.with_sinks(true), 2).contains("sinks"));
        assert!(why(p.with_dtype(DType::E4m3), 2).contains("f16 and bf16"));
        assert!(check_problem(&p.with_out_dtype(DType::F16), 2).is_err());
        assert!(why(p.with_packed_q(64), 2).contains("dense"));
        // The problem's own checks come first.
        assert!(why(Problem::new(1, 3, 64, 64, 64).with_kv_heads(2), 2).contains("kv_heads"));
    }

    #[test]
    fn blocks_become_single_gpu_problems_with_the_ring_problems_parameters() {
        let p = Problem::new(2, 8, 64, 64, 128)
            .with_kv_heads(2)
            .with_causal(true)
            .with_softcap(30.0)
            .with_dtype(DType::Bf16);
        let b = Block {
            q: 8..16,
            k: 0..16,
            causal: false,
        };
        let bp = block_problem(&p, &b);
        assert_eq!(
            (bp.seq_q, bp.seq_k, bp.kv_heads, bp.mask),
            (8, 16, 2, Mask::None)
        );
        assert_eq!(
            (bp.scale(), bp.softcap, bp.lse),
            (p.scale(), Some(30.0), true)
        );
        let diag = block_problem(
            &p,
            &Block {
                q: 0..16,
                k: 0..16,
                causal: true,
            },
        );
        assert!(diag.is_causal());
        let lp = local_problem(&p, &Zigzag::new(64, 2).unwrap());
        assert_eq!(
            (lp.seq_q, lp.seq_k, lp.q_len()),
            (32, 32, Some(2 * 8 * 32 * 128))
        );
    }

    /// A view one element past an aligned buffer (what faulted in the merge, a misaligned
    /// store, from the safe API) is refused by operand, and so are rows that fall out of step.
    #[test]
    fn misaligned_operands_are_named() {
        let base = 0x7f00_0000_0000u64;
        assert_eq!(misaligned(base, 2, &[128, 64 * 128], 16), None);
        let e = misaligned(base + 2, 2, &[128], MERGE_ALIGN.bytes).unwrap();
        assert!(
            e.contains("starts at 0x7f0000000002, not 4-byte aligned"),
            "{e}"
        );
        assert!(misaligned(base + 4, 2, &[128], MERGE_ALIGN.bytes).is_none());
        assert!(misaligned(base + 4, 2, &[128], ATTENTION_ALIGN.bytes).is_some());
        let e = misaligned(base, 2, &[36], 16).unwrap();
        assert!(e.contains("rows 36 elements of 2 bytes apart"), "{e}");
        assert!(misaligned(base, 2, &[usize::MAX], 16).is_some());
        assert!(misaligned(base + 1, 4, &[], LSE_ALIGN.bytes).is_some());
        // The dense local shapes of a ring: the rows the kernels step over.
        let p = Problem::new(2, 4, 64, 64, 64).with_kv_heads(2);
        let lp = local_problem(&p, &Zigzag::new(64, 2).unwrap());
        assert_eq!(
            row_strides(lp.q_shape(), lp.q_strides()),
            [4 * 32 * 64, 32 * 64, 64]
        );
        let one = Problem::new(1, 1, 4, 4, 64);
        let lo = local_problem(&one, &Zigzag::new(4, 2).unwrap());
        assert_eq!(row_strides(lo.k_shape(), lo.k_strides()), [64]);
    }

    #[test]
    fn fingerprints_tell_problems_apart() {
        let p = Problem::new(1, 4, 64, 64, 64);
        let f = fingerprint(&p, 2);
        assert_eq!(f, fingerprint(&p.with_mask(Mask::None), 2));
        assert_ne!(f, fingerprint(&p, 4));
        assert_ne!(f, fingerprint(&p.with_causal(true), 2));
        assert_ne!(f, fingerprint(&p.with_scale(0.5), 2));
        assert_ne!(f, fingerprint(&p.with_kv_heads(2), 2));
        assert_ne!(f, fingerprint(&p.with_dtype(DType::Bf16), 2));
    }
}
