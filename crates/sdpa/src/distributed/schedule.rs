//! What each rank computes at each step of the ring: which of its query rows attend to which
//! keys of the K/V shard it holds, and under which mask.
//!
//! At step `t` rank `r` holds the K/V shard of rank `(r − t) mod world`. Without a mask every
//! local query sees every held key. With the causal mask over the global sequence, a query
//! chunk `a` sees key chunk `b` wholly when `b < a`, on the diagonal when `a == b`, and not at
//! all when `b > a`. At step 0 the shard is the rank's own, and since a shard keeps its
//! positions in global order, causal attention on the local sequence is exactly the global mask
//! restricted to it: one causal call. At every other step the held chunks differ from the
//! rank's own, so each (query chunk, key chunk) pair is either wholly visible or hidden, and
//! the visible pairs join into rectangles run without a mask. With the zigzag split those
//! rectangles are all local queries against the first held chunk (holder earlier in the ring)
//! or the second local chunk against all held keys (holder later): the same work on every rank.

use super::zigzag::Zigzag;
use crate::error::Result;
use std::ops::Range;

/// One attention call of a step: local query rows `q` against held keys `k`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Query rows, in the rank's local sequence.
    pub q: Range<usize>,
    /// Keys, in the held K/V shard's local sequence.
    pub k: Range<usize>,
    /// Causal within the block (`q` and `k` then cover the same global positions); else every
    /// key of `k` is visible to every row of `q`.
    pub causal: bool,
}

/// One step of the ring for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The rank whose K/V shard is held at this step.
    pub holder: usize,
    /// The calls to make, possibly none (every held key hidden).
    pub blocks: Vec<Block>,
}

/// The `world` steps of rank `rank`, in ring order; an error for a rank outside the ring.
pub fn steps(z: &Zigzag, rank: usize, causal: bool) -> Result<Vec<Step>> {
    z.chunks(rank)?;
    let w = z.world();
    (0..w)
        .map(|t| {
            // rank < w, so no overflow.
            let holder = (rank + w - t) % w;
            Ok(Step {
                holder,
                blocks: blocks(z, rank, holder, causal)?,
            })
        })
        .collect()
}

/// The calls rank `rank` makes against the K/V shard of rank `holder`; an error for a rank
/// outside the ring.
pub fn blocks(z: &Zigzag, rank: usize, holder: usize, causal: bool) -> Result<Vec<Block>> {
    let (qc, kc) = (z.chunks(rank)?, z.chunks(holder)?);
    let all = 0..z.local_len();
    if !causal {
        return Ok(vec![Block {
            q: all.clone(),
            k: all,
            causal: false,
        }]);
    }
    if holder == rank {
        return Ok(vec![Block {
            q: all.clone(),
            k: all,
            causal: true,
        }]);
    }
    let c = z.chunk();
    // Visible (query half, key half) pairs; no pair is diagonal since the chunks differ.
    let sees = |i: usize, j: usize| kc[j] < qc[i];
    let half = |i: usize| i * c..(i + 1) * c;
    let mut out: Vec<Block> = Vec::new();
    for i in 0..2 {
        for j in 0..2 {
            if sees(i, j) {
                out.push(Block {
                    q: half(i),
                    k: half(j),
                    causal: false,
                });
            }
        }
    }
    Ok(join_rectangles(out))
}

/// Joins unmasked blocks that share their rows and touch in keys, or share their keys and
/// touch in rows, until none do: fewer, larger calls.
fn join_rectangles(mut blocks: Vec<Block>) -> Vec<Block> {
    'again: loop {
        for i in 0..blocks.len() {
            for j in 0..blocks.len() {
                let (a, b) = (&blocks[i], &blocks[j]);
                let joined = if i == j {
                    None
                } else if a.q == b.q && a.k.end == b.k.start {
                    Some(Block {
                        q: a.q.clone(),
                        k: a.k.start..b.k.end,
                        causal: false,
                    })
                } else if a.k == b.k && a.q.end == b.q.start {
                    Some(Block {
                        q: a.q.start..b.q.end,
                        k: a.k.clone(),
                        causal: false,
                    })
                } else {
                    None
                };
                if let Some(block) = joined {
                    let (lo, hi) = (i.min(j), i.max(j));
                    blocks.remove(hi);
                    blocks[lo] = block;
                    continue 'again;
                }
            }
        }
        return blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The (query, key) global position pairs a block makes rank `rank` compute against the
    /// shard of `holder`.
    fn pairs(z: &Zigzag, rank: usize, holder: usize, b: &Block) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for q in b.q.clone() {
            for k in b.k.clone() {
                let (qi, ki) = (q - b.q.start, k - b.k.start);
                if !b.causal || ki <= qi {
                    out.push((z.global(rank, q).unwrap(), z.global(holder, k).unwrap()));
                }
            }
        }
        out
    }

    /// Every step of every rank, against a brute-force enumeration of the global mask: each
    /// visible (query, key) pair computed exactly once, no hidden pair computed.
    #[test]
    fn steps_cover_the_global_mask_exactly_once() {
        for world in 1..=6 {
            for chunk in 1..=3 {
                for causal in [false, true] {
                    let z = Zigzag::new(2 * world * chunk, world).unwrap();
                    let s = z.seq();
                    let mut count = vec![0u32; s * s];
                    for rank in 0..world {
                        let st = steps(&z, rank, causal).unwrap();
                        assert_eq!(st.len(), world);
                        for (t, step) in st.iter().enumerate() {
                            assert_eq!(step.holder, (rank + world - t) % world);
                            for b in &step.blocks {
                                assert!(!b.q.is_empty() && !b.k.is_empty());
                                if b.causal {
                                    assert_eq!(b.q.len(), b.k.len());
                                }
                                for (q, k) in pairs(&z, rank, step.holder, b) {
                                    count[q * s + k] += 1;
                                }
                            }
                        }
                    }
                    for q in 0..s {
                        for k in 0..s {
                            let want = u32::from(!causal || k <= q);
                            assert_eq!(
                                count[q * s + k],
                                want,
                                "world {world} chunk {chunk} causal {causal}: ({q}, {k})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The zigzag split's point: under the causal mask every rank computes the same number of
    /// (query, key) pairs, at every step after the first and in all.
    #[test]
    fn causal_work_is_balanced() {
        for world in 1..=8 {
            let z = Zigzag::new(2 * world * 4, world).unwrap();
            let work = |rank: usize, t: usize| -> usize {
                let step = &steps(&z, rank, true).unwrap()[t];
                step.blocks
                    .iter()
                    .map(|b| pairs(&z, rank, step.holder, b).len())
                    .sum()
            };
            for t in 0..world {
                let w0 = work(0, t);
                for rank in 1..world {
                    assert_eq!(work(rank, t), w0, "world {world} step {t} rank {rank}");
                }
                if t > 0 {
                    // Half of the 2c x 2c pairs: one chunk of rows or of keys.
                    assert_eq!(w0, 2 * 4 * 4, "world {world} step {t}");
                }
            }
        }
    }

    #[test]
    fn ranks_outside_the_ring_are_errors() {
        let z = Zigzag::new(16, 4).unwrap();
        for rank in [4, usize::MAX] {
            let e = steps(&z, rank, true).unwrap_err().to_string();
            assert!(
                e.contains(&format!("rank {rank} is not in a ring of 4")),
                "{e}"
            );
            assert!(blocks(&z, rank, 0, false).is_err());
            assert!(blocks(&z, 0, rank, true).is_err());
        }
    }

    #[test]
    fn off_diagonal_steps_are_one_unmasked_rectangle() {
        let z = Zigzag::new(16, 4).unwrap();
        // Rank 2 holds chunks 2 and 5. Holder 1 (chunks 1, 6): both local chunks see chunk 1.
        assert_eq!(
            blocks(&z, 2, 1, true).unwrap(),
            [Block {
                q: 0..4,
                k: 0..2,
                causal: false
            }]
        );
        // Holder 3 (chunks 3, 4): only local chunk 5 sees them, all of them.
        assert_eq!(
            blocks(&z, 2, 3, true).unwrap(),
            [Block {
                q: 2..4,
                k: 0..4,
                causal: false
            }]
        );
        assert_eq!(
            blocks(&z, 2, 2, true).unwrap(),
            [Block {
                q: 0..4,
                k: 0..4,
                causal: true
            }]
        );
    }
}
