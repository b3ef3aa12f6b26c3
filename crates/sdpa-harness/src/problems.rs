//! The named problems (README.md lists them): the shapes the CLI validates and benches by default,
//! the criterion benches time, and the PyTorch anchor script measures under the same names (its
//! SHAPES and VARIANTS, with their exact definitions).

use sdpa::{Error, Mask, Problem, Result};

/// One named problem: [batch, heads, kv_heads, seq, head_dim] (seq_q = seq_k), its mask and its
/// softcap.
#[derive(Debug, Clone, Copy)]
pub struct Named {
    /// The name, as the anchor script spells it.
    pub name: &'static str,
    /// [batch, heads, kv_heads, seq, head_dim].
    pub dims: [usize; 5],
    /// Which keys each row sees.
    pub mask: Mask,
    /// The logit cap, if any.
    pub softcap: Option<f32>,
}

impl Named {
    const fn dense(name: &'static str, [b, h, s, d]: [usize; 4], causal: bool) -> Named {
        Named {
            name,
            dims: [b, h, h, s, d],
            mask: if causal {
                Mask::CausalBottomRight
            } else {
                Mask::None
            },
            softcap: None,
        }
    }

    /// The problem (f16, BHSD).
    pub fn problem(&self) -> Problem {
        let [b, h, hkv, s, d] = self.dims;
        let p = Problem::new(b, h, s, s, d)
            .with_kv_heads(hkv)
            .with_mask(self.mask);
        match self.softcap {
            Some(c) => p.with_softcap(c),
            None => p,
        }
    }
}

/// The named problems, all f16, BHSD, seq_q = seq_k.
pub const NAMED_PROBLEMS: [Named; 12] = [
    Named::dense("mission", [2, 8, 256, 64], false),
    Named::dense("mission-causal", [2, 8, 256, 64], true),
    Named::dense("s1k-d64", [4, 16, 1024, 64], false),
    Named::dense("s2k-d128", [4, 16, 2048, 128], false),
    Named::dense("s4k-d128-causal", [2, 16, 4096, 128], true),
    Named::dense("s8k-d128", [1, 16, 8192, 128], false),
    Named::dense("s16k-d128-causal", [1, 16, 16384, 128], true),
    Named::dense("s8k-d256", [1, 16, 8192, 256], false),
    Named::dense("s8k-d256-causal", [1, 16, 8192, 256], true),
    Named {
        name: "s8k-d128-window1k",
        dims: [1, 16, 16, 8192, 128],
        mask: Mask::Window {
            left: Some(1024),
            right: Some(0),
        },
        softcap: None,
    },
    Named {
        name: "s8k-d128-softcap",
        dims: [1, 16, 16, 8192, 128],
        mask: Mask::CausalBottomRight,
        softcap: Some(30.0),
    },
    Named {
        name: "s8k-d128-gqa",
        dims: [1, 32, 8, 8192, 128],
        mask: Mask::CausalBottomRight,
        softcap: None,
    },
];

/// Looks up a named problem (f16, BHSD); an unknown name is `InvalidArgument` listing the
/// known ones.
pub fn named_problem(name: &str) -> Result<Problem> {
    NAMED_PROBLEMS
        .iter()
        .find(|n| n.name == name)
        .map(Named::problem)
        .ok_or_else(|| {
            let names: Vec<_> = NAMED_PROBLEMS.iter().map(|p| p.name).collect();
            Error::InvalidArgument(format!(
                "unknown problem {name:?} (known: {})",
                names.join(", ")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_problem_is_found_and_valid() {
        for n in NAMED_PROBLEMS {
            let p = named_problem(n.name).unwrap();
            let [b, h, hkv, s, d] = n.dims;
            assert_eq!(
                (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim),
                (b, h, hkv, s, s, d),
                "{}",
                n.name
            );
            assert_eq!((p.mask, p.softcap), (n.mask, n.softcap), "{}", n.name);
            if n.name.ends_with("causal") {
                assert!(p.is_causal(), "{}", n.name);
            }
            p.validate().unwrap();
        }
    }

    #[test]
    fn the_variants_are_the_anchor_scripts() {
        // sdpa_anchor.py VARIANTS: window (1024, 0) with causal, softcap 30 with causal, GQA 32/8
        // with causal.
        let w = named_problem("s8k-d128-window1k").unwrap();
        assert_eq!(w.visible_range(5000), 3976..5001);
        let c = named_problem("s8k-d128-softcap").unwrap();
        assert_eq!((c.softcap, c.is_causal()), (Some(30.0), true));
        let g = named_problem("s8k-d128-gqa").unwrap();
        assert_eq!((g.heads, g.kv_heads, g.is_causal()), (32, 8, true));
    }

    #[test]
    fn an_unknown_name_lists_the_known_ones() {
        let e = named_problem("s3k").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("\"s3k\"") && msg.contains("mission-causal"),
            "{msg}"
        );
    }
}
