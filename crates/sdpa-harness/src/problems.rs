//! The named problems (README.md lists them): the shapes the CLI validates and benches by default,
//! the criterion benches time, and the PyTorch anchor script measures under the same names (its
//! SHAPES and VARIANTS, with their exact definitions).

use crate::seqs::{paged, varlen};
use sdpa::{DType, Error, Mask, Problem, Result, SeqMeta};

/// One named problem: [batch, heads, kv_heads, seq_q, seq_k, head_dim], its mask, its softcap,
/// whether it has sinks and how its sequences are stored.
#[derive(Debug, Clone, Copy)]
pub struct Named {
    /// The name, as the anchor script spells it.
    pub name: &'static str,
    /// [batch, heads, kv_heads, seq_q, seq_k, head_dim] (a packed batch: the longest sequence).
    pub dims: [usize; 6],
    /// V's and the output's head dim where it is not head_dim (the anchor's `dv`).
    pub head_dim_v: Option<usize>,
    /// Whether V is the first head_dim_v columns of K's rows (MLA's latent cache,
    /// [`Problem::with_v_in_k`]).
    pub v_in_k: bool,
    /// Which keys each row sees.
    pub mask: Mask,
    /// The logit cap, if any.
    pub softcap: Option<f32>,
    /// Learnable sinks, one logit a query head (the anchor's `sink`: FlashAttention-4's
    /// `learnable_sink`).
    pub sinks: bool,
    /// Dense, packed or paged.
    pub seqs: NamedSeqs,
    /// K and V's element type where it is not Q's: e4m3, an FP8 K/V cache
    /// ([`Problem::with_kv_dtype`]).
    pub kv_dtype: Option<DType>,
}

/// How a named problem's sequences are stored (the anchor's `varlen` and `page`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NamedSeqs {
    /// Every sequence seq_q queries and seq_k keys, BHSD.
    Dense,
    /// Packed Q and K/V, sequences of these lengths (seq_q = seq_k each).
    Varlen(&'static [usize]),
    /// Dense queries against a paged cache of pages of this many keys, every sequence seq_k keys,
    /// its pages in a random order.
    Paged(usize),
}

impl Named {
    const fn dense(name: &'static str, [b, h, s, d]: [usize; 4], causal: bool) -> Named {
        Named {
            name,
            dims: [b, h, h, s, s, d],
            mask: if causal {
                Mask::CausalBottomRight
            } else {
                Mask::None
            },
            head_dim_v: None,
            v_in_k: false,
            softcap: None,
            sinks: false,
            seqs: NamedSeqs::Dense,
            kv_dtype: None,
        }
    }

    const fn decode(name: &'static str, [b, sq, sk]: [usize; 3], causal: bool) -> Named {
        Named {
            dims: [b, 32, 8, sq, sk, 128],
            ..Named::dense(name, [b, 32, sk, 128], causal)
        }
    }

    const fn mla(name: &'static str, [b, sk]: [usize; 2]) -> Named {
        Named {
            dims: [b, 128, 1, 1, sk, 576],
            head_dim_v: Some(512),
            v_in_k: true,
            seqs: NamedSeqs::Paged(64),
            ..Named::dense(name, [b, 128, sk, 576], false)
        }
    }

    fn base(&self) -> Problem {
        let [b, h, hkv, sq, sk, d] = self.dims;
        let mut p = Problem::new(b, h, sq, sk, d)
            .with_head_dim_v(self.head_dim_v.unwrap_or(d))
            .with_v_in_k(self.v_in_k)
            .with_kv_heads(hkv)
            .with_mask(self.mask)
            .with_sinks(self.sinks);
        p.kv_dtype = self.kv_dtype;
        match self.softcap {
            Some(c) => p.with_softcap(c),
            None => p,
        }
    }

    /// The problem (f16; dense ones BHSD).
    pub fn problem(&self) -> Problem {
        self.with_meta(0).0
    }

    /// The problem and its sequence metadata (None for dense ones); a paged cache's page order
    /// drawn from `seed`.
    pub fn with_meta(&self, seed: u64) -> (Problem, Option<SeqMeta>) {
        let p = self.base();
        match self.seqs {
            NamedSeqs::Dense => (p, None),
            NamedSeqs::Varlen(lens) => {
                let (p, m) = varlen(p, lens, lens);
                (p, Some(m))
            }
            NamedSeqs::Paged(page) => {
                let (p, m) = paged(p, &vec![p.seq_k; p.batch], page, seed);
                (p, Some(m))
            }
        }
    }
}

/// varlen-16's sequence lengths (the anchor script's).
const VARLEN_16: [usize; 16] = [
    4096, 128, 2048, 512, 1024, 3000, 77, 1500, 2500, 256, 800, 3500, 64, 1800, 900, 2200,
];

/// The named problems, all f16 (Q; the `-fp8kv` ones over an e4m3 K/V cache); dense ones BHSD.
pub const NAMED_PROBLEMS: &[Named] = &[
    Named::dense("mission", [2, 8, 256, 64], false),
    Named::dense("mission-causal", [2, 8, 256, 64], true),
    Named::dense("s1k-d64", [4, 16, 1024, 64], false),
    Named::dense("s2k-d128", [4, 16, 2048, 128], false),
    Named::dense("s4k-d128-causal", [2, 16, 4096, 128], true),
    Named::dense("s8k-d128", [1, 16, 8192, 128], false),
    Named::dense("s8k-d64", [1, 32, 8192, 64], false),
    Named::dense("s16k-d128-causal", [1, 16, 16384, 128], true),
    Named::dense("s8k-d256", [1, 16, 8192, 256], false),
    Named::dense("s8k-d256-causal", [1, 16, 8192, 256], true),
    Named {
        name: "s8k-d128-window1k",
        dims: [1, 16, 16, 8192, 8192, 128],
        mask: Mask::Window {
            left: Some(1024),
            right: Some(0),
        },
        head_dim_v: None,
        v_in_k: false,
        softcap: None,
        sinks: false,
        seqs: NamedSeqs::Dense,
        kv_dtype: None,
    },
    // Llama 4's local layers: causal within chunks of 8192 keys, 40 query heads on 8 KV heads.
    Named {
        name: "llama4-chunk8k-s32k",
        dims: [1, 40, 8, 32768, 32768, 128],
        mask: Mask::Chunked { size: 8192 },
        head_dim_v: None,
        v_in_k: false,
        softcap: None,
        sinks: false,
        seqs: NamedSeqs::Dense,
        kv_dtype: None,
    },
    Named {
        name: "s8k-d128-softcap",
        dims: [1, 16, 16, 8192, 8192, 128],
        mask: Mask::CausalBottomRight,
        head_dim_v: None,
        v_in_k: false,
        softcap: Some(30.0),
        sinks: false,
        seqs: NamedSeqs::Dense,
        kv_dtype: None,
    },
    Named {
        name: "s8k-d128-gqa",
        dims: [1, 32, 8, 8192, 8192, 128],
        mask: Mask::CausalBottomRight,
        head_dim_v: None,
        v_in_k: false,
        softcap: None,
        sinks: false,
        seqs: NamedSeqs::Dense,
        kv_dtype: None,
    },
    Named {
        seqs: NamedSeqs::Varlen(&VARLEN_16),
        ..Named::dense("varlen-16", [16, 16, 4096, 128], true)
    },
    Named::decode("decode-b1-k32k", [1, 1, 32768], false),
    Named::decode("decode-b16-k8k", [16, 1, 8192], false),
    Named::decode("decode-b64-k4k", [64, 1, 4096], false),
    // Short contexts at small batches: a decode step's latency (launches, a split, a combine)
    // more than its bandwidth.
    Named::decode("decode-b1-k1k", [1, 1, 1024], false),
    Named::decode("decode-b1-k4k", [1, 1, 4096], false),
    Named::decode("decode-b8-k2k", [8, 1, 2048], false),
    Named {
        seqs: NamedSeqs::Paged(128),
        ..Named::decode("decode-b16-k8k-paged", [16, 1, 8192], false)
    },
    // The same cache in vLLM's and FlashInfer's common pages of 16 keys, and in pages of 256.
    Named {
        seqs: NamedSeqs::Paged(16),
        ..Named::decode("decode-b16-k8k-paged16", [16, 1, 8192], false)
    },
    Named {
        seqs: NamedSeqs::Paged(256),
        ..Named::decode("decode-b16-k8k-paged256", [16, 1, 8192], false)
    },
    Named::decode("spec-b16-q8-k8k", [16, 8, 8192], true),
    // The bf16 decode problems over an e4m3 K/V cache (scales per K/V head): half the bytes.
    Named {
        kv_dtype: Some(DType::E4m3),
        ..Named::decode("decode-b16-k8k-fp8kv", [16, 1, 8192], false)
    },
    Named {
        kv_dtype: Some(DType::E4m3),
        ..Named::decode("decode-b64-k4k-fp8kv", [64, 1, 4096], false)
    },
    // gpt-oss: learnable sinks, head_dim 64, 64 query and 8 K/V heads, a 128-key window on
    // alternate layers.
    Named {
        dims: [1, 64, 8, 8192, 8192, 64],
        sinks: true,
        ..Named::dense("gptoss-s8k-sink", [1, 64, 8192, 64], true)
    },
    Named {
        dims: [1, 64, 8, 8192, 8192, 64],
        mask: Mask::Window {
            left: Some(128),
            right: Some(0),
        },
        sinks: true,
        ..Named::dense("gptoss-s8k-win128-sink", [1, 64, 8192, 64], true)
    },
    Named {
        dims: [32, 64, 8, 1, 8192, 64],
        sinks: true,
        ..Named::dense("gptoss-decode-b32-k8k-sink", [32, 64, 8192, 64], false)
    },
    // DeepSeek V3 / R1 prefill (MLA not absorbed): Q and K 192 wide (128 + 64 rotary), V 128.
    Named {
        head_dim_v: Some(128),
        ..Named::dense("dsv3-prefill-s4k", [1, 128, 4096, 192], true)
    },
    // DeepSeek V3 / R1 decode, MLA absorbed: 128 query heads of 576 (512 latent + 64 rotary)
    // on one latent K/V head whose first 512 columns are V, in pages of 64 keys.
    Named::mla("mla-decode-b64-k4k", [64, 4096]),
    Named::mla("mla-decode-b16-k16k", [16, 16384]),
];

/// The metadata of named problem `name` (None for dense ones and unknown names), a paged cache's
/// page order drawn from `seed`.
pub fn named_meta(name: &str, seed: u64) -> Option<SeqMeta> {
    NAMED_PROBLEMS
        .iter()
        .find(|n| n.name == name)
        .and_then(|n| n.with_meta(seed).1)
}

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
            let [b, h, hkv, sq, sk, d] = n.dims;
            assert_eq!(
                (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim),
                (b, h, hkv, sq, sk, d),
                "{}",
                n.name
            );
            if let Some(m) = named_meta(n.name, 1) {
                sdpa::check_metadata(&p, &m).unwrap();
            }
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
        let l = named_problem("llama4-chunk8k-s32k").unwrap();
        assert_eq!(l.visible_range(8191), 0..8192);
        assert_eq!(l.visible_range(8192 + 5), 8192..8198);
    }

    #[test]
    fn the_gptoss_problems_are_the_anchor_scripts() {
        // VARIANTS: h 64, kv 8, d 64, sink; s8k causal, win128 window (128, 0) with causal,
        // decode b32 one query over 8k keys, no mask.
        for (name, b, sq) in [
            ("gptoss-s8k-sink", 1, 8192),
            ("gptoss-s8k-win128-sink", 1, 8192),
            ("gptoss-decode-b32-k8k-sink", 32, 1),
        ] {
            let p = named_problem(name).unwrap();
            assert_eq!(
                (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim),
                (b, 64, 8, sq, 8192, 64),
                "{name}"
            );
            assert!(p.sinks, "{name}");
        }
        assert!(named_problem("gptoss-s8k-sink").unwrap().is_causal());
        let w = named_problem("gptoss-s8k-win128-sink").unwrap();
        assert_eq!(w.visible_range(5000), 4872..5001);
        assert_eq!(
            named_problem("gptoss-decode-b32-k8k-sink").unwrap().mask,
            Mask::None
        );
        assert!(!named_problem("s8k-d128-gqa").unwrap().sinks);
    }

    #[test]
    fn the_deepseek_prefill_is_the_anchor_scripts() {
        // VARIANTS: b 1, h 128 = kv 128, s 4096, d 192, dv 128, causal; its FLOPs count
        // Q·Kᵀ at 192 and P·V at 128.
        let p = named_problem("dsv3-prefill-s4k").unwrap();
        assert_eq!(
            (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim),
            (1, 128, 128, 4096, 4096, 192)
        );
        assert_eq!(p.v_dim(), 128);
        assert!(p.is_causal());
        let visible = 4096.0 * 4097.0 / 2.0;
        assert_eq!(p.flops(), 2.0 * 128.0 * visible * (192.0 + 128.0));
        // K/V bytes: K's 192 columns and V's 128, two bytes each.
        let bytes = crate::check::kv_bytes(&p, None);
        assert_eq!(bytes, (4096 * 128 * (192 + 128) * 2) as f64);
    }

    #[test]
    fn the_mla_decode_problems_read_v_from_the_latent_cache() {
        // VARIANTS: b 64 / 16, h 128 on one latent head, one query, d 576, dv 512, pages of 64.
        for (name, b, sk) in [
            ("mla-decode-b64-k4k", 64, 4096),
            ("mla-decode-b16-k16k", 16, 16384),
        ] {
            let p = named_problem(name).unwrap();
            assert_eq!(
                (
                    p.batch,
                    p.heads,
                    p.kv_heads,
                    p.seq_q,
                    p.seq_k,
                    p.head_dim,
                    p.v_dim()
                ),
                (b, 128, 1, 1, sk, 576, 512)
            );
            assert!(p.v_in_k && !p.is_causal());
            assert_eq!(p.v_strides(), p.k_strides());
            let meta = named_meta(name, 0).unwrap();
            // K/V bytes: the latent rows once (576 columns of 2 bytes), not V again.
            let bytes = crate::check::kv_bytes(&p, Some(&meta));
            assert_eq!(bytes, (b * sk * 576 * 2) as f64);
        }
    }

    #[test]
    fn the_serving_problems_are_the_anchor_scripts() {
        // VARIANTS: varlen-16 (16 causal sequences of the listed lengths, h 16, d 128), decode
        // (h 32, kv 8, d 128, one query), the paged one with 128-key pages, spec (8 causal).
        let v = named_problem("varlen-16").unwrap();
        let spans = sdpa::check_metadata(&v, &named_meta("varlen-16", 0).unwrap()).unwrap();
        let lens: Vec<_> = spans.iter().map(|s| (s.seq_q, s.seq_k)).collect();
        assert_eq!(lens, VARLEN_16.map(|l| (l, l)));
        assert!(v.is_causal() && v.heads == 16);
        for (name, b, sq, sk) in [
            ("decode-b1-k32k", 1, 1, 32768),
            ("decode-b16-k8k", 16, 1, 8192),
            ("decode-b64-k4k", 64, 1, 4096),
            ("decode-b1-k1k", 1, 1, 1024),
            ("decode-b1-k4k", 1, 1, 4096),
            ("decode-b8-k2k", 8, 1, 2048),
            ("decode-b16-k8k-paged", 16, 1, 8192),
            ("decode-b16-k8k-paged16", 16, 1, 8192),
            ("decode-b16-k8k-paged256", 16, 1, 8192),
            ("spec-b16-q8-k8k", 16, 8, 8192),
        ] {
            let p = named_problem(name).unwrap();
            assert_eq!(
                (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k),
                (b, 32, 8, sq, sk)
            );
            assert_eq!(p.is_causal(), name.starts_with("spec"), "{name}");
        }
        let paged = named_problem("decode-b16-k8k-paged").unwrap();
        let spans =
            sdpa::check_metadata(&paged, &named_meta("decode-b16-k8k-paged", 3).unwrap()).unwrap();
        assert!(spans.iter().all(|s| s.seq_k == 8192));
        assert!(matches!(
            paged.seqs.kv,
            sdpa::KvRows::Paged { page_size: 128, .. }
        ));
        for (name, page) in [
            ("decode-b16-k8k-paged16", 16),
            ("decode-b16-k8k-paged256", 256),
        ] {
            let p = named_problem(name).unwrap();
            let spans = sdpa::check_metadata(&p, &named_meta(name, 3).unwrap()).unwrap();
            assert!(spans.iter().all(|s| s.seq_k == 8192), "{name}");
            assert!(
                matches!(p.seqs.kv, sdpa::KvRows::Paged { page_size, .. } if page_size == page),
                "{name}"
            );
        }
    }

    /// The -fp8kv problems are the bf16 decode problems of the same name stem over an e4m3
    /// cache: the same shape, half the K/V bytes, inputs whose K and V are e4m3 codes with a
    /// scale per (sequence, K/V head).
    #[test]
    fn the_fp8kv_problems_are_the_decode_problems_over_an_e4m3_cache() {
        for (name, base) in [
            ("decode-b16-k8k-fp8kv", "decode-b16-k8k"),
            ("decode-b64-k4k-fp8kv", "decode-b64-k4k"),
        ] {
            let p = named_problem(name).unwrap().with_dtype(DType::Bf16);
            let q = named_problem(base).unwrap().with_dtype(DType::Bf16);
            assert_eq!(p.as_dequantized(), q, "{name}");
            assert!(p.is_fp8_kv() && p.kv_dtype() == DType::E4m3, "{name}");
            assert_eq!(
                2.0 * crate::check::kv_bytes(&p, None),
                crate::check::kv_bytes(&q, None)
            );
        }
        let p = Problem::new(2, 4, 1, 256, 64)
            .with_kv_heads(2)
            .with_dtype(DType::Bf16)
            .with_kv_dtype(DType::E4m3);
        let x = crate::inputs::random_inputs(&p, 5).unwrap();
        let f = x.fp8.as_ref().unwrap();
        assert!(f.kv_only);
        assert_eq!((f.scales[0].len(), f.scales[1].len()), (0, 2 * 2));
        assert!(x.bits[1].iter().all(|&c| c <= 0xff));
        assert_eq!(f.unquantized[0], x.values[0]);
        let e = crate::check::tolerance_for(&p, &x, &[]).unwrap().0;
        assert_eq!(e.rel, 5e-3);
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
