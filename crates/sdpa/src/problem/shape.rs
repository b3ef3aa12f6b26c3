//! Where a tensor's elements are: its shape, its memory layout and its element strides.

use crate::error::{Result, invalid};
use std::fmt;
use std::str::FromStr;

/// The logical shape of one 4-D tensor: [batch, heads, seq, head_dim] stored in `layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorShape {
    /// Batch size.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Sequence length.
    pub seq: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Memory layout.
    pub layout: Layout,
}

impl TensorShape {
    /// Number of elements (`None` on overflow).
    pub fn len(&self) -> Option<usize> {
        self.batch
            .checked_mul(self.heads)?
            .checked_mul(self.seq)?
            .checked_mul(self.head_dim)
    }
    /// Whether any dimension is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }
    /// (batch, head) pairs: the number of per-head scales (`None` on overflow).
    pub fn heads_total(&self) -> Option<usize> {
        self.batch.checked_mul(self.heads)
    }
    /// Elements between consecutive heads of one sequence position's group: the `inner` of
    /// the scale map (seq·head_dim in BHSD, head_dim in BSHD).
    pub(crate) fn head_inner(&self) -> usize {
        match self.layout {
            Layout::Bhsd => self.seq * self.head_dim,
            Layout::Bshd => self.head_dim,
        }
    }
    /// Which (batch, head) pair element `i` belongs to; `None` when the shape holds no element
    /// `i` (`i` past its end, a zero dimension, or a size that overflows).
    pub fn head_of(&self, i: usize) -> Option<usize> {
        (i < self.len()?).then(|| self.head_index(i))
    }
    /// The element strides of the shape stored contiguously in its layout.
    pub fn strides(&self) -> Strides {
        let (heads, seq, d) = (self.heads, self.seq, self.head_dim);
        match self.layout {
            Layout::Bhsd => Strides {
                batch: heads * seq * d,
                head: seq * d,
                seq: d,
            },
            Layout::Bshd => Strides {
                batch: seq * heads * d,
                head: d,
                seq: heads * d,
            },
        }
    }
    /// `s` with the stride of each dimension of size 1 replaced by `own`'s (the problem's own
    /// strides of this operand): such a stride is never stepped, so any value a caller gives is
    /// valid, and the kernels (TMA descriptors, 64-bit offsets) must not meet an absurd one.
    pub(crate) fn effective(&self, s: Strides, own: Strides) -> Strides {
        let pick = |size: usize, given: usize, own: usize| if size > 1 { given } else { own };
        Strides {
            batch: pick(self.batch, s.batch, own.batch),
            head: pick(self.heads, s.head, own.head),
            seq: pick(self.seq, s.seq, own.seq),
        }
    }
    /// [`TensorShape::head_of`] for an `i` already known to lie inside a non-empty shape.
    pub(crate) fn head_index(&self, i: usize) -> usize {
        let per_batch = self.heads * self.seq * self.head_dim;
        (i / per_batch) * self.heads + (i / self.head_inner()) % self.heads
    }
}

impl fmt::Display for TensorShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = self.layout.name();
        write!(
            f,
            "[{}, {}, {}, {}] {l}",
            self.batch, self.heads, self.seq, self.head_dim
        )
    }
}

/// Memory layout of Q, K, V and the output (all contiguous, all the same layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    /// [batch, heads, seq, head_dim]: PyTorch's SDPA layout.
    #[default]
    Bhsd,
    /// [batch, seq, heads, head_dim]: what a fused QKV projection produces.
    Bshd,
}

impl Layout {
    /// Name as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Bhsd => "bhsd",
            Layout::Bshd => "bshd",
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bhsd" => Ok(Layout::Bhsd),
            "bshd" => Ok(Layout::Bshd),
            _ => Err(invalid!("unknown layout {s:?} (expected bhsd or bshd)")),
        }
    }
}

/// Element strides of a contiguous 4-D tensor: (batch, head, seq); head_dim has stride 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Between batches.
    pub batch: usize,
    /// Between heads.
    pub head: usize,
    /// Between sequence positions.
    pub seq: usize,
}

impl Strides {
    /// Offset of element (b, h, s, d).
    pub fn offset(&self, b: usize, h: usize, s: usize, d: usize) -> usize {
        b * self.batch + h * self.head + s * self.seq + d
    }
    pub(crate) fn as_i64(&self) -> [i64; 3] {
        [self.batch as i64, self.head as i64, self.seq as i64]
    }
}
