//! Sequence metadata for tests and the CLI: the packed (varlen) and paged-cache batches of a
//! problem, from chosen lengths or drawn at random, as FlashAttention's callers build them.

use rand::{RngExt, SeedableRng, rngs::StdRng};
use sdpa::{Error, KvRows, Problem, Result, SeqMeta};

/// Offsets `[0, l0, l0 + l1, ...]` of consecutive sequences of these lengths.
pub fn cu_seqlens(lengths: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(lengths.iter().scan(0i32, |sum, &l| {
            *sum += l as i32;
            Some(*sum)
        }))
        .collect()
}

/// `p` with packed Q and K/V of these per-sequence lengths (`p.batch` becomes their count,
/// `seq_q`/`seq_k` their maxima, at least 1), and the metadata.
pub fn varlen(p: Problem, q_lens: &[usize], k_lens: &[usize]) -> (Problem, SeqMeta) {
    assert_eq!(
        q_lens.len(),
        k_lens.len(),
        "one query and one key length a sequence"
    );
    let max = |l: &[usize]| l.iter().copied().max().unwrap_or(0).max(1);
    let total = |l: &[usize]| l.iter().sum::<usize>().max(1);
    let p = Problem {
        batch: q_lens.len(),
        seq_q: max(q_lens),
        seq_k: max(k_lens),
        ..p
    }
    .with_packed_q(total(q_lens))
    .with_packed_kv(total(k_lens));
    let meta = SeqMeta {
        cu_seqlens_q: Some(cu_seqlens(q_lens)),
        cu_seqlens_k: Some(cu_seqlens(k_lens)),
        ..SeqMeta::default()
    };
    (p, meta)
}

/// `p` (dense queries, `seq_q` each) against a paged cache of `page_size`-key pages holding
/// `k_lens[b]` keys of sequence b, its pages scattered over the cache in an order drawn from
/// `seed`; block-table entries past a sequence's keys are -1 (never read).
pub fn paged(p: Problem, k_lens: &[usize], page_size: usize, seed: u64) -> (Problem, SeqMeta) {
    let batch = k_lens.len();
    let seq_k = k_lens.iter().copied().max().unwrap_or(0).max(1);
    let pages_per_seq = seq_k.div_ceil(page_size);
    let used: usize = k_lens.iter().map(|l| l.div_ceil(page_size)).sum();
    // A few pages more than the sequences use, so that some are never referenced.
    let pages = used + 3;
    let mut rng = StdRng::seed_from_u64(seed);
    let table = scatter_pages(&mut rng, pages, page_size, pages_per_seq, k_lens);
    let p = Problem { batch, seq_k, ..p }.with_paged_kv(pages, page_size, pages_per_seq);
    let meta = SeqMeta {
        seqused_k: Some(k_lens.iter().map(|&l| l as i32).collect()),
        block_table: Some(table),
        ..SeqMeta::default()
    };
    (p, meta)
}

/// Metadata for `p` drawn from `seed`: sequence lengths up to `seq_q` / `seq_k` that fill the
/// packed tensors exactly, `seqused_k` up to each sequence's keys (and within the pages a paged
/// cache has left), a paged cache's pages in a random order. Dense problems: none.
pub fn random_meta(p: &Problem, seed: u64) -> Result<SeqMeta> {
    let mut rng = StdRng::seed_from_u64(seed);
    let s = &p.seqs;
    let mut meta = SeqMeta::default();
    let mut k_lens = vec![p.seq_k; p.batch];
    if let Some(total) = s.packed_q {
        meta.cu_seqlens_q = Some(cu_seqlens(&split(&mut rng, total, p.batch, p.seq_q)?));
    }
    if let KvRows::Packed { total } = s.kv {
        k_lens = split(&mut rng, total, p.batch, p.seq_k)?;
        meta.cu_seqlens_k = Some(cu_seqlens(&k_lens));
    }
    if s.seqused_k {
        // A paged cache's sequences share its pages: each draws from what the others left.
        let mut keys_left = match s.kv {
            KvRows::Paged {
                pages, page_size, ..
            } => pages * page_size,
            _ => usize::MAX,
        };
        let page = match s.kv {
            KvRows::Paged { page_size, .. } => page_size,
            _ => 1,
        };
        for l in k_lens.iter_mut() {
            *l = rng.random_range(0..=(*l).min(keys_left));
            keys_left -= l.div_ceil(page) * page;
        }
        meta.seqused_k = Some(k_lens.iter().map(|&u| u as i32).collect());
    }
    if let KvRows::Paged {
        pages,
        page_size,
        pages_per_seq,
    } = s.kv
    {
        let table = scatter_pages(&mut rng, pages, page_size, pages_per_seq, &k_lens);
        meta.block_table = Some(table);
    }
    Ok(meta)
}

/// A block table `[k_lens.len(), pages_per_seq]` giving each sequence the pages its keys need,
/// distinct, in a random order over the cache's `pages`; -1 past a sequence's keys (never read).
/// The caller has checked that the pages suffice.
fn scatter_pages(
    rng: &mut StdRng,
    pages: usize,
    page_size: usize,
    pages_per_seq: usize,
    k_lens: &[usize],
) -> Vec<i32> {
    let mut order: Vec<i32> = (0..pages as i32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let mut next = order.into_iter();
    let mut table = vec![-1i32; k_lens.len() * pages_per_seq];
    for (b, &l) in k_lens.iter().enumerate() {
        for slot in &mut table[b * pages_per_seq..][..l.div_ceil(page_size)] {
            *slot = next.next().unwrap_or(-1);
        }
    }
    table
}

/// `total` split into `n` random lengths of at most `max` each.
fn split(rng: &mut StdRng, total: usize, n: usize, max: usize) -> Result<Vec<usize>> {
    if total > n * max {
        return Err(Error::InvalidArgument(format!(
            "random metadata: {total} rows do not fit {n} sequences of at most {max}"
        )));
    }
    let mut lens = vec![total / n; n];
    for l in lens.iter_mut().take(total % n) {
        *l += 1;
    }
    // Random moves between pairs keep the sum and the bounds.
    for _ in 0..4 * n {
        let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
        let room = (max - lens[b]).min(lens[a]);
        if a != b && room > 0 {
            let m = rng.random_range(0..=room);
            lens[a] -= m;
            lens[b] += m;
        }
    }
    Ok(lens)
}
