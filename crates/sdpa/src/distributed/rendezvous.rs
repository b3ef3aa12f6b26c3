//! How the processes of a ring find each other: the rank environment torchrun (and Slurm
//! wrappers, and `mpirun` scripts that mimic it) sets, and a TCP exchange in which rank 0 hands
//! its NCCL unique id to every other rank.
//!
//! Rank 0 listens on `MASTER_ADDR` (the address it names, not every interface) at `port`;
//! every other rank connects (retrying until the deadline: rank 0 may start last), proves that
//! it holds the ring's token and says who it is: its rank, the world size, and a fingerprint of
//! what it was started to do (the messages and their authentication: `handshake`). Once all
//! have arrived rank 0 checks them (each rank once, one world size, one fingerprint) and
//! answers every rank with the id or with why not, so that every rank fails with the same typed
//! error rather than some waiting forever.
//!
//! What rank 0 does not let end the ring: a connection that cannot prove it holds the token (a
//! port scanner, a process of another ring, a forged or replayed greeting), one that sends its
//! greeting slowly or not at all, one that goes away before its answer. Rank 0 drops each and
//! keeps waiting for the real rank, serving every connection at once (non-blocking), so no
//! connection holds up another; its one deadline covers the whole wait. A joining rank's reads
//! and writes are bounded by its deadline as a whole too, not read by read.
//!
//! The token: every rank is given the same secret in `SDPA_RING_TOKEN` (at least
//! [`MIN_TOKEN`] bytes; generate one per job, e.g. `export SDPA_RING_TOKEN=$(openssl rand -hex
//! 32)` before `torchrun`). Without one the rendezvous is refused, unless `SDPA_RING_INSECURE=1`
//! and `MASTER_ADDR` is a loopback address (only processes of this machine can connect then),
//! or the ring has one process (nothing listens).
//!
//! The port: torchrun's own store already listens on `MASTER_PORT`, so the ring takes
//! `MASTER_PORT + 1` unless `SDPA_RING_PORT` names one.

use super::error::DistError;
use super::handshake::{
    self, CHALLENGE_LEN, Greeting, HELLO_LEN, Hello, ID_LEN, Key, MAC_LEN, MAX_MESSAGE, Nonce,
    REJECTED,
};
use super::nccl::Deadline;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The most ranks a ring may have (`WORLD_SIZE`): more than any machine count NCCL runs, few
/// enough that rank 0's bookkeeping of who has arrived stays small.
pub const MAX_WORLD: usize = 1 << 16;

/// The shortest `SDPA_RING_TOKEN`, in bytes: 128 bits, should every byte be random.
pub const MIN_TOKEN: usize = 16;

/// The ring's shared secret. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct RingToken(String);

impl RingToken {
    /// A token of at least [`MIN_TOKEN`] bytes.
    pub fn new(token: &str) -> Result<RingToken, DistError> {
        if token.len() < MIN_TOKEN {
            return Err(DistError::Env(format!(
                "SDPA_RING_TOKEN has {} bytes, fewer than {MIN_TOKEN}: give every rank the same \
                 random secret, e.g. `export SDPA_RING_TOKEN=$(openssl rand -hex 32)`",
                token.len()
            )));
        }
        Ok(RingToken(token.to_string()))
    }
    pub(crate) fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl std::fmt::Debug for RingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RingToken(..)")
    }
}

/// How the ranks of a ring prove to each other that they belong to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingAuth {
    /// Every rank holds this secret (`SDPA_RING_TOKEN`).
    Token(RingToken),
    /// No secret: anyone who can connect to rank 0 can join. Taken only where `MASTER_ADDR` is a
    /// loopback address (checked before listening) or the ring has one process.
    Insecure,
}

/// What a process of the ring is: its rank among `world`, the GPU it uses, where rank 0
/// listens, and the ring's secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// How many processes (GPUs) the ring has, at most [`MAX_WORLD`].
    pub world: usize,
    /// This process's GPU ordinal on its node.
    pub local_rank: usize,
    /// Rank 0's host: the address rank 0 listens on, and the others connect to.
    pub master_addr: String,
    /// The port rank 0 listens on for the rendezvous.
    pub port: u16,
    /// How the ranks authenticate each other.
    pub auth: RingAuth,
}

impl RankEnv {
    /// From the process environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default: `RANK`),
    /// `MASTER_ADDR`, `MASTER_PORT` (the rendezvous uses `MASTER_PORT + 1`, or `SDPA_RING_PORT`),
    /// and `SDPA_RING_TOKEN` (or `SDPA_RING_INSECURE=1` with a loopback `MASTER_ADDR`; see the
    /// module).
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
        check_world(rank, world)?;
        let master_addr = get("MASTER_ADDR")?.trim().to_string();
        if master_addr.is_empty() {
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
        let auth = match var("SDPA_RING_TOKEN") {
            Some(t) => RingAuth::Token(RingToken::new(&t)?),
            None if world == 1 => RingAuth::Insecure,
            None if var("SDPA_RING_INSECURE").is_some_and(|v| v.trim() == "1") => {
                only_loopback(&master_addr, port)?;
                RingAuth::Insecure
            }
            None => {
                return Err(DistError::Env(format!(
                    "SDPA_RING_TOKEN is not set: give every rank the same secret (at least \
                     {MIN_TOKEN} bytes, e.g. `export SDPA_RING_TOKEN=$(openssl rand -hex 32)` \
                     before torchrun), so that no other process can join the ring or take its \
                     NCCL id; on one machine, SDPA_RING_INSECURE=1 with a loopback MASTER_ADDR \
                     runs without one"
                )));
            }
        };
        Ok(RankEnv {
            rank,
            world,
            local_rank,
            master_addr,
            port,
            auth,
        })
    }
}

fn check_world(rank: usize, world: usize) -> Result<(), DistError> {
    if world == 0 || world > MAX_WORLD {
        return Err(DistError::Env(format!(
            "WORLD_SIZE={world} is not a ring size: 1 to {MAX_WORLD} ranks"
        )));
    }
    if rank >= world {
        return Err(DistError::Env(format!(
            "RANK={rank} is not below WORLD_SIZE={world}"
        )));
    }
    Ok(())
}

/// That every address `addr` names is a loopback one, for a ring without a token.
fn only_loopback(addr: &str, port: u16) -> Result<(), DistError> {
    let addrs = resolve(addr, port)
        .map_err(|e| DistError::Env(format!("MASTER_ADDR {addr} does not resolve: {e}")))?;
    match addrs.iter().find(|a| !a.ip().is_loopback()) {
        None if !addrs.is_empty() => Ok(()),
        other => Err(DistError::Env(format!(
            "SDPA_RING_INSECURE=1 runs a ring without a token only on one machine, with a \
             loopback MASTER_ADDR; {addr} is {}: set SDPA_RING_TOKEN instead",
            other.map_or("no address".to_string(), |a| a.ip().to_string())
        ))),
    }
}

/// The socket addresses of `addr` (a name, or an IP address, IPv6 bracketed or not) at `port`.
fn resolve(addr: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    let host = addr
        .strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(addr);
    Ok((host, port).to_socket_addrs()?.collect())
}

/// How long past its own deadline a rank waits for rank 0's answer (at most its timeout again).
const ANSWER_GRACE: Duration = Duration::from_secs(10);
/// How long a connection may take to send its greeting after rank 0's challenge: a rank sends
/// it at once; this lets a loaded machine be slow without letting a silent connection stay.
const GREETING_WINDOW: Duration = Duration::from_secs(10);
/// Connections greeting at once, at most (and accepted per round); past it the oldest is
/// dropped, so a flood of connections cannot exhaust rank 0's file descriptors.
const MAX_PENDING: usize = 64;
/// How long rank 0's answers may take to be written, all together: a few hundred bytes each,
/// which a socket's buffer takes at once unless its peer has gone.
const ANSWER_WRITE: Duration = Duration::from_secs(2);
/// Rank 0's polling period: how stale a wait is at most.
const POLL: Duration = Duration::from_millis(2);
/// Missing ranks named in a timeout, at most (then a count).
const NAMED_MISSING: usize = 16;

/// Rank 0's NCCL unique id, given to every rank of `env.world`. Rank 0 makes it with `make_id`
/// once every other rank has arrived and agreed; the others receive it. `fingerprint` must be
/// equal on every rank (what each was started to do); a rank that is missing, or that differs,
/// ends the exchange on every rank that took part with an error, within `timeout`
/// (`Duration::MAX`: no limit). A connection that is not a rank of this ring (see the module)
/// ends nothing: rank 0 drops it and keeps waiting.
pub fn exchange_id(
    env: &RankEnv,
    fingerprint: u64,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_LEN], DistError>,
) -> Result<[u8; ID_LEN], DistError> {
    check_world(env.rank, env.world)?;
    if env.master_addr.trim().is_empty() {
        return Err(DistError::Env("MASTER_ADDR is empty".into()));
    }
    if env.world == 1 {
        // Nobody to hand the id to: nothing listens.
        return make_id();
    }
    if env.auth == RingAuth::Insecure {
        only_loopback(&env.master_addr, env.port)?;
    }
    let key = Key::of(&env.auth);
    let deadline = Deadline::after(timeout);
    if env.rank == 0 {
        host(env, &key, fingerprint, deadline, make_id)
    } else {
        join(env, &key, fingerprint, deadline)
    }
}

/// A connection rank 0 has challenged and whose greeting it is reading.
struct Pending {
    stream: TcpStream,
    n0: Nonce,
    buf: [u8; HELLO_LEN],
    got: usize,
    greet_by: Deadline,
}

/// A connection that proved it holds the key and said who it is.
struct Peer {
    stream: TcpStream,
    from: SocketAddr,
    n0: Nonce,
    hello: Hello,
}

/// The connections rank 0 dropped while waiting, by why: said in a timeout, so that an attack
/// or a misconfigured rank (another token) shows.
#[derive(Default)]
struct Dropped {
    garbage: usize,
    unauthenticated: usize,
    slow: usize,
    gone: usize,
    flood: usize,
}

impl Dropped {
    /// "; meanwhile ..." or nothing; `greeting`: connections still sending their greeting.
    fn describe(&self, greeting: usize) -> String {
        let parts: Vec<String> = [
            (
                self.unauthenticated,
                "not authenticated (no SDPA_RING_TOKEN, another one, or a replayed greeting)",
            ),
            (self.garbage, "not an sdpa ring rank"),
            (self.slow, "sent no complete greeting in time"),
            (self.gone, "went away"),
            (self.flood, "dropped for newer ones (too many at once)"),
            (greeting, "still sending their greeting at the deadline"),
        ]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, why)| format!("{n} {why}"))
        .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!("; connections not counted: {}", parts.join(", "))
        }
    }
}

/// Rank 0: accept the other ranks, check them, answer all.
fn host(
    env: &RankEnv,
    key: &Key,
    fingerprint: u64,
    deadline: Deadline,
    make_id: impl FnOnce() -> Result<[u8; ID_LEN], DistError>,
) -> Result<[u8; ID_LEN], DistError> {
    let listener = listen(&env.master_addr, env.port)?;
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut peers: Vec<Peer> = Vec::new();
    let mut dropped = Dropped::default();
    loop {
        accept(&listener, &mut pending, &mut dropped)?;
        greetings(key, &mut pending, &mut peers, &mut dropped);
        // A rank that left before its answer is not counted: it will not take the id.
        peers.retain(|p| {
            let alive = quiet(&p.stream);
            dropped.gone += usize::from(!alive);
            alive
        });
        if peers.len() + 1 >= env.world {
            break;
        }
        if deadline.passed() {
            let e = deadline.timeout(&format!(
                "rank 0 waiting for {} to connect{}",
                missing(&peers, env.world),
                dropped.describe(pending.len())
            ));
            refuse_all(key, &mut peers, &e.to_string());
            return Err(e);
        }
        std::thread::sleep(POLL);
    }
    if let Some(p) = disagreement(&peers, env.world, fingerprint) {
        let e = DistError::Mismatch(p);
        refuse_all(key, &mut peers, &e.to_string());
        return Err(e);
    }
    let id = match make_id() {
        Ok(id) => id,
        Err(e) => {
            let why = format!("rank 0 could not make the NCCL id: {e}");
            refuse_all(key, &mut peers, &why);
            return Err(e);
        }
    };
    let by = Deadline::after(ANSWER_WRITE);
    let mut lost = Vec::new();
    for p in &mut peers {
        let answer = handshake::answer_ok(key, &p.n0, &p.hello.nonce, &id);
        if write_by(&mut p.stream, &answer, by).is_err() {
            lost.push(p.hello.rank);
        }
    }
    if !lost.is_empty() {
        // The others now set NCCL up and fail under their own deadline, as they would with a
        // rank that died just after the rendezvous.
        return Err(DistError::Rendezvous(format!(
            "rank(s) {lost:?} went away before they got the NCCL id"
        )));
    }
    Ok(id)
}

/// Rank 0's listener on `MASTER_ADDR` (the first of its addresses that binds), non-blocking.
fn listen(addr: &str, port: u16) -> Result<TcpListener, DistError> {
    let addrs = resolve(addr, port)
        .map_err(|e| DistError::Rendezvous(format!("MASTER_ADDR {addr} does not resolve: {e}")))?;
    let mut tried = Vec::new();
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => {
                l.set_nonblocking(true)
                    .map_err(|e| DistError::Rendezvous(format!("listener on {a}: {e}")))?;
                return Ok(l);
            }
            Err(e) => tried.push(format!("{a}: {e}")),
        }
    }
    Err(DistError::Rendezvous(format!(
        "rank 0 cannot listen on MASTER_ADDR {addr} port {port} ({}); MASTER_ADDR must name an \
         address of rank 0's machine",
        if tried.is_empty() {
            "it names no address".to_string()
        } else {
            tried.join("; ")
        }
    )))
}

/// Accepts the connections waiting (at most [`MAX_PENDING`] a round) and challenges each.
fn accept(
    listener: &TcpListener,
    pending: &mut VecDeque<Pending>,
    dropped: &mut Dropped,
) -> Result<(), DistError> {
    for _ in 0..MAX_PENDING {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Interrupted
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::ConnectionReset
                ) =>
            {
                continue;
            }
            Err(e) => return Err(DistError::Rendezvous(format!("accept: {e}"))),
        };
        let n0 = handshake::nonce()?;
        // Forty bytes into a fresh socket's buffer go at once, or the peer is gone.
        let sent = stream.set_nonblocking(true).is_ok()
            && (&stream).write(&handshake::challenge(&n0)).ok() == Some(CHALLENGE_LEN);
        if !sent {
            dropped.gone += 1;
            continue;
        }
        if pending.len() == MAX_PENDING {
            pending.pop_front();
            dropped.flood += 1;
        }
        pending.push_back(Pending {
            stream,
            n0,
            buf: [0; HELLO_LEN],
            got: 0,
            greet_by: Deadline::after(GREETING_WINDOW),
        });
    }
    Ok(())
}

/// Reads what the pending connections have sent; moves each complete, authenticated greeting
/// to `peers` and drops every connection that failed or ran out of time.
fn greetings(
    key: &Key,
    pending: &mut VecDeque<Pending>,
    peers: &mut Vec<Peer>,
    dropped: &mut Dropped,
) {
    let mut i = 0;
    while i < pending.len() {
        let p = &mut pending[i];
        let state = read_some(&p.stream, &mut p.buf[p.got..]);
        let done = match state {
            Ok(n) => {
                p.got += n;
                if p.got >= handshake::MAGIC.len()
                    && &p.buf[..handshake::MAGIC.len()] != handshake::MAGIC
                {
                    dropped.garbage += 1;
                    true
                } else if p.got == HELLO_LEN {
                    let p = pending.remove(i).expect("index in range");
                    match handshake::open_hello(key, &p.n0, &p.buf) {
                        Greeting::Garbage => dropped.garbage += 1,
                        Greeting::Unauthenticated => {
                            // Says why to a rank given another token; tells a stranger nothing.
                            let _ = (&p.stream).write(&[REJECTED]);
                            dropped.unauthenticated += 1;
                        }
                        Greeting::Hello(hello) => match p.stream.peer_addr() {
                            Ok(from) => peers.push(Peer {
                                stream: p.stream,
                                from,
                                n0: p.n0,
                                hello,
                            }),
                            Err(_) => dropped.gone += 1,
                        },
                    }
                    continue;
                } else if p.greet_by.passed() {
                    dropped.slow += 1;
                    true
                } else {
                    false
                }
            }
            Err(()) => {
                dropped.gone += 1;
                true
            }
        };
        if done {
            pending.remove(i);
        } else {
            i += 1;
        }
    }
}

/// Reads what a non-blocking stream has into `buf` (none: `Ok(0)`); `Err` where the stream
/// closed or failed.
fn read_some(mut s: &TcpStream, buf: &mut [u8]) -> Result<usize, ()> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(()),
        }
    }
    Ok(got)
}

/// Whether a peer that has greeted is still there and silent, as a rank waiting for its answer
/// is (closed, failed, or speaking out of turn: not a rank to answer).
fn quiet(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    match s.peek(&mut b) {
        Err(e) => matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
        Ok(_) => false,
    }
}

/// "rank(s) [1, 4] of 8", naming at most [`NAMED_MISSING`] and counting the rest.
fn missing(peers: &[Peer], world: usize) -> String {
    let mut present: Vec<usize> = peers
        .iter()
        .filter_map(|p| usize::try_from(p.hello.rank).ok())
        .filter(|r| (1..world).contains(r))
        .collect();
    present.sort_unstable();
    present.dedup();
    let absent = (world - 1) - present.len();
    let named: Vec<usize> = (1..world)
        .filter(|r| present.binary_search(r).is_err())
        .take(NAMED_MISSING)
        .collect();
    let more = absent - named.len();
    if more > 0 {
        format!("rank(s) {named:?} and {more} more of {world}")
    } else {
        format!("rank(s) {named:?} of {world}")
    }
}

/// Why the ranks that arrived do not make the ring rank 0 runs, if they do not: each rank
/// `1..world` once, rank 0's world size and fingerprint.
fn disagreement(peers: &[Peer], world: usize, fingerprint: u64) -> Option<String> {
    let mut seen = vec![false; world];
    for p in peers {
        let (h, from) = (&p.hello, p.from);
        if h.world != world as u64 {
            return Some(format!(
                "rank {} was started with WORLD_SIZE={}, rank 0 with {world} (from {from})",
                h.rank, h.world
            ));
        }
        let Some(r) = usize::try_from(h.rank)
            .ok()
            .filter(|r| (1..world).contains(r))
        else {
            return Some(format!(
                "a process says it is rank {} of {world} (from {from})",
                h.rank
            ));
        };
        if std::mem::replace(&mut seen[r], true) {
            return Some(format!("two processes say they are rank {r} (from {from})"));
        }
        if h.fingerprint != fingerprint {
            return Some(format!(
                "rank {r} was started for another problem (fingerprint {:016x}, rank 0's \
                 {fingerprint:016x}; from {from})",
                h.fingerprint
            ));
        }
    }
    None
}

/// Answers every peer with `why`, each within one shared short deadline.
fn refuse_all(key: &Key, peers: &mut [Peer], why: &str) {
    let by = Deadline::after(ANSWER_WRITE);
    for p in peers {
        let answer = handshake::answer_refused(key, &p.n0, &p.hello.nonce, why);
        let _ = write_by(&mut p.stream, &answer, by);
    }
}

/// What one connection attempt of a joining rank came to.
enum Attempt {
    /// Rank 0 closed the connection before it answered: try again.
    Again,
    Done(Result<[u8; ID_LEN], DistError>),
}

/// Every other rank: connect (until the deadline), greet, read the answer.
fn join(
    env: &RankEnv,
    key: &Key,
    fingerprint: u64,
    deadline: Deadline,
) -> Result<[u8; ID_LEN], DistError> {
    let target = format!("{}:{}", env.master_addr, env.port);
    loop {
        let addrs = resolve(&env.master_addr, env.port)
            .map_err(|e| DistError::Rendezvous(format!("MASTER_ADDR {target}: {e}")))?;
        let attempt = slice(deadline);
        if let Some(s) = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, attempt).ok())
            && let Attempt::Done(r) = greet(env, key, fingerprint, s, deadline, &target)
        {
            return r;
        }
        if deadline.passed() {
            return Err(deadline.timeout(&format!(
                "rank {} connecting to rank 0 at {target}",
                env.rank
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One connection of a joining rank: rank 0's challenge, the greeting, rank 0's answer.
fn greet(
    env: &RankEnv,
    key: &Key,
    fingerprint: u64,
    mut s: TcpStream,
    deadline: Deadline,
    target: &str,
) -> Attempt {
    let r = env.rank;
    let _ = s.set_nodelay(true);
    let mut challenge = [0u8; CHALLENGE_LEN];
    match read_by(&mut s, &mut challenge, deadline) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::TimedOut => {
            return Attempt::Done(Err(deadline.timeout(&format!(
                "rank {r} waiting for rank 0's challenge at {target} (what listens there does \
                 not speak the ring's protocol)"
            ))));
        }
        Err(_) => return Attempt::Again,
    }
    let Some(n0) = handshake::read_challenge(&challenge) else {
        return Attempt::Done(Err(DistError::Rendezvous(format!(
            "what listens at {target} is not rank 0 of an sdpa ring of this version"
        ))));
    };
    match answer(env, key, fingerprint, s, deadline, target, n0) {
        Ok(Some(id)) => Attempt::Done(Ok(id)),
        Ok(None) => Attempt::Again,
        Err(e) => Attempt::Done(Err(e)),
    }
}

fn answer(
    env: &RankEnv,
    key: &Key,
    fingerprint: u64,
    mut s: TcpStream,
    deadline: Deadline,
    target: &str,
    n0: Nonce,
) -> Result<Option<[u8; ID_LEN]>, DistError> {
    let r = env.rank;
    let n1 = handshake::nonce()?;
    let hello = Hello {
        rank: r as u64,
        world: env.world as u64,
        fingerprint,
        nonce: n1,
    };
    // Closed before an answer (a failed write, or the end of the stream where the status
    // should be): rank 0 shed this connection, among too many at once or too slow for it, or
    // is starting over; the caller connects again while the deadline lasts.
    match write_by(&mut s, &handshake::hello(key, &n0, &hello), deadline) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::TimedOut => {
            return Err(deadline.timeout(&format!("rank {r} greeting rank 0 at {target}")));
        }
        Err(_) => return Ok(None),
    }
    // Rank 0 answers by its own deadline, which may have started after this rank's: a while
    // past ours, its answer (which ranks never came) is still worth waiting for.
    let deadline = deadline.extended(ANSWER_GRACE.min(deadline.limit()));
    let what = format!("rank {r} waiting for rank 0's answer (other ranks missing?)");
    let mut status = [0u8; 1];
    match read_by(&mut s, &mut status, deadline) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::TimedOut => return Err(deadline.timeout(&what)),
        Err(_) => return Ok(None),
    }
    let mut read =
        |buf: &mut [u8]| read_by(&mut s, buf, deadline).map_err(|e| io_error(e, deadline, &what));
    let forged = || {
        DistError::Unauthenticated(format!(
            "the answer of rank 0 at {target} does not carry this ring's MAC: what answered \
             does not hold this rank's SDPA_RING_TOKEN"
        ))
    };
    match status[0] {
        handshake::OK => {
            let mut sealed = [0u8; ID_LEN];
            let mut tag = [0u8; MAC_LEN];
            read(&mut sealed)?;
            read(&mut tag)?;
            handshake::open_ok(key, &n0, &n1, &sealed, &tag)
                .map(Some)
                .ok_or_else(forged)
        }
        handshake::REFUSED => {
            let mut len = [0u8; 2];
            read(&mut len)?;
            let len = usize::from(u16::from_le_bytes(len));
            if len > MAX_MESSAGE {
                return Err(DistError::Rendezvous(format!(
                    "rank 0 at {target} sent a refusal of {len} bytes, more than a ring rank's"
                )));
            }
            let mut why = vec![0u8; len];
            let mut tag = [0u8; MAC_LEN];
            read(&mut why)?;
            read(&mut tag)?;
            let why = handshake::open_refused(key, &n0, &n1, &why, &tag).ok_or_else(forged)?;
            Err(DistError::Rendezvous(format!(
                "rank 0 ended the rendezvous: {why}"
            )))
        }
        REJECTED => Err(DistError::Unauthenticated(format!(
            "rank 0 at {target} refused rank {r}'s greeting: its MAC is not rank 0's; every \
             rank must be given the same SDPA_RING_TOKEN"
        ))),
        other => Err(DistError::Rendezvous(format!(
            "rank 0 at {target} answered {other}, not a ring rank's answer"
        ))),
    }
}

/// One wait of a blocking socket: what is left of `deadline`, between 1 ms (a zero timeout
/// means none to the socket) and 1 s (the deadline is checked again after).
fn slice(deadline: Deadline) -> Duration {
    deadline
        .left()
        .clamp(Duration::from_millis(1), Duration::from_secs(1))
}

/// Fills `buf` from `s` by `deadline`, however the bytes come (one a second included):
/// `TimedOut` past it, `UnexpectedEof` where the other side closed first.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Deadline) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        if deadline.passed() {
            return Err(ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(slice(deadline)))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` to `s` (blocking or not) by `deadline`: `TimedOut` past it.
fn write_by(s: &mut TcpStream, buf: &[u8], deadline: Deadline) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        if deadline.passed() {
            return Err(ErrorKind::TimedOut.into());
        }
        s.set_write_timeout(Some(slice(deadline)))?;
        match s.write(&buf[sent..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn io_error(e: std::io::Error, deadline: Deadline, what: &str) -> DistError {
    match e.kind() {
        ErrorKind::TimedOut => deadline.timeout(what),
        ErrorKind::UnexpectedEof => {
            DistError::Rendezvous(format!("{what}: rank 0 closed the connection"))
        }
        _ => DistError::Rendezvous(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests;
