//! The named problems (README.md lists them): the shapes the CLI validates and benches by default,
//! the criterion benches time, and the PyTorch anchor script measures under the same names.

use sdpa::{Error, Problem, Result};

/// The named problems: (name, [batch, heads, seq, head_dim], causal), all f16, BHSD, with
/// seq_q = seq_k (same names as the PyTorch anchor script).
pub const NAMED_PROBLEMS: [(&str, [usize; 4], bool); 7] = [
    ("mission", [2, 8, 256, 64], false),
    ("mission-causal", [2, 8, 256, 64], true),
    ("s1k-d64", [4, 16, 1024, 64], false),
    ("s2k-d128", [4, 16, 2048, 128], false),
    ("s4k-d128-causal", [2, 16, 4096, 128], true),
    ("s8k-d128", [1, 16, 8192, 128], false),
    ("s16k-d128-causal", [1, 16, 16384, 128], true),
];

/// Looks up a named problem (f16, BHSD); an unknown name is `InvalidArgument` listing the
/// known ones.
pub fn named_problem(name: &str) -> Result<Problem> {
    NAMED_PROBLEMS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|&(_, [b, h, s, d], c)| Problem::new(b, h, s, s, d).with_causal(c))
        .ok_or_else(|| {
            let names: Vec<_> = NAMED_PROBLEMS.iter().map(|p| p.0).collect();
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
        for (name, [b, h, s, d], causal) in NAMED_PROBLEMS {
            let p = named_problem(name).unwrap();
            assert_eq!(
                (
                    p.batch,
                    p.heads,
                    p.seq_q,
                    p.seq_k,
                    p.head_dim,
                    p.is_causal()
                ),
                (b, h, s, s, d, causal),
                "{name}"
            );
            p.validate().unwrap();
        }
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
