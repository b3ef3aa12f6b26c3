//! Which keys each query sees (the mask) and the ALiBi bias on the scores.

use crate::error::{Result, invalid};
use std::fmt;
use std::str::FromStr;

/// Which keys each query row sees. The diagonal of the causal and window masks is aligned
/// bottom-right (the last query row with the last key) as in FlashAttention, except
/// [`Mask::CausalTopLeft`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mask {
    /// Every key.
    #[default]
    None,
    /// Causal, aligned bottom-right: query row i sees keys j <= i + seq_k - seq_q (the last
    /// query row sees every key, as FlashAttention does when seq_q != seq_k).
    CausalBottomRight,
    /// Causal, aligned top-left: query row i sees keys j <= i (PyTorch's `is_causal` when
    /// seq_q != seq_k).
    CausalTopLeft,
    /// Sliding window around the bottom-right diagonal, as FlashAttention's `window_size`: row
    /// i sees keys j with i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right; `None` is
    /// unbounded on that side. `right: Some(0)` is causal with a window.
    Window {
        /// Keys before the diagonal a row sees (`None`: all).
        left: Option<usize>,
        /// Keys after the diagonal a row sees (`None`: all).
        right: Option<usize>,
    },
    /// Chunked causal attention, as Llama 4's local layers: the keys form chunks of `size`, and
    /// row i sees the keys of its diagonal's chunk up to the diagonal (bottom-right aligned: with
    /// d = i + seq_k - seq_q, keys ⌊d / size⌋ · size <= j <= d).
    Chunked {
        /// Keys a chunk holds (at least 1).
        size: usize,
    },
}

impl Mask {
    /// Name as the CLI and bench records spell it: `none`, `causal`, `causal-top-left`,
    /// `window(L,R)` (`-1` for an unbounded side), `chunked(N)`.
    pub fn name(self) -> String {
        match self {
            Mask::None => "none".into(),
            Mask::CausalBottomRight => "causal".into(),
            Mask::CausalTopLeft => "causal-top-left".into(),
            Mask::Window { left, right } => {
                let side = |x: Option<usize>| x.map_or("-1".to_string(), |n| n.to_string());
                format!("window({},{})", side(left), side(right))
            }
            Mask::Chunked { size } => format!("chunked({size})"),
        }
    }

    /// The same mask in its simplest form: a window unbounded on both sides is no mask, one
    /// unbounded on the left and closed at the diagonal is causal.
    pub fn canonical(self) -> Mask {
        match self {
            Mask::Window {
                left: None,
                right: None,
            } => Mask::None,
            Mask::Window {
                left: None,
                right: Some(0),
            } => Mask::CausalBottomRight,
            m => m,
        }
    }

    /// The keys `[first, end)` query row `i` of a `seq_q` x `seq_k` problem sees (empty when
    /// none).
    pub fn visible(self, i: usize, seq_q: usize, seq_k: usize) -> std::ops::Range<usize> {
        // Row i's diagonal key, i + seq_k - seq_q (or i), in i128: no overflow for any sizes.
        let (i, sq, sk) = (i as i128, seq_q as i128, seq_k as i128);
        let (diag, left, right) = match self {
            Mask::None => return 0..seq_k,
            Mask::CausalBottomRight => (i + sk - sq, None, Some(0)),
            Mask::CausalTopLeft => (i, None, Some(0)),
            Mask::Window { left, right } => (i + sk - sq, left, right),
            Mask::Chunked { size } => {
                let diag = i + sk - sq;
                if diag < 0 || size == 0 {
                    return 0..0;
                }
                let first = (diag / size as i128 * size as i128).min(sk);
                return first as usize..(diag + 1).min(sk) as usize;
            }
        };
        let first = left.map_or(0, |l| (diag - l as i128).max(0));
        let end = right.map_or(sk, |r| (diag + r as i128 + 1).clamp(0, sk));
        let first = first.min(end);
        first as usize..end as usize
    }

    /// Whether the mask hides any key from some row (every mask but `None` and an unbounded
    /// window).
    pub fn hides_keys(self) -> bool {
        self.canonical() != Mask::None
    }
}

impl FromStr for Mask {
    type Err = crate::Error;
    /// `none`, `causal`, `causal-top-left`, a window `L,R` (also `window(L,R)`) with `-1` for
    /// an unbounded side, or `chunked(N)`.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "none" | "false" => return Ok(Mask::None),
            "causal" | "true" | "causal-bottom-right" => return Ok(Mask::CausalBottomRight),
            "causal-top-left" | "top-left" => return Ok(Mask::CausalTopLeft),
            _ => {}
        }
        if let Some(n) = t.strip_prefix("chunked(").and_then(|x| x.strip_suffix(')')) {
            return match n.trim().parse::<usize>() {
                Ok(size) if size > 0 => Ok(Mask::Chunked { size }),
                _ => Err(invalid!(
                    "chunk size {n:?} in {s:?} is not a positive key count"
                )),
            };
        }
        let inner = t
            .strip_prefix("window(")
            .and_then(|x| x.strip_suffix(')'))
            .unwrap_or(&t);
        let side = |x: &str| -> Result<Option<usize>> {
            match x.trim() {
                "-1" => Ok(None),
                n => n.parse::<usize>().map(Some).map_err(|_| {
                    invalid!(
                        "window side {n:?} in {s:?} is not a key count (a non-negative integer, \
                         or -1 for unbounded)"
                    )
                }),
            }
        };
        match inner.split_once(',') {
            Some((l, r)) => Ok(Mask::Window {
                left: side(l)?,
                right: side(r)?,
            }),
            None => Err(invalid!(
                "unknown mask {s:?} (expected none, causal, causal-top-left, a window L,R or \
                 chunked(N))"
            )),
        }
    }
}

impl fmt::Display for Mask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// How ALiBi slopes are laid out (FlashAttention-2's `alibi_slopes`): f32, one per query head
/// (`[heads]`) or one per (batch, query head) pair (`[batch, heads]`). Row i, key j of head h
/// adds `-slope · |i + seq_k - seq_q - j|` to the scaled (and capped) score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Alibi {
    /// `[heads]`: one slope per head, shared by the batch.
    PerHead,
    /// `[batch, heads]`.
    PerBatchHead,
}

impl Alibi {
    /// Slopes the layout holds for a problem of `batch` x `heads`.
    pub fn len(self, batch: usize, heads: usize) -> usize {
        match self {
            Alibi::PerHead => heads,
            Alibi::PerBatchHead => batch * heads,
        }
    }
    /// Index of the slope of (b, h).
    pub fn index(self, b: usize, h: usize, heads: usize) -> usize {
        match self {
            Alibi::PerHead => h,
            Alibi::PerBatchHead => b * heads + h,
        }
    }
}
