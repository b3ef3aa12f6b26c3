//! The rendezvous: the rank environment, rings that meet, rings that fail together, and the
//! hostile-input catalogue (a client without the token, forged, replayed and garbage
//! greetings, slow and silent connections, peers that leave, huge worlds, a fake rank 0), each
//! ending within its timeout with a typed error naming the cause. CPU only: threads and
//! loopback TCP.

use super::*;
use crate::distributed::handshake::{self, HELLO_LEN};
use std::collections::HashMap;
use std::net::TcpStream;
use std::thread::JoinHandle;
use std::time::Instant;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

const TOKEN: &str = "a test token, 0123456789abcdef";

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "3"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("MASTER_ADDR", "node0"),
    ("MASTER_PORT", "29500"),
    ("SDPA_RING_TOKEN", TOKEN),
];

fn token(t: &str) -> RingAuth {
    RingAuth::Token(RingToken::new(t).unwrap())
}

#[test]
fn torchrun_environment_is_read() {
    let e = RankEnv::from_vars(&vars(TORCHRUN)).unwrap();
    assert_eq!(
        e,
        RankEnv {
            rank: 3,
            world: 8,
            local_rank: 1,
            master_addr: "node0".into(),
            port: 29501,
            auth: token(TOKEN),
        }
    );
    let mut v = TORCHRUN.to_vec();
    v.push(("SDPA_RING_PORT", "4000"));
    assert_eq!(RankEnv::from_vars(&vars(&v)).unwrap().port, 4000);
    // The token is not printed.
    assert!(!format!("{e:?}").contains(TOKEN), "{e:?}");
}

fn without(k: &str) -> Vec<(&'static str, &'static str)> {
    TORCHRUN.iter().copied().filter(|(n, _)| *n != k).collect()
}

fn env_err(v: &[(&str, &str)]) -> String {
    let e = RankEnv::from_vars(&vars(v)).unwrap_err();
    assert!(matches!(e, DistError::Env(_)), "{e:?}");
    e.to_string()
}

#[test]
fn bad_environments_are_typed_errors() {
    assert!(env_err(&without("RANK")).contains("RANK is not set"));
    assert!(env_err(&without("MASTER_ADDR")).contains("MASTER_ADDR is not set"));
    let mut v = without("WORLD_SIZE");
    v.push(("WORLD_SIZE", "3"));
    let e = env_err(&v);
    assert!(e.contains("RANK=3 is not below WORLD_SIZE=3"), "{e}");
    let mut v = without("RANK");
    v.push(("RANK", "-1"));
    let e = env_err(&v);
    assert!(
        e.contains("RANK=\"-1\" is not a non-negative integer"),
        "{e}"
    );
    let mut v = without("MASTER_PORT");
    v.push(("MASTER_PORT", "65535"));
    assert!(env_err(&v).contains("SDPA_RING_PORT"));
    // LOCAL_RANK defaults to RANK (one GPU a node, or a launcher that does not set it).
    let e = RankEnv::from_vars(&vars(&without("LOCAL_RANK"))).unwrap();
    assert_eq!(e.local_rank, 3);
}

#[test]
fn a_ring_without_a_token_is_refused_unless_it_opts_out_on_loopback() {
    let e = env_err(&without("SDPA_RING_TOKEN"));
    assert!(
        e.contains("SDPA_RING_TOKEN is not set") && e.contains("SDPA_RING_INSECURE=1"),
        "{e}"
    );
    let mut v = without("SDPA_RING_TOKEN");
    v.push(("SDPA_RING_TOKEN", "short"));
    let e = env_err(&v);
    assert!(e.contains("5 bytes, fewer than 16"), "{e}");
    // The opt-out: only for a loopback MASTER_ADDR.
    let mut v = without("SDPA_RING_TOKEN");
    v.retain(|(k, _)| *k != "MASTER_ADDR");
    v.push(("SDPA_RING_INSECURE", "1"));
    for addr in ["127.0.0.1", "::1", "[::1]"] {
        let mut v = v.clone();
        v.push(("MASTER_ADDR", addr));
        let e = RankEnv::from_vars(&vars(&v)).unwrap();
        assert_eq!(e.auth, RingAuth::Insecure, "{addr}");
    }
    let mut v2 = v.clone();
    v2.push(("MASTER_ADDR", "192.0.2.7"));
    let e = env_err(&v2);
    assert!(
        e.contains("192.0.2.7 is 192.0.2.7: set SDPA_RING_TOKEN"),
        "{e}"
    );
    // A ring of one listens nowhere and needs none.
    let one = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];
    assert_eq!(
        RankEnv::from_vars(&vars(&one)).unwrap().auth,
        RingAuth::Insecure
    );
    // Given directly, an insecure env with a routable address is refused before listening.
    let env = RankEnv {
        master_addr: "192.0.2.7".into(),
        auth: RingAuth::Insecure,
        ..rank(0, 2, port())
    };
    let e = exchange_id(&env, 1, Duration::from_secs(5), || Ok([1; 128])).unwrap_err();
    assert!(matches!(e, DistError::Env(_)), "{e}");
}

/// A free port on the loopback interface.
fn port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn rank(r: usize, world: usize, port: u16) -> RankEnv {
    RankEnv {
        rank: r,
        world,
        local_rank: r,
        master_addr: "127.0.0.1".into(),
        port,
        auth: token(TOKEN),
    }
}

type Outcome = Result<[u8; 128], DistError>;

/// Rank `r` of `world` on a thread, after `delay`.
fn spawn_rank(
    env: RankEnv,
    fp: u64,
    timeout: Duration,
    delay: Duration,
) -> JoinHandle<(Outcome, Duration)> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let t0 = Instant::now();
        let r = exchange_id(&env, fp, timeout, || Ok([7u8; 128]));
        (r, t0.elapsed())
    })
}

/// Runs `world` ranks on threads, rank r with `fingerprints[r]`; returns each one's result.
fn run(
    world: usize,
    fingerprints: &[u64],
    skip: &[usize],
    timeout: Duration,
) -> Vec<Option<Outcome>> {
    let p = port();
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let fp = fingerprints[r];
            let run = !skip.contains(&r);
            std::thread::spawn(move || {
                run.then(|| exchange_id(&rank(r, world, p), fp, timeout, || Ok([7u8; 128])))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn every_rank_gets_rank_zeros_id() {
    let out = run(4, &[9; 4], &[], Duration::from_secs(20));
    for (r, o) in out.into_iter().enumerate() {
        assert_eq!(o.unwrap().unwrap(), [7u8; 128], "rank {r}");
    }
    // A ring of one needs no other process.
    let one = exchange_id(&rank(0, 1, port()), 1, Duration::from_secs(1), || {
        Ok([1; 128])
    });
    assert_eq!(one.unwrap(), [1; 128]);
}

#[test]
fn a_ring_without_a_token_meets_on_loopback() {
    let p = port();
    let env = |r| RankEnv {
        auth: RingAuth::Insecure,
        master_addr: "localhost".into(),
        ..rank(r, 2, p)
    };
    let t = Duration::from_secs(20);
    let h = [
        spawn_rank(env(0), 3, t, Duration::ZERO),
        spawn_rank(env(1), 3, t, Duration::ZERO),
    ];
    for h in h {
        assert_eq!(h.join().unwrap().0.unwrap(), [7; 128]);
    }
}

/// `Duration::MAX` means no limit (it overflowed `Instant` and panicked before).
#[test]
fn a_timeout_of_duration_max_is_no_limit() {
    let out = run(2, &[4; 2], &[], Duration::MAX);
    for o in out {
        assert_eq!(o.unwrap().unwrap(), [7; 128]);
    }
}

#[test]
fn a_rank_started_for_another_problem_fails_every_rank() {
    let out = run(3, &[5, 5, 6], &[], Duration::from_secs(20));
    for (r, o) in out.into_iter().enumerate() {
        let e = o.unwrap().unwrap_err().to_string();
        assert!(
            e.contains("rank 2 was started for another problem"),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn a_missing_rank_fails_the_others_within_the_timeout() {
    let t0 = Instant::now();
    let out = run(3, &[1; 3], &[2], Duration::from_millis(1500));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let e0 = out[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e0, DistError::Timeout { .. }), "{e0}");
    assert!(e0.to_string().contains("rank(s) [2] of 3"), "{e0}");
    let e1 = out[1].as_ref().unwrap().as_ref().unwrap_err().to_string();
    assert!(e1.contains("rank(s) [2] of 3"), "rank 1 hears why: {e1}");
}

#[test]
fn without_rank_zero_the_others_time_out() {
    let t0 = Instant::now();
    let out = run(2, &[1; 2], &[0], Duration::from_millis(800));
    assert!(t0.elapsed() < Duration::from_secs(10));
    let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e, DistError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("rank 1 connecting to rank 0"), "{e}");
}

// The hostile-input catalogue. Timeouts are a few hundred milliseconds where a test waits for
// one to run out; the bounds on elapsed time add seconds of grace for a loaded CI machine, far
// below what the attack held a rank for before (the length of the attack).

/// Slack for a loaded machine on top of a deadline.
const GRACE: Duration = Duration::from_secs(3);
/// Long enough for a success case never to time out; such a test ends once the ring meets.
const GENEROUS: Duration = Duration::from_secs(30);

/// A client that connects to rank 0 at `port` (retrying until it listens) and returns the
/// stream.
fn connect(port: u16) -> TcpStream {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return s;
        }
        assert!(t0.elapsed() < GRACE, "rank 0 never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Everything `s` receives until it closes or nothing comes for `quiet`.
fn drain(s: &mut TcpStream, quiet: Duration) -> Vec<u8> {
    s.set_read_timeout(Some(quiet)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// Rank 0's challenge on a fresh connection: its nonce.
fn challenged(s: &mut TcpStream) -> Nonce {
    let mut c = [0u8; CHALLENGE_LEN];
    s.set_read_timeout(Some(GRACE)).unwrap();
    s.read_exact(&mut c).unwrap();
    handshake::read_challenge(&c).expect("a challenge")
}

/// A greeting as rank `r` of `world` would send it, under `auth`, for challenge `n0`.
fn greeting(auth: &RingAuth, n0: &Nonce, r: u64, world: u64, fp: u64) -> [u8; HELLO_LEN] {
    let h = Hello {
        rank: r,
        world,
        fingerprint: fp,
        nonce: [9; 32],
    };
    handshake::hello(&Key::of(auth), n0, &h)
}

/// A client without the token connects first and claims rank 1 (greetings' fields are public):
/// it gets no id, and the real rank 1 still joins.
#[test]
fn a_client_without_the_token_gets_nothing() {
    let p = port();
    let rank0 = spawn_rank(rank(0, 2, p), 5, GENEROUS, Duration::ZERO);
    // Without a token, and with a guessed one.
    for auth in [RingAuth::Insecure, token("a guessed token, 0000000000")] {
        let mut spoof = connect(p);
        let n0 = challenged(&mut spoof);
        spoof.write_all(&greeting(&auth, &n0, 1, 2, 5)).unwrap();
        let heard = drain(&mut spoof, Duration::from_secs(2));
        assert_eq!(heard, [REJECTED], "all a spoofer hears: refused");
    }
    let rank1 = spawn_rank(rank(1, 2, p), 5, GENEROUS, Duration::ZERO);
    assert_eq!(rank1.join().unwrap().0.unwrap(), [7; 128]);
    assert_eq!(rank0.join().unwrap().0.unwrap(), [7; 128]);
}

/// Garbage, a greeting whose MAC is wrong (another token; it claims a world size that would
/// end the ring with a mismatch if believed), and a greeting replayed from another connection:
/// each is dropped, the real ranks still meet.
#[test]
fn forged_and_replayed_greetings_are_dropped() {
    let p = port();
    let world = 3;
    let rank0 = spawn_rank(rank(0, world, p), 5, GENEROUS, Duration::ZERO);
    let mut junk = connect(p);
    junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut forged = connect(p);
    let n0 = challenged(&mut forged);
    forged
        .write_all(&greeting(&token("another ring's token!!"), &n0, 2, 99, 5))
        .unwrap();
    // A greeting made with the token for one connection, sent on another.
    let mut first = connect(p);
    let n_first = challenged(&mut first);
    let recorded = greeting(&token(TOKEN), &n_first, 2, 3, 5);
    drop(first);
    let mut replay = connect(p);
    challenged(&mut replay);
    replay.write_all(&recorded).unwrap();
    assert_eq!(drain(&mut forged, Duration::from_secs(2)), [REJECTED]);
    assert_eq!(drain(&mut replay, Duration::from_secs(2)), [REJECTED]);
    let h: Vec<_> = (1..world)
        .map(|r| spawn_rank(rank(r, world, p), 5, GENEROUS, Duration::ZERO))
        .collect();
    for h in h {
        assert_eq!(h.join().unwrap().0.unwrap(), [7; 128]);
    }
    assert_eq!(rank0.join().unwrap().0.unwrap(), [7; 128]);
}

/// A client that sends `bytes` one every `every` (until rank 0 closes, or 20 s), on a thread.
fn trickle(port: u16, bytes: Vec<u8>, every: Duration) -> JoinHandle<()> {
    let mut s = connect(port);
    std::thread::spawn(move || {
        let t0 = Instant::now();
        for b in bytes.into_iter().cycle() {
            if s.write_all(&[b]).is_err() || t0.elapsed() > Duration::from_secs(20) {
                return;
            }
            std::thread::sleep(every);
        }
    })
}

/// What a slow sender sends: this protocol's magic, then zeros.
fn slow_bytes() -> Vec<u8> {
    let mut b = handshake::MAGIC.to_vec();
    b.resize(HELLO_LEN, 0);
    b
}

/// A connection that sends its greeting a byte at a time (each byte within any per-read
/// timeout) holds nothing up: the real rank joins meanwhile; alone, rank 0 ends by its
/// deadline and says so.
#[test]
fn a_slow_sender_holds_nothing_up() {
    let every = Duration::from_millis(150);
    let p = port();
    let rank0 = spawn_rank(rank(0, 2, p), 5, GENEROUS, Duration::ZERO);
    let _slow = trickle(p, slow_bytes(), every);
    let rank1 = spawn_rank(rank(1, 2, p), 5, GENEROUS, Duration::from_millis(100));
    let (r1, t1) = rank1.join().unwrap();
    assert_eq!(r1.unwrap(), [7; 128]);
    assert_eq!(rank0.join().unwrap().0.unwrap(), [7; 128]);
    // The slow greeting takes 96 x 150 ms; rank 1 did not wait for it.
    assert!(t1 < GRACE, "{t1:?}");

    let timeout = Duration::from_millis(400);
    let p = port();
    let rank0 = spawn_rank(rank(0, 2, p), 5, timeout, Duration::ZERO);
    let _slow = trickle(p, slow_bytes(), every);
    let (r0, t0) = rank0.join().unwrap();
    let e = r0.unwrap_err();
    assert!(t0 < timeout + GRACE, "rank 0 took {t0:?}");
    assert!(matches!(e, DistError::Timeout { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("rank(s) [1] of 2") && e.contains("1 still sending their greeting"),
        "{e}"
    );
}

/// A connection that sends nothing holds nothing up either.
#[test]
fn an_idle_connection_holds_nothing_up() {
    let p = port();
    let rank0 = spawn_rank(rank(0, 2, p), 5, GENEROUS, Duration::ZERO);
    let _idle = connect(p);
    let rank1 = spawn_rank(rank(1, 2, p), 5, GENEROUS, Duration::from_millis(100));
    let (r1, t1) = rank1.join().unwrap();
    assert_eq!(r1.unwrap(), [7; 128]);
    assert!(t1 < GRACE, "{t1:?}");
    assert_eq!(rank0.join().unwrap().0.unwrap(), [7; 128]);

    let timeout = Duration::from_millis(400);
    let p = port();
    let rank0 = spawn_rank(rank(0, 3, p), 5, timeout, Duration::ZERO);
    let _idle = connect(p);
    let (r0, t0) = rank0.join().unwrap();
    assert!(t0 < timeout + GRACE, "rank 0 took {t0:?}");
    let e = r0.unwrap_err();
    assert!(matches!(e, DistError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("rank(s) [1, 2] of 3"), "{e}");
}

/// More idle connections than rank 0 keeps greeting at once: the oldest are shed (its file
/// descriptors stay bounded), the real rank still joins.
#[test]
fn a_flood_of_connections_holds_nothing_up() {
    let p = port();
    let rank0 = spawn_rank(rank(0, 2, p), 5, GENEROUS, Duration::ZERO);
    let flood: Vec<TcpStream> = (0..2 * MAX_PENDING).map(|_| connect(p)).collect();
    let (r1, t1) = spawn_rank(rank(1, 2, p), 5, GENEROUS, Duration::ZERO)
        .join()
        .unwrap();
    assert_eq!(r1.unwrap(), [7; 128]);
    assert!(t1 < GRACE, "{t1:?}");
    assert_eq!(rank0.join().unwrap().0.unwrap(), [7; 128]);
    drop(flood);
}

/// A rank that greets and then goes away before its answer is not counted: rank 0 does not
/// return Ok for a ring one of whose ranks will never take the id.
#[test]
fn a_rank_that_left_is_not_counted() {
    let timeout = Duration::from_millis(800);
    let p = port();
    let rank0 = spawn_rank(rank(0, 3, p), 5, timeout, Duration::ZERO);
    let mut gone = connect(p);
    let n0 = challenged(&mut gone);
    gone.write_all(&greeting(&token(TOKEN), &n0, 1, 3, 5))
        .unwrap();
    // Rank 0 has taken the greeting (a refused one would be answered at once).
    std::thread::sleep(Duration::from_millis(50));
    drop(gone);
    let rank2 = spawn_rank(rank(2, 3, p), 5, timeout, Duration::from_millis(100));
    let (r0, t0) = rank0.join().unwrap();
    assert!(t0 < timeout + GRACE, "rank 0 took {t0:?}");
    let e = r0.unwrap_err();
    assert!(matches!(e, DistError::Timeout { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("rank(s) [1] of 3") && e.contains("1 went away"),
        "{e}"
    );
    let e2 = rank2.join().unwrap().0.unwrap_err().to_string();
    assert!(e2.contains("rank(s) [1] of 3"), "rank 2 hears why: {e2}");
}

/// A rank given another token is told at once, and rank 0 says why nobody came.
#[test]
fn a_rank_with_another_token_is_refused_with_the_reason() {
    let timeout = Duration::from_millis(600);
    let p = port();
    let rank0 = spawn_rank(rank(0, 2, p), 5, timeout, Duration::ZERO);
    let other = RankEnv {
        auth: token("not the ring's token at all"),
        ..rank(1, 2, p)
    };
    let (r1, t1) = spawn_rank(other, 5, GENEROUS, Duration::ZERO)
        .join()
        .unwrap();
    let e1 = r1.unwrap_err();
    assert!(matches!(e1, DistError::Unauthenticated(_)), "{e1}");
    assert!(e1.to_string().contains("same SDPA_RING_TOKEN"), "{e1}");
    assert!(t1 < GRACE, "{t1:?}");
    let e0 = rank0.join().unwrap().0.unwrap_err().to_string();
    assert!(e0.contains("1 not authenticated"), "{e0}");
}

/// WORLD_SIZE of 2^40 or usize::MAX is refused at once, from the environment and given
/// directly; the largest ring allowed times out as fast as a small one, naming a few of the
/// ranks that are missing and counting the rest.
#[test]
fn huge_worlds_are_refused_at_once() {
    for w in ["1099511627776", "18446744073709551615", "65537"] {
        let mut v = without("WORLD_SIZE");
        v.push(("WORLD_SIZE", w));
        let e = env_err(&v);
        assert!(e.contains("not a ring size: 1 to 65536"), "{e}");
    }
    for (r, w) in [(0, usize::MAX), (5, 1 << 40), (1, MAX_WORLD + 1)] {
        let t0 = Instant::now();
        let e = exchange_id(&rank(r, w, port()), 1, Duration::from_millis(300), || {
            Ok([0; 128])
        })
        .unwrap_err();
        assert!(matches!(e, DistError::Env(_)), "{e}");
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "{:?}",
            t0.elapsed()
        );
    }
    let timeout = Duration::from_millis(300);
    let (r0, t0) = spawn_rank(rank(0, MAX_WORLD, port()), 1, timeout, Duration::ZERO)
        .join()
        .unwrap();
    assert!(t0 < timeout + GRACE, "{t0:?}");
    let e = r0.unwrap_err().to_string();
    assert!(
        e.contains("rank(s) [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] and 65519 more of 65536"),
        "{e}"
    );
}

/// What a fake rank 0 does on its connection.
enum Fake {
    /// Accepts and says nothing.
    Silent,
    /// Sends a challenge one byte every 50 ms.
    SlowChallenge,
    /// Challenges at once, reads the greeting, then answers one byte every 50 ms.
    SlowAnswer,
    /// Challenges at once and answers OK with an id but a MAC it cannot make.
    ForgedAnswer,
}

/// A fake rank 0 on a thread: listens at a free port (returned) and behaves as `fake` says.
fn fake_rank0(fake: Fake) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let p = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let n0 = [3u8; 32];
        let slowly = |s: &mut TcpStream, bytes: &[u8]| {
            let t0 = Instant::now();
            for b in bytes.iter().cycle() {
                if s.write_all(&[*b]).is_err() || t0.elapsed() > Duration::from_secs(20) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        match fake {
            Fake::Silent => std::thread::sleep(Duration::from_secs(20)),
            Fake::SlowChallenge => slowly(&mut s, &handshake::challenge(&n0)),
            Fake::SlowAnswer | Fake::ForgedAnswer => {
                s.write_all(&handshake::challenge(&n0)).unwrap();
                let mut hello = [0u8; HELLO_LEN];
                if s.read_exact(&mut hello).is_err() {
                    return;
                }
                let mut answer = vec![handshake::OK];
                answer.extend_from_slice(&[7; 128 + 32]);
                if let Fake::SlowAnswer = fake {
                    slowly(&mut s, &answer);
                } else {
                    let _ = s.write_all(&answer);
                    std::thread::sleep(Duration::from_secs(20));
                }
            }
        }
    });
    p
}

/// A joining rank against a fake rank 0 that is silent, slow to challenge, slow to answer, or
/// answers without the token: each ends by the rank's deadline (plus the grace a rank gives
/// rank 0's answer) with a typed error.
#[test]
fn a_joining_rank_against_a_fake_rank_zero() {
    let timeout = Duration::from_millis(300);
    let join = |p: u16| {
        let t0 = Instant::now();
        let r = exchange_id(&rank(1, 2, p), 5, timeout, || unreachable!());
        (r.unwrap_err(), t0.elapsed())
    };
    for (fake, says) in [
        (Fake::Silent, "waiting for rank 0's challenge"),
        (Fake::SlowChallenge, "waiting for rank 0's challenge"),
        (Fake::SlowAnswer, "waiting for rank 0's answer"),
    ] {
        let (e, t) = join(fake_rank0(fake));
        assert!(matches!(e, DistError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains(says), "{e}");
        assert!(t < 2 * timeout + GRACE, "{says}: {t:?}");
    }
    let (e, t) = join(fake_rank0(Fake::ForgedAnswer));
    assert!(matches!(e, DistError::Unauthenticated(_)), "{e}");
    assert!(t < GRACE, "{t:?}");
}
