//! How the processes of a ring find each other: the rank environment torchrun (and Slurm
//! wrappers, and `mpirun` scripts that mimic it) sets, and a TCP exchange in which rank 0 hands
//! its NCCL unique id to every other rank.
//!
//! Rank 0 listens on `MASTER_ADDR`:`port`; every other rank connects (retrying until the
//! deadline: rank 0 may start last) and says who it is: its rank, the world size, and a
//! fingerprint of what it was started to do. Once all have arrived rank 0 checks them (each
//! rank once, one world size, one fingerprint) and answers every rank with the id or with why
//! not, so that every rank fails with the same typed error rather than some waiting forever.
//! Each read, write and the whole exchange have the deadline.
//!
//! The port: torchrun's own store already listens on `MASTER_PORT`, so the ring takes
//! `MASTER_PORT + 1` unless `SDPA_RING_PORT` names one.

use super::error::DistError;
use super::nccl::Deadline;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// What a process of the ring is: its rank among `world`, the GPU it uses, and where rank 0
/// listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// How many processes (GPUs) the ring has.
    pub world: usize,
    /// This process's GPU ordinal on its node.
    pub local_rank: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// The port rank 0 listens on for the rendezvous.
    pub port: u16,
}

impl RankEnv {
    /// From the process environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default: `RANK`),
    /// `MASTER_ADDR`, `MASTER_PORT` (the rendezvous uses `MASTER_PORT + 1`, or `SDPA_RING_PORT`).
    pub fn from_env() -> Result<RankEnv, DistError> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// As [`RankEnv::from_env`], reading variables through `var`.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv, DistError> {
        let get = |k: &str| {
            var(k).ok_or_else(|| {
                DistError::Env(format!(
                    "{k} is not set (launch with torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, \
                     MASTER_ADDR and MASTER_PORT)"
                ))
            })
        };
        fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, DistError> {
            v.trim()
                .parse()
                .map_err(|_| DistError::Env(format!("{k}={v:?} is not a non-negative integer")))
        }
        let rank: usize = num("RANK", &get("RANK")?)?;
        let world: usize = num("WORLD_SIZE", &get("WORLD_SIZE")?)?;
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", &v)?,
            None => rank,
        };
        if world == 0 || rank >= world {
            return Err(DistError::Env(format!(
                "RANK={rank} is not below WORLD_SIZE={world}"
            )));
        }
        let master_addr = get("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(DistError::Env("MASTER_ADDR is empty".into()));
        }
        let port = match var("SDPA_RING_PORT") {
            Some(p) => num::<u16>("SDPA_RING_PORT", &p)?,
            None => {
                let m: u16 = num("MASTER_PORT", &get("MASTER_PORT")?)?;
                m.checked_add(1).ok_or_else(|| {
                    DistError::Env(
                        "MASTER_PORT=65535 leaves no port above it; set SDPA_RING_PORT".into(),
                    )
                })?
            }
        };
        Ok(RankEnv {
            rank,
            world,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            port,
        })
    }
}

/// Greeting of a rank to rank 0: magic, protocol version.
const MAGIC: &[u8; 8] = b"sdpaRNG1";
/// What a greeting and an answer hold beyond the magic.
const HELLO_LEN: usize = 8 + 8 + 8 + 8;
const OK: u8 = 0;
const REFUSED: u8 = 1;
/// Longest refusal message read (a peer cannot make a rank allocate more).
const MAX_MESSAGE: usize = 64 * 1024;
/// How long past its own deadline a rank waits for rank 0's answer (at most its timeout again).
const ANSWER_GRACE: Duration = Duration::from_secs(10);

/// Rank 0's NCCL unique id, given to every rank of `env.world`. Rank 0 makes it with `make_id`
/// once every other rank has arrived and agreed; the others receive it. `fingerprint` must be
/// equal on every rank (what each was started to do); a rank that is missing, or that differs,
/// ends the exchange on every rank that took part with an error, within `timeout`.
pub fn exchange_id(
    env: &RankEnv,
    fingerprint: u64,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; 128], DistError>,
) -> Result<[u8; 128], DistError> {
    let deadline = Deadline::after(timeout);
    if env.rank == 0 {
        host(env, fingerprint, deadline, make_id)
    } else {
        join(env, fingerprint, deadline)
    }
}

struct Peer {
    stream: TcpStream,
    rank: usize,
}

/// Rank 0: accept the other ranks, check them, answer all.
fn host(
    env: &RankEnv,
    fingerprint: u64,
    deadline: Deadline,
    make_id: impl FnOnce() -> Result<[u8; 128], DistError>,
) -> Result<[u8; 128], DistError> {
    let listener = TcpListener::bind(("0.0.0.0", env.port)).map_err(|e| {
        DistError::Rendezvous(format!("rank 0 cannot listen on port {}: {e}", env.port))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| DistError::Rendezvous(format!("listener: {e}")))?;
    let mut peers: Vec<Peer> = Vec::new();
    let mut problem: Option<String> = None;
    while peers.len() + 1 < env.world {
        match listener.accept() {
            Ok((stream, from)) => match greeting(stream, deadline) {
                Ok((stream, hello)) => {
                    if let Some(p) = check_hello(&hello, env.world, fingerprint, &peers) {
                        problem.get_or_insert(format!("{p} (from {from})"));
                    }
                    peers.push(Peer {
                        stream,
                        rank: hello.rank,
                    });
                }
                // Not a rank of ours (a port scanner, a stale process): ignore it.
                Err(_) => continue,
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if deadline.passed() {
                    let mut missing: Vec<usize> = (1..env.world)
                        .filter(|r| !peers.iter().any(|p| p.rank == *r))
                        .collect();
                    missing.truncate(16);
                    let e = deadline.timeout(&format!(
                        "rank 0 waiting for rank(s) {missing:?} of {} to connect",
                        env.world
                    ));
                    refuse_all(&mut peers, &e.to_string(), deadline);
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(DistError::Rendezvous(format!("accept: {e}")));
            }
        }
    }
    if let Some(p) = problem {
        let e = DistError::Mismatch(p);
        refuse_all(&mut peers, &e.to_string(), deadline);
        return Err(e);
    }
    let id = match make_id() {
        Ok(id) => id,
        Err(e) => {
            refuse_all(
                &mut peers,
                &format!("rank 0 could not make the NCCL id: {e}"),
                deadline,
            );
            return Err(e);
        }
    };
    for p in &mut peers {
        let mut answer = vec![OK];
        answer.extend_from_slice(&id);
        // A rank that left now fails NCCL's own setup, under its deadline; not here.
        let _ = write_all(&mut p.stream, &answer, deadline);
    }
    Ok(id)
}

/// What a rank says when it arrives.
struct Hello {
    rank: usize,
    world: usize,
    fingerprint: u64,
}

fn greeting(mut stream: TcpStream, deadline: Deadline) -> Result<(TcpStream, Hello), DistError> {
    stream
        .set_nonblocking(false)
        .map_err(|e| DistError::Rendezvous(e.to_string()))?;
    let mut buf = [0u8; HELLO_LEN];
    read_exact(&mut stream, &mut buf, deadline)?;
    if &buf[..8] != MAGIC {
        return Err(DistError::Rendezvous("not a ring rank".into()));
    }
    let word = |i: usize| u64::from_le_bytes(buf[8 * i..8 * i + 8].try_into().unwrap());
    Ok((
        stream,
        Hello {
            rank: word(1) as usize,
            world: word(2) as usize,
            fingerprint: word(3),
        },
    ))
}

/// Why `hello` does not fit the ring rank 0 runs, if it does not.
fn check_hello(h: &Hello, world: usize, fingerprint: u64, peers: &[Peer]) -> Option<String> {
    if h.world != world {
        return Some(format!(
            "rank {} was started with WORLD_SIZE={}, rank 0 with {world}",
            h.rank, h.world
        ));
    }
    if h.rank == 0 || h.rank >= world {
        return Some(format!("a second process says it is rank {}", h.rank));
    }
    if peers.iter().any(|p| p.rank == h.rank) {
        return Some(format!("two processes say they are rank {}", h.rank));
    }
    if h.fingerprint != fingerprint {
        return Some(format!(
            "rank {} was started for another problem (fingerprint {:016x}, rank 0's {fingerprint:016x})",
            h.rank, h.fingerprint
        ));
    }
    None
}

fn refuse_all(peers: &mut [Peer], why: &str, deadline: Deadline) {
    let why = &why.as_bytes()[..why.len().min(MAX_MESSAGE)];
    for p in peers {
        let mut answer = vec![REFUSED];
        answer.extend_from_slice(&(why.len() as u64).to_le_bytes());
        answer.extend_from_slice(why);
        let _ = write_all(&mut p.stream, &answer, deadline);
    }
}

/// Every other rank: connect (until the deadline), greet, read the answer.
fn join(env: &RankEnv, fingerprint: u64, deadline: Deadline) -> Result<[u8; 128], DistError> {
    let target = format!("{}:{}", env.master_addr, env.port);
    let mut stream = loop {
        let addrs: Vec<SocketAddr> = target
            .to_socket_addrs()
            .map_err(|e| DistError::Rendezvous(format!("MASTER_ADDR {target}: {e}")))?
            .collect();
        let attempt = Duration::from_secs(1).min(deadline.left().max(Duration::from_millis(1)));
        if let Some(s) = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, attempt).ok())
        {
            break s;
        }
        if deadline.passed() {
            return Err(deadline.timeout(&format!(
                "rank {} connecting to rank 0 at {target}",
                env.rank
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut hello = MAGIC.to_vec();
    for w in [env.rank as u64, env.world as u64, fingerprint] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    write_all(&mut stream, &hello, deadline)?;
    // Rank 0 answers by its own deadline, which may have started after this rank's: a while
    // past ours, its answer (which ranks never came) is still worth waiting for.
    let deadline = deadline.extended(ANSWER_GRACE.min(deadline.limit()));
    let mut status = [0u8; 1];
    read_exact(&mut stream, &mut status, deadline).map_err(|e| match e {
        DistError::Timeout { .. } => deadline.timeout(&format!(
            "rank {} waiting for rank 0's answer (other ranks missing?)",
            env.rank
        )),
        e => e,
    })?;
    match status[0] {
        OK => {
            let mut id = [0u8; 128];
            read_exact(&mut stream, &mut id, deadline)?;
            Ok(id)
        }
        REFUSED => {
            let mut len = [0u8; 8];
            read_exact(&mut stream, &mut len, deadline)?;
            let len = (u64::from_le_bytes(len) as usize).min(MAX_MESSAGE);
            let mut why = vec![0u8; len];
            read_exact(&mut stream, &mut why, deadline)?;
            let why = String::from_utf8_lossy(&why);
            Err(DistError::Rendezvous(format!(
                "rank 0 ended the rendezvous: {why}"
            )))
        }
        s => Err(DistError::Rendezvous(format!(
            "rank 0 answered {s}, not a ring rank's answer"
        ))),
    }
}

fn io_error(e: std::io::Error, deadline: Deadline, what: &str) -> DistError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => deadline.timeout(what),
        std::io::ErrorKind::UnexpectedEof => {
            DistError::Rendezvous(format!("{what}: the other side closed the connection"))
        }
        _ => DistError::Rendezvous(format!("{what}: {e}")),
    }
}

fn read_exact(s: &mut TcpStream, buf: &mut [u8], deadline: Deadline) -> Result<(), DistError> {
    let left = deadline.left().max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))
        .map_err(|e| io_error(e, deadline, "reading"))?;
    s.read_exact(buf)
        .map_err(|e| io_error(e, deadline, "reading from a rank"))
}

fn write_all(s: &mut TcpStream, buf: &[u8], deadline: Deadline) -> Result<(), DistError> {
    let left = deadline.left().max(Duration::from_millis(1));
    s.set_write_timeout(Some(left))
        .map_err(|e| io_error(e, deadline, "writing"))?;
    s.write_all(buf)
        .map_err(|e| io_error(e, deadline, "writing to a rank"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

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
                port: 29501
            }
        );
        let mut v = TORCHRUN.to_vec();
        v.push(("SDPA_RING_PORT", "4000"));
        assert_eq!(RankEnv::from_vars(&vars(&v)).unwrap().port, 4000);
    }

    #[test]
    fn bad_environments_are_typed_errors() {
        let without = |k: &str| -> Vec<(&str, &str)> {
            TORCHRUN.iter().copied().filter(|(n, _)| *n != k).collect()
        };
        let err = |v: &[(&str, &str)]| RankEnv::from_vars(&vars(v)).unwrap_err().to_string();
        assert!(err(&without("RANK")).contains("RANK is not set"));
        assert!(err(&without("MASTER_ADDR")).contains("MASTER_ADDR is not set"));
        let mut v = without("WORLD_SIZE");
        v.push(("WORLD_SIZE", "3"));
        assert!(
            err(&v).contains("RANK=3 is not below WORLD_SIZE=3"),
            "{}",
            err(&v)
        );
        let mut v = without("RANK");
        v.push(("RANK", "-1"));
        assert!(
            err(&v).contains("RANK=\"-1\" is not a non-negative integer"),
            "{}",
            err(&v)
        );
        let mut v = without("MASTER_PORT");
        v.push(("MASTER_PORT", "65535"));
        assert!(err(&v).contains("SDPA_RING_PORT"), "{}", err(&v));
        // LOCAL_RANK defaults to RANK (one GPU a node, or a launcher that does not set it).
        let e = RankEnv::from_vars(&vars(&without("LOCAL_RANK"))).unwrap();
        assert_eq!(e.local_rank, 3);
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
        }
    }

    /// Runs `world` ranks on threads, rank r with `fingerprints[r]`; returns each one's result.
    fn run(
        world: usize,
        fingerprints: &[u64],
        skip: &[usize],
        timeout: Duration,
    ) -> Vec<Option<Result<[u8; 128], DistError>>> {
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
        let t0 = std::time::Instant::now();
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
        let t0 = std::time::Instant::now();
        let out = run(2, &[1; 2], &[0], Duration::from_millis(800));
        assert!(t0.elapsed() < Duration::from_secs(10));
        let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, DistError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("rank 1 connecting to rank 0"), "{e}");
    }
}
