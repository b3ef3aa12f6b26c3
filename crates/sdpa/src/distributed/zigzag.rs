//! How a sequence is split over the ranks of a ring: into `2·world` equal chunks, rank `r`
//! holding chunks `r` and `2·world − 1 − r` ("zigzag"). Under a causal mask the early chunks see
//! few keys and the late ones many; pairing the i-th earliest with the i-th latest gives every
//! rank the same work. Without a mask any split would do; the ring uses this one for both.
//!
//! A rank's shard of a `[batch, heads, seq, head_dim]` tensor is the same tensor over its local
//! sequence of `2·chunk` positions (its first chunk, then its second), in the same layout.

use crate::error::{Result, invalid};
use crate::problem::Layout;
use std::ops::Range;

/// The split of a sequence of `2·world·chunk` positions over `world` ranks.
///
/// ```
/// use sdpa::distributed::Zigzag;
/// let z = Zigzag::new(16, 2)?; // 4 chunks of 4 positions
/// assert_eq!(z.ranges(0)?, [0..4, 12..16]); // rank 0: the first chunk and the last
/// assert_eq!(z.ranges(1)?, [4..8, 8..12]);
/// assert!(Zigzag::new(18, 2).is_err()); // not a multiple of 2 x 2
/// # Ok::<(), sdpa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zigzag {
    world: usize,
    chunk: usize,
}

impl Zigzag {
    /// The split of `seq` positions over `world` ranks. `seq` must be a positive multiple of
    /// `2·world`.
    pub fn new(seq: usize, world: usize) -> Result<Zigzag> {
        if world == 0 {
            return Err(invalid!("a ring needs at least one rank"));
        }
        let parts = world
            .checked_mul(2)
            .ok_or_else(|| invalid!("{world} ranks overflow"))?;
        if seq == 0 || !seq.is_multiple_of(parts) {
            return Err(invalid!(
                "sequence length {seq} does not split over {world} rank(s): the zigzag split \
                 needs a positive multiple of 2 x ranks = {parts}"
            ));
        }
        Ok(Zigzag {
            world,
            chunk: seq / parts,
        })
    }
    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Positions per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }
    /// Positions a rank holds (two chunks).
    pub fn local_len(&self) -> usize {
        2 * self.chunk
    }
    /// The whole sequence's length.
    pub fn seq(&self) -> usize {
        2 * self.world * self.chunk
    }
    /// The chunks rank `rank` holds, in local order; an error for a rank outside the ring.
    pub fn chunks(&self, rank: usize) -> Result<[usize; 2]> {
        self.check_rank(rank)?;
        Ok(self.chunks_of(rank))
    }
    /// The global positions of rank `rank`'s two chunks, in local order.
    pub fn ranges(&self, rank: usize) -> Result<[Range<usize>; 2]> {
        Ok(self
            .chunks(rank)?
            .map(|c| c * self.chunk..(c + 1) * self.chunk))
    }
    /// The global position of rank `rank`'s local position `local`.
    pub fn global(&self, rank: usize, local: usize) -> Result<usize> {
        self.check_rank(rank)?;
        if local >= self.local_len() {
            return Err(invalid!(
                "local position {local} is past the {} a rank holds",
                self.local_len()
            ));
        }
        Ok(self.global_of(rank, local))
    }
    /// The rank holding global position `pos`, and where it sits in that rank's shard.
    pub fn owner(&self, pos: usize) -> Result<(usize, usize)> {
        if pos >= self.seq() {
            return Err(invalid!(
                "position {pos} is past the sequence of {}",
                self.seq()
            ));
        }
        let c = pos / self.chunk;
        let (rank, half) = if c < self.world {
            (c, 0)
        } else {
            (2 * self.world - 1 - c, 1)
        };
        Ok((rank, half * self.chunk + pos % self.chunk))
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world {
            return Err(invalid!(
                "rank {rank} is not in a ring of {} rank(s)",
                self.world
            ));
        }
        Ok(())
    }
    /// [`Zigzag::chunks`] of a rank below `world`.
    fn chunks_of(&self, rank: usize) -> [usize; 2] {
        [rank, 2 * self.world - 1 - rank]
    }
    /// [`Zigzag::global`] of a rank below `world` and a position below `local_len`.
    fn global_of(&self, rank: usize, local: usize) -> usize {
        let [a, b] = self.chunks_of(rank);
        let chunk = if local < self.chunk { a } else { b };
        chunk * self.chunk + local % self.chunk
    }

    /// Rank `rank`'s shard of `full`, a `[batch, heads, seq, inner]` tensor in `layout` (the
    /// log-sum-exp `[batch, heads, seq]` is `inner` 1 with `Layout::Bhsd`).
    pub fn shard<T: Copy>(&self, full: &[T], dims: Dims, rank: usize) -> Result<Vec<T>> {
        self.check_rank(rank)?;
        self.check(full.len(), dims, self.seq(), "the full tensor")?;
        let mut out = Vec::with_capacity(full.len() / self.world);
        for_each_row(dims, self.local_len(), |b, h, s| {
            let g = self.global_of(rank, s);
            let at = dims.offset(b, h, g, self.seq());
            out.extend_from_slice(&full[at..at + dims.inner]);
        });
        Ok(out)
    }

    /// The full tensor from every rank's shard (`shards[r]` rank r's), the inverse of
    /// [`Zigzag::shard`].
    pub fn unshard<T: Copy + Default>(&self, shards: &[Vec<T>], dims: Dims) -> Result<Vec<T>> {
        if shards.len() != self.world {
            return Err(invalid!(
                "{} shards given for {} ranks",
                shards.len(),
                self.world
            ));
        }
        let local = self.local_len();
        // Every shard checked before the whole is allocated, from their common length.
        for shard in shards {
            self.check(shard.len(), dims, local, "a shard")?;
        }
        let len = shards[0]
            .len()
            .checked_mul(self.world)
            .ok_or_else(|| invalid!("{} shards overflow usize", self.world))?;
        self.check(len, dims, self.seq(), "the full tensor")?;
        let mut full = vec![T::default(); len];
        for (rank, shard) in shards.iter().enumerate() {
            for_each_row(dims, local, |b, h, s| {
                let from = dims.offset(b, h, s, local);
                let to = dims.offset(b, h, self.global_of(rank, s), self.seq());
                full[to..to + dims.inner].copy_from_slice(&shard[from..from + dims.inner]);
            });
        }
        Ok(full)
    }

    /// That a tensor of `len` elements is `[batch, heads, seq, inner]` (its size computed
    /// without overflow; `inner` at least 1, so that visiting its rows is bounded by `len`).
    fn check(&self, len: usize, dims: Dims, seq: usize, what: &str) -> Result<()> {
        let shape = || format!("[{}, {}, {seq}, {}]", dims.batch, dims.heads, dims.inner);
        if dims.inner == 0 {
            return Err(invalid!(
                "{what} of shape {}: inner must be at least 1",
                shape()
            ));
        }
        let want = [dims.heads, seq, dims.inner]
            .into_iter()
            .try_fold(dims.batch, usize::checked_mul)
            .ok_or_else(|| invalid!("{what} of shape {} overflows usize", shape()))?;
        if len != want {
            return Err(invalid!(
                "{what} holds {len} elements; {} is {want}",
                shape()
            ));
        }
        Ok(())
    }
}

/// The shape of a tensor [`Zigzag::shard`] splits, but for its sequence length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Batch size.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per (batch, head, position): the head dim, or 1 for the log-sum-exp.
    pub inner: usize,
    /// Memory layout.
    pub layout: Layout,
}

impl Dims {
    /// Element offset of (b, h, s, 0) in a tensor of `seq` positions.
    fn offset(&self, b: usize, h: usize, s: usize, seq: usize) -> usize {
        match self.layout {
            Layout::Bhsd => ((b * self.heads + h) * seq + s) * self.inner,
            Layout::Bshd => ((b * seq + s) * self.heads + h) * self.inner,
        }
    }
}

/// Calls `f(b, h, s)` for every row of a tensor of `seq` positions, in memory order.
fn for_each_row(dims: Dims, seq: usize, mut f: impl FnMut(usize, usize, usize)) {
    for b in 0..dims.batch {
        match dims.layout {
            Layout::Bhsd => (0..dims.heads).for_each(|h| (0..seq).for_each(|s| f(b, h, s))),
            Layout::Bshd => (0..seq).for_each(|s| (0..dims.heads).for_each(|h| f(b, h, s))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_mirrored_chunks() {
        let z = Zigzag::new(16, 4).unwrap();
        assert_eq!((z.chunk(), z.local_len(), z.seq()), (2, 4, 16));
        assert_eq!(z.chunks(0).unwrap(), [0, 7]);
        assert_eq!(z.chunks(3).unwrap(), [3, 4]);
        assert_eq!(z.ranges(1).unwrap(), [2..4, 12..14]);
        assert_eq!(
            (0..4).map(|l| z.global(1, l).unwrap()).collect::<Vec<_>>(),
            [2, 3, 12, 13]
        );
    }

    #[test]
    fn every_position_has_exactly_one_owner() {
        for world in 1..=5 {
            let z = Zigzag::new(2 * world * 3, world).unwrap();
            let mut seen = vec![0; z.seq()];
            for rank in 0..world {
                for local in 0..z.local_len() {
                    let g = z.global(rank, local).unwrap();
                    seen[g] += 1;
                    assert_eq!(z.owner(g).unwrap(), (rank, local));
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "world {world}: {seen:?}");
        }
    }

    #[test]
    fn sequences_that_do_not_split_are_refused() {
        let e = Zigzag::new(12, 4).unwrap_err().to_string();
        assert!(e.contains("multiple of 2 x ranks = 8"), "{e}");
        assert!(Zigzag::new(0, 2).is_err());
        assert!(
            Zigzag::new(8, 0)
                .unwrap_err()
                .to_string()
                .contains("at least one rank")
        );
    }

    #[test]
    fn shard_and_unshard_are_inverse_in_both_layouts() {
        let z = Zigzag::new(12, 3).unwrap();
        for layout in [Layout::Bhsd, Layout::Bshd] {
            let dims = Dims {
                batch: 2,
                heads: 3,
                inner: 4,
                layout,
            };
            let full: Vec<u32> = (0..2 * 3 * 12 * 4).collect();
            let shards: Vec<_> = (0..3).map(|r| z.shard(&full, dims, r).unwrap()).collect();
            assert_eq!(z.unshard(&shards, dims).unwrap(), full);
            // Rank 1 holds global positions 2, 3 (chunk 1) and 8, 9 (chunk 4), in that order.
            let want: Vec<usize> = [2, 3, 8, 9].to_vec();
            let s1 = &shards[1];
            for (local, g) in want.iter().enumerate() {
                let (b, h) = (1, 2);
                let got = s1[dims.offset(b, h, local, 4)];
                assert_eq!(
                    got as usize,
                    dims.offset(b, h, *g, 12),
                    "{layout:?} local {local}"
                );
            }
        }
    }

    /// Ranks, positions and shapes outside the split are errors naming the value (they were
    /// asserts and out-of-bounds panics before).
    #[test]
    fn ranks_and_positions_outside_the_ring_are_errors() {
        let z = Zigzag::new(16, 4).unwrap();
        let e = z.chunks(4).unwrap_err().to_string();
        assert!(e.contains("rank 4 is not in a ring of 4"), "{e}");
        assert!(z.ranges(usize::MAX).is_err());
        assert!(z.global(usize::MAX, 0).is_err());
        let e = z.global(0, 4).unwrap_err().to_string();
        assert!(e.contains("local position 4 is past the 4"), "{e}");
        let e = z.owner(16).unwrap_err().to_string();
        assert!(e.contains("position 16 is past the sequence of 16"), "{e}");
        assert!(z.owner(usize::MAX).is_err());
        let dims = Dims {
            batch: 1,
            heads: 1,
            inner: 1,
            layout: Layout::Bhsd,
        };
        let full = [0u8; 16];
        let e = z.shard(&full, dims, 4).unwrap_err().to_string();
        assert!(e.contains("rank 4 is not in a ring of 4"), "{e}");
        // Sizes that overflow, and an inner size of 0 (rows without elements: a loop over
        // batch x heads x seq bounded by nothing), are refused, not wrapped or looped over.
        let huge = Dims {
            batch: usize::MAX / 2,
            heads: 3,
            ..dims
        };
        let e = z.shard(&full, huge, 0).unwrap_err().to_string();
        assert!(e.contains("overflows usize"), "{e}");
        let empty = Dims {
            batch: usize::MAX,
            inner: 0,
            ..dims
        };
        let e = z.shard(&[0u8; 0], empty, 0).unwrap_err().to_string();
        assert!(e.contains("inner must be at least 1"), "{e}");
        let e = z.unshard(&vec![vec![(); usize::MAX]; 4], dims).unwrap_err();
        assert!(e.to_string().contains("holds"), "{e}");
    }

    #[test]
    fn shapes_that_do_not_match_are_refused() {
        let z = Zigzag::new(8, 2).unwrap();
        let dims = Dims {
            batch: 1,
            heads: 1,
            inner: 2,
            layout: Layout::Bhsd,
        };
        let e = z.shard(&[0u8; 15], dims, 0).unwrap_err().to_string();
        assert!(e.contains("holds 15 elements; [1, 1, 8, 2] is 16"), "{e}");
        assert!(z.unshard(&[vec![0u8; 8]], dims).is_err());
    }
}
