//! `forward` from several threads, each on its own stream, gives bit-identical results to
//! serial runs of the same inputs, for every GPU backend.

mod common;

use sdpa::check::{fresh_seed, random_inputs};
use sdpa::{Backend, Device, Problem, Tensor};

fn run(dev: &Device, p: &Problem, b: Backend, seed: u64) -> Vec<u16> {
    let [q, k, v] = random_inputs(p, seed).upload(dev, p.dtype).unwrap();
    let mut out = Tensor::poisoned(dev, p.dtype, p.q_len().unwrap()).unwrap();
    // Several calls back to back on this stream, so the threads' kernels overlap in time.
    for _ in 0..4 {
        sdpa::forward(dev, p, b, &q, &k, &v, &mut out).unwrap();
    }
    out.to_bits(dev).unwrap()
}

#[test]
fn threads_on_separate_streams_match_serial_runs() {
    let Some(dev) = common::device("concurrency") else {
        return;
    };
    let seed = fresh_seed();
    let jobs: Vec<(Problem, Backend)> = Backend::GPU
        .iter()
        .flat_map(|&b| {
            [
                (Problem::new(2, 4, 300, 300, 64).with_causal(true), b),
                (Problem::new(1, 8, 257, 513, 128).with_kv_heads(2), b),
            ]
        })
        .filter(|(p, b)| b.supports(Some(&dev), p).is_ok())
        .collect();
    let serial: Vec<Vec<u16>> = jobs
        .iter()
        .enumerate()
        .map(|(i, (p, b))| run(&dev, p, *b, seed + i as u64))
        .collect();
    let parallel: Vec<Vec<u16>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(i, (p, b))| {
                let dev = dev.fork().unwrap();
                s.spawn(move || run(&dev, p, *b, seed + i as u64))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (p, b)) in jobs.iter().enumerate() {
        assert!(
            serial[i] == parallel[i],
            "{b} on {p}: threaded result differs from serial"
        );
    }
}
