//! Property test over Problem construction and argument checking: whatever the fields, nothing
//! panics, and a problem that validates is internally consistent (its strides address exactly
//! its tensors). Bounded (a few thousand cases) so it runs in CI.

use proptest::prelude::*;
use sdpa::{Backend, DType, Layout, Problem};

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        1usize..300,
        Just(1 << 20),
        Just(1 << 31),
        Just(usize::MAX / 3),
        Just(usize::MAX),
        any::<usize>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn checking_never_panics(
        b in dim(), h in dim(), kvh in dim(), sq in dim(), sk in dim(), d in dim(),
        causal in any::<bool>(), scale in prop::option::of(any::<f32>()),
        bf16 in any::<bool>(), bshd in any::<bool>(),
    ) {
        let mut p = Problem::new(b, h, sq, sk, d)
            .with_kv_heads(kvh)
            .with_causal(causal)
            .with_dtype(if bf16 { DType::Bf16 } else { DType::F16 })
            .with_layout(if bshd { Layout::Bshd } else { Layout::Bhsd });
        p.scale = scale;
        let valid = p.validate();
        for backend in Backend::ALL {
            let _ = backend.supports(None, &p);
            let _ = backend.resolve(None, &p);
        }
        let _ = p.to_string();
        if valid.is_ok() {
            let (ql, kl) = (p.q_len().unwrap(), p.kv_len().unwrap());
            let (qs, ks) = (p.q_strides(), p.kv_strides());
            prop_assert_eq!(qs.offset(b - 1, h - 1, sq - 1, d - 1), ql - 1);
            prop_assert_eq!(ks.offset(b - 1, kvh - 1, sk - 1, d - 1), kl - 1);
            prop_assert!(p.scale().is_finite() && p.scale() > 0.0);
            prop_assert!(p.flops() >= 0.0);
            prop_assert!(p.visible_keys(sq - 1) <= sk);
        }
    }

    #[test]
    fn names_never_panic(s in ".{0,12}") {
        let _ = s.parse::<Backend>();
        let _ = s.parse::<DType>();
        let _ = s.parse::<Layout>();
        let _ = sdpa::named_problem(&s);
    }
}
