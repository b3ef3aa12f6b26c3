//! Batches of sequences of different lengths, as FlashAttention lays them out: Q packed
//! without padding (`flash_attn_varlen_func`'s `cu_seqlens_q`), K/V packed the same way or held in
//! a paged cache (`page_table`), and `seqused_k` for the keys each sequence uses.
//!
//! The shape lives in the [`Problem`](crate::Problem) (its `seqs`, with `seq_q` and `seq_k` the
//! longest sequence's lengths); the metadata is i32 on the device, passed with the call
//! ([`crate::Extras`]). What the host can check without reading the device (lengths of the
//! metadata buffers, sizes, page geometry) is checked on every call; what only the metadata's
//! values say (offsets increasing and inside the tensors, pages in range, `seqused_k` within its
//! sequence) is checked where the caller asks for it (`Seqs::checked`), at the cost of a copy
//! to the host and a synchronization; [`check_metadata`] does it on host copies.
//!
//! Unchecked values cannot fault the device: the kernels clamp each offset into the packed
//! rows, each length to the problem's maximum and its tensor, `seqused_k` to the sequence's
//! keys and each block-table entry to the cache's pages. Bad metadata thus gives wrong output
//! for the sequences it describes (and reads or writes only the call's own buffers), which
//! checked mode turns into a typed error.

use crate::error::{Result, invalid};
use std::fmt;

/// Where K and V rows live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvRows {
    /// `[batch, kv_heads, seq_k, D]` or `[batch, seq_k, kv_heads, D]` (the problem's layout).
    #[default]
    Dense,
    /// Packed: `[total, kv_heads, D]`; sequence b's keys are rows `cu_seqlens_k[b]..
    /// cu_seqlens_k[b + 1]`.
    Packed {
        /// Rows of K and V.
        total: usize,
    },
    /// A paged cache: `[pages, page_size, kv_heads, D]` (or `[pages, kv_heads, page_size, D]`:
    /// [`Seqs::page_layout`]); key j of sequence b is row `j % page_size` of page
    /// `block_table[b][j / page_size]`, and sequence b has `seqused_k[b]` keys.
    Paged {
        /// Pages of the cache.
        pages: usize,
        /// Keys a page holds: a power of two from 16 to 256.
        page_size: usize,
        /// Columns of the block table, `[batch, pages_per_seq]`.
        pages_per_seq: usize,
    },
}

/// How a problem's sequences are stored; the default is dense (every sequence `seq_q` queries
/// and `seq_k` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Seqs {
    /// `Some(total)`: Q and the output packed, `[total, heads, D]`, sequence b's queries rows
    /// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]`; `None`: dense, `seq_q` each.
    pub packed_q: Option<usize>,
    /// Where K and V live.
    pub kv: KvRows,
    /// Whether `seqused_k[b]` caps sequence b's keys (required for a paged cache).
    pub seqused_k: bool,
    /// Whether each call first copies the metadata to the host and checks its values
    /// ([`check_metadata`]): a host synchronization per call, for debugging.
    pub checked: bool,
    /// How a paged cache orders each page's elements (ignored for other K/V rows).
    pub page_layout: PageLayout,
}

/// How a paged cache orders the elements of each page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PageLayout {
    /// `[page_size, kv_heads, D]`: a page's rows one after another, each with every head
    /// (FlashAttention's and vLLM's paged caches).
    #[default]
    Nhd,
    /// `[kv_heads, page_size, D]`: each head's rows of the page together (FlashInfer's HND).
    Hnd,
}

impl PageLayout {
    /// Rows of the kernels' row space from one page's first row to the next's: a page's rows
    /// (NHD), or every head's rows of a page (HND, read at a row stride of head_dim and a head
    /// stride of `page_size · head_dim`).
    /// Element strides of (page, row of a page, head) in a cache of this layout whose pages
    /// follow each other: `[page_size · kv_heads · head_dim, ..]`.
    pub fn strides(self, page_size: usize, kv_heads: usize, head_dim: usize) -> [usize; 3] {
        let (p, h, d) = (page_size, kv_heads, head_dim);
        match self {
            PageLayout::Nhd => [p * h * d, h * d, d],
            PageLayout::Hnd => [p * h * d, d, p * d],
        }
    }
    pub(crate) fn page_rows(self, page_size: usize, kv_heads: usize) -> usize {
        match self {
            PageLayout::Nhd => page_size,
            PageLayout::Hnd => page_size.saturating_mul(kv_heads),
        }
    }
}

/// Page sizes a paged cache may have.
pub const PAGE_SIZES: std::ops::RangeInclusive<usize> = 16..=256;

impl Seqs {
    /// Dense: no metadata.
    pub fn is_dense(&self) -> bool {
        self.packed_q.is_none() && self.kv == KvRows::Dense && !self.seqused_k
    }
    /// Whether the call takes `cu_seqlens_q`.
    pub fn takes_cu_seqlens_q(&self) -> bool {
        self.packed_q.is_some()
    }
    /// Whether the call takes `cu_seqlens_k`.
    pub fn takes_cu_seqlens_k(&self) -> bool {
        matches!(self.kv, KvRows::Packed { .. })
    }
    /// Whether the call takes a block table (`[batch, pages_per_seq]`).
    pub fn takes_block_table(&self) -> bool {
        matches!(self.kv, KvRows::Paged { .. })
    }
    /// Asks each call to check the metadata's values on the host first.
    pub fn with_checked(self, checked: bool) -> Seqs {
        Seqs { checked, ..self }
    }

    /// The shape checks that need no metadata values, for sequences of at most `seq_k` keys.
    pub(crate) fn validate(&self, seq_k: usize) -> Result<()> {
        if self.packed_q == Some(0) {
            return Err(invalid!("packed Q needs total_q of at least 1, got 0"));
        }
        match self.kv {
            KvRows::Dense => {}
            KvRows::Packed { total } => {
                if total == 0 {
                    return Err(invalid!("packed K/V needs total_k of at least 1, got 0"));
                }
            }
            KvRows::Paged {
                pages,
                page_size,
                pages_per_seq,
            } => {
                if !page_size.is_power_of_two() || !PAGE_SIZES.contains(&page_size) {
                    return Err(invalid!(
                        "page_size must be a power of two from 16 to 256, got {page_size}"
                    ));
                }
                if pages == 0 || pages_per_seq == 0 {
                    return Err(invalid!(
                        "a paged cache needs pages and pages_per_seq of at least 1, got \
                         {pages} and {pages_per_seq}"
                    ));
                }
                if pages_per_seq
                    .checked_mul(page_size)
                    .is_none_or(|n| n < seq_k)
                {
                    return Err(invalid!(
                        "seq_k {seq_k} (the longest sequence's keys) does not fit \
                         {pages_per_seq} pages of {page_size} keys"
                    ));
                }
                if !self.seqused_k {
                    return Err(invalid!(
                        "a paged cache needs seqused_k (each sequence's keys in the cache)"
                    ));
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for Seqs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(t) = self.packed_q {
            write!(f, " varlen-q {t}")?;
        }
        match self.kv {
            KvRows::Dense => {}
            KvRows::Packed { total } => write!(f, " varlen-k {total}")?,
            KvRows::Paged {
                pages, page_size, ..
            } => write!(f, " paged {pages}x{page_size}")?,
        }
        if self.takes_block_table() && self.page_layout == PageLayout::Hnd {
            f.write_str(" hnd")?;
        }
        if self.seqused_k {
            f.write_str(" seqused-k")?;
        }
        Ok(())
    }
}

/// Host copies of a call's sequence metadata (each `None` where the problem takes none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqMeta {
    /// `[batch + 1]` offsets of each sequence's queries in packed Q.
    pub cu_seqlens_q: Option<Vec<i32>>,
    /// `[batch + 1]` offsets of each sequence's keys in packed K/V.
    pub cu_seqlens_k: Option<Vec<i32>>,
    /// `[batch]` keys each sequence uses.
    pub seqused_k: Option<Vec<i32>>,
    /// `[batch, pages_per_seq]` pages of each sequence's keys.
    pub block_table: Option<Vec<i32>>,
}

/// One sequence's place in the call's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// Its queries: rows `q_start..q_start + seq_q` of Q's sequence dimension (packed), or of
    /// its batch entry (dense, `q_start` 0).
    pub q_start: usize,
    /// Its query count.
    pub seq_q: usize,
    /// Its first key's row in packed K/V (0 dense or paged).
    pub k_start: usize,
    /// Its key count.
    pub seq_k: usize,
}

/// Checks metadata values against the problem's shape: offsets start at 0, never decrease and
/// end inside the packed tensors, no sequence is longer than `seq_q` / `seq_k`, `seqused_k`
/// within each sequence's keys, block-table entries of used pages within the cache. Returns each
/// sequence's span.
/// The problem is validated first ([`Problem::validate`](crate::Problem::validate)), so its
/// sizes are known not to overflow.
pub fn check_metadata(p: &crate::Problem, m: &SeqMeta) -> Result<Vec<SeqSpan>> {
    p.validate()?;
    let s = &p.seqs;
    let batch = p.batch;
    let given = |name: &str, v: &Option<Vec<i32>>, want: bool, len: usize| -> Result<()> {
        match (v, want) {
            (None, false) => Ok(()),
            (Some(v), true) if v.len() >= len => Ok(()),
            (Some(v), true) => Err(invalid!("{name} holds {} values, {p} needs {len}", v.len())),
            (None, true) => Err(invalid!("{p} needs {name}")),
            (Some(_), false) => Err(invalid!("{name} given for {p}, which does not take it")),
        }
    };
    given(
        "cu_seqlens_q",
        &m.cu_seqlens_q,
        s.takes_cu_seqlens_q(),
        batch + 1,
    )?;
    given(
        "cu_seqlens_k",
        &m.cu_seqlens_k,
        s.takes_cu_seqlens_k(),
        batch + 1,
    )?;
    given("seqused_k", &m.seqused_k, s.seqused_k, batch)?;
    let pages_per_seq = match s.kv {
        KvRows::Paged { pages_per_seq, .. } => pages_per_seq,
        _ => 0,
    };
    given(
        "block_table",
        &m.block_table,
        s.takes_block_table(),
        p.block_table_len(),
    )?;
    let lengths = |name: &str, cu: &[i32], total: usize, max: usize| -> Result<Vec<usize>> {
        if cu[0] != 0 {
            return Err(invalid!("{name}[0] must be 0, got {}", cu[0]));
        }
        (0..batch)
            .map(|b| {
                let (lo, hi) = (cu[b], cu[b + 1]);
                if hi < lo {
                    return Err(invalid!("{name} decreases at sequence {b}: {lo} then {hi}"));
                }
                if hi as usize > total {
                    return Err(invalid!(
                        "{name}[{}] = {hi} is past the {total} packed rows",
                        b + 1
                    ));
                }
                let n = (hi - lo) as usize;
                if n > max {
                    return Err(invalid!(
                        "sequence {b} has {n} rows in {name}, more than the problem's maximum \
                         {max}"
                    ));
                }
                Ok(n)
            })
            .collect()
    };
    let q_lens = match (s.packed_q, &m.cu_seqlens_q) {
        (Some(total), Some(cu)) => lengths("cu_seqlens_q", cu, total, p.seq_q)?,
        _ => vec![p.seq_q; batch],
    };
    let mut k_lens = match (s.kv, &m.cu_seqlens_k) {
        (KvRows::Packed { total }, Some(cu)) => lengths("cu_seqlens_k", cu, total, p.seq_k)?,
        (KvRows::Paged { .. }, _) => vec![p.seq_k; batch],
        _ => vec![p.seq_k; batch],
    };
    if let Some(used) = &m.seqused_k {
        for (b, (&u, cap)) in used.iter().zip(k_lens.iter_mut()).enumerate() {
            if u < 0 || u as usize > *cap {
                return Err(invalid!(
                    "seqused_k[{b}] = {u} is outside 0..={cap} (the sequence's keys)"
                ));
            }
            *cap = u as usize;
        }
    }
    if let (
        KvRows::Paged {
            pages, page_size, ..
        },
        Some(table),
    ) = (s.kv, &m.block_table)
    {
        for (b, &n) in k_lens.iter().enumerate() {
            let row = &table[b * pages_per_seq..][..pages_per_seq];
            if let Some((i, &page)) = row[..n.div_ceil(page_size)]
                .iter()
                .enumerate()
                .find(|&(_, &pg)| pg < 0 || pg as usize >= pages)
            {
                return Err(invalid!(
                    "block_table[{b}][{i}] = {page} is not a page of the {pages}-page cache"
                ));
            }
        }
    }
    let start = |cu: &Option<Vec<i32>>, b: usize| cu.as_ref().map_or(0, |c| c[b] as usize);
    Ok((0..batch)
        .map(|b| SeqSpan {
            q_start: start(&m.cu_seqlens_q, b),
            seq_q: q_lens[b],
            k_start: start(&m.cu_seqlens_k, b),
            seq_k: k_lens[b],
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Problem;

    fn varlen(q: &[i32], k: &[i32]) -> (Problem, SeqMeta) {
        let p = Problem::new(q.len() - 1, 2, 8, 8, 64)
            .with_packed_q(*q.last().unwrap() as usize)
            .with_packed_kv(*k.last().unwrap() as usize);
        let m = SeqMeta {
            cu_seqlens_q: Some(q.to_vec()),
            cu_seqlens_k: Some(k.to_vec()),
            ..SeqMeta::default()
        };
        (p, m)
    }

    #[test]
    fn spans_follow_the_offsets() {
        let (p, m) = varlen(&[0, 3, 3, 11], &[0, 5, 6, 6]);
        let spans = check_metadata(&p, &m).unwrap();
        let got: Vec<_> = spans
            .iter()
            .map(|s| (s.q_start, s.seq_q, s.k_start, s.seq_k))
            .collect();
        assert_eq!(got, [(0, 3, 0, 5), (3, 0, 5, 1), (3, 8, 6, 0)]);
    }

    #[test]
    fn bad_metadata_is_named() {
        let cases: [(&[i32], &[i32], &str); 4] = [
            (&[1, 3, 3, 11], &[0, 5, 6, 6], "cu_seqlens_q[0] must be 0"),
            (
                &[0, 3, 2, 11],
                &[0, 5, 6, 6],
                "cu_seqlens_q decreases at sequence 1",
            ),
            (
                &[0, 3, 3, 12],
                &[0, 5, 6, 6],
                "more than the problem's maximum 8",
            ),
            (
                &[0, 3, 3, 11],
                &[0, 5, 4, 6],
                "cu_seqlens_k decreases at sequence 1",
            ),
        ];
        for (q, k, want) in cases {
            let (mut p, m) = varlen(&[0, 3, 3, 11], &[0, 5, 6, 6]);
            p.seqs.packed_q = Some(12);
            let m = SeqMeta {
                cu_seqlens_q: Some(q.to_vec()),
                cu_seqlens_k: Some(k.to_vec()),
                ..m
            };
            let e = check_metadata(&p, &m).unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        let (p, mut m) = varlen(&[0, 3, 3, 11], &[0, 5, 6, 6]);
        m.cu_seqlens_k = Some(vec![0, 5, 6]);
        let e = check_metadata(&p, &m).unwrap_err().to_string();
        assert!(e.contains("cu_seqlens_k holds 3 values"), "{e}");
        m.cu_seqlens_k = None;
        let e = check_metadata(&p, &m).unwrap_err().to_string();
        assert!(e.contains("needs cu_seqlens_k"), "{e}");
    }

    #[test]
    fn paged_caches_check_their_pages() {
        let p = Problem::new(2, 2, 1, 40, 64).with_paged_kv(4, 16, 3);
        let ok = SeqMeta {
            seqused_k: Some(vec![40, 10]),
            block_table: Some(vec![2, 0, 3, 1, -1, -1]),
            ..SeqMeta::default()
        };
        let spans = check_metadata(&p, &ok).unwrap();
        assert_eq!((spans[0].seq_k, spans[1].seq_k), (40, 10));
        let past = SeqMeta {
            seqused_k: Some(vec![40, 20]),
            ..ok.clone()
        };
        let e = check_metadata(&p, &past).unwrap_err().to_string();
        assert!(e.contains("block_table[1][1] = -1"), "{e}");
        let over = SeqMeta {
            seqused_k: Some(vec![41, 10]),
            ..ok.clone()
        };
        let e = check_metadata(&p, &over).unwrap_err().to_string();
        assert!(e.contains("seqused_k[0] = 41 is outside 0..=40"), "{e}");
        let out = SeqMeta {
            block_table: Some(vec![2, 4, 3, 1, -1, -1]),
            ..ok
        };
        let e = check_metadata(&p, &out).unwrap_err().to_string();
        assert!(e.contains("block_table[0][1] = 4 is not a page"), "{e}");
    }

    /// Problems that never passed `validate` are refused with its error, not a panic: a page
    /// size of 0 (a division), a batch near `usize::MAX` (`batch + 1` offsets), a block table
    /// whose `batch x pages_per_seq` overflows, and `seqused_k` past a cache too small for the
    /// problem's `seq_k` (a slice of the table's row past its end).
    #[test]
    fn unvalidated_problems_are_refused_not_panicked_on() {
        let paged = |batch: usize, page_size: usize, pages_per_seq: usize, seq_k: usize| {
            let mut p = Problem::new(1, 2, 1, seq_k, 64).with_paged_kv(4, 16, 1);
            p.batch = batch;
            p.seqs.kv = KvRows::Paged {
                pages: 4,
                page_size,
                pages_per_seq,
            };
            p
        };
        let meta = |batch: usize, used: i32| SeqMeta {
            seqused_k: Some(vec![used; batch.min(4)]),
            block_table: Some(vec![0; 8]),
            ..SeqMeta::default()
        };
        for (p, m, want) in [
            (
                paged(2, 0, 1, 16),
                meta(2, 16),
                "page_size must be a power of two",
            ),
            (paged(usize::MAX, 16, 1, 16), meta(4, 1), "more than 2^40"),
            (
                paged(1 << 20, 16, 1 << 50, 16),
                meta(4, 1),
                "more than 2^40 entries",
            ),
            (
                paged(2, 16, 1, 64),
                meta(2, 64),
                "does not fit 1 pages of 16",
            ),
        ] {
            let e = check_metadata(&p, &m).unwrap_err();
            assert!(
                matches!(e, crate::Error::InvalidArgument(_)) && e.to_string().contains(want),
                "{p:?}: {e} (wanted {want})"
            );
        }
        let mut p = Problem::new(1, 2, 8, 8, 64)
            .with_packed_q(8)
            .with_packed_kv(8);
        p.batch = usize::MAX;
        let m = SeqMeta {
            cu_seqlens_q: Some(vec![0, 8]),
            cu_seqlens_k: Some(vec![0, 8]),
            ..SeqMeta::default()
        };
        let e = check_metadata(&p, &m).unwrap_err().to_string();
        assert!(e.contains("more than 2^40 sequences"), "{e}");
    }

    #[test]
    fn shapes_are_checked_without_metadata() {
        let base = Problem::new(2, 2, 1, 64, 64);
        for (p, want) in [
            (base.with_paged_kv(4, 24, 3), "power of two from 16 to 256"),
            (base.with_paged_kv(4, 512, 1), "power of two from 16 to 256"),
            (
                base.with_paged_kv(4, 16, 3),
                "does not fit 3 pages of 16 keys",
            ),
            (
                base.with_paged_kv(4, 16, 4).with_seqused_k(false),
                "needs seqused_k",
            ),
            (base.with_packed_q(0), "total_q of at least 1"),
            (
                base.with_packed_kv(8).with_dtype(crate::DType::E4m3),
                "e4m3 inputs take dense sequences only",
            ),
        ] {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{p}: {e} (wanted {want})");
        }
        let p = base.with_packed_q(10).with_packed_kv(100);
        assert_eq!(p.q_len(), Some(10 * 2 * 64));
        assert_eq!(p.k_len(), Some(100 * 2 * 64));
        assert_eq!(p.lse_len(), 2 * 10);
        let s = p.q_strides();
        assert_eq!((s.head, s.seq), (64, 128));
        let p = base.with_paged_kv(5, 16, 4);
        assert_eq!(p.v_len(), Some(5 * 16 * 2 * 64));
    }
}
