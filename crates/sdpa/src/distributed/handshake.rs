//! The rendezvous's messages and their authentication, without sockets: what rank 0 and a
//! joining rank write and how each checks what it reads.
//!
//! Every rank holds the same key (the token of [`RingAuth`]). Rank 0 opens each connection with
//! a challenge holding a fresh random nonce; the joining rank answers with its greeting (rank,
//! world size, fingerprint, a nonce of its own) and an HMAC-SHA256 over the greeting and rank
//! 0's nonce; rank 0's answer (the NCCL id, or why not) carries an HMAC over both nonces. So
//! neither side learns anything from a peer without the key, the key never crosses the wire,
//! a greeting recorded on one connection is refused on any other (its MAC covers that
//! connection's nonce), and so is a recorded answer. The NCCL id travels sealed: XORed with a
//! key stream derived by HMAC from the key and both nonces.
//!
//! ```text
//! rank 0 -> rank r   challenge  MAGIC | nonce0                                       40 bytes
//! rank r -> rank 0   greeting   MAGIC | rank | world | fingerprint | nonce1 | MAC    96 bytes
//! rank 0 -> rank r   answer     OK | sealed id | MAC                                161 bytes
//!                               REFUSED | length (u16) | message | MAC
//!                               REJECTED                (the greeting's MAC was wrong)
//! ```
//! Integers are little-endian u64s.

use super::error::DistError;
use super::rendezvous::RingAuth;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Protocol name and version: the first bytes of a challenge and of a greeting.
pub(crate) const MAGIC: &[u8; 8] = b"sdpaRNG2";
pub(crate) const NONCE_LEN: usize = 32;
pub(crate) const MAC_LEN: usize = 32;
pub(crate) const CHALLENGE_LEN: usize = MAGIC.len() + NONCE_LEN;
/// The greeting's fields before its MAC.
const HELLO_BODY: usize = MAGIC.len() + 3 * 8 + NONCE_LEN;
pub(crate) const HELLO_LEN: usize = HELLO_BODY + MAC_LEN;
pub(crate) const ID_LEN: usize = 128;
/// Answers' first byte.
pub(crate) const OK: u8 = 0;
pub(crate) const REFUSED: u8 = 1;
pub(crate) const REJECTED: u8 = 2;
/// Longest refusal message (the why of a failed rendezvous; longer ones are cut).
pub(crate) const MAX_MESSAGE: usize = 4096;
/// The key of rings that opted out of a token (loopback only): public, so it authenticates
/// nothing; it keeps one protocol for both.
const INSECURE_KEY: &[u8] = b"sdpa ring: no token (loopback, SDPA_RING_INSECURE=1)";

pub(crate) type Nonce = [u8; NONCE_LEN];
pub(crate) type Tag = [u8; MAC_LEN];

/// What the ranks of one ring share.
#[derive(Clone)]
pub(crate) struct Key(Vec<u8>);

impl Key {
    pub(crate) fn of(auth: &RingAuth) -> Key {
        match auth {
            RingAuth::Token(t) => Key(t.bytes().to_vec()),
            RingAuth::Insecure => Key(INSECURE_KEY.to_vec()),
        }
    }

    /// HMAC-SHA256 of the concatenated `parts` (each of a fixed length, or length-prefixed,
    /// so that the concatenation is unambiguous).
    fn mac(&self, parts: &[&[u8]]) -> Tag {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC of `parts` (compared in constant time).
    fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for p in parts {
            m.update(p);
        }
        m.verify_slice(tag).is_ok()
    }

    /// The 128 bytes XORed onto the NCCL id on the connection of these nonces.
    fn id_stream(&self, n0: &Nonce, n1: &Nonce) -> [u8; ID_LEN] {
        let mut out = [0u8; ID_LEN];
        for (i, block) in out.chunks_mut(MAC_LEN).enumerate() {
            block.copy_from_slice(&self.mac(&[b"sdpa ring id", n0, n1, &[i as u8]]));
        }
        out
    }
}

/// A fresh random nonce from the operating system.
pub(crate) fn nonce() -> Result<Nonce, DistError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n)
        .map_err(|e| DistError::Rendezvous(format!("no randomness for a nonce: {e}")))?;
    Ok(n)
}

/// Rank 0's first message on a connection.
pub(crate) fn challenge(n0: &Nonce) -> [u8; CHALLENGE_LEN] {
    let mut out = [0u8; CHALLENGE_LEN];
    out[..MAGIC.len()].copy_from_slice(MAGIC);
    out[MAGIC.len()..].copy_from_slice(n0);
    out
}

/// Rank 0's nonce, from a challenge; `None` where it is not one.
pub(crate) fn read_challenge(buf: &[u8; CHALLENGE_LEN]) -> Option<Nonce> {
    (&buf[..MAGIC.len()] == MAGIC).then(|| buf[MAGIC.len()..].try_into().expect("32 bytes"))
}

/// What a joining rank says of itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) rank: u64,
    pub(crate) world: u64,
    pub(crate) fingerprint: u64,
    pub(crate) nonce: Nonce,
}

/// The greeting `h`, authenticated for the connection whose challenge held `n0`.
pub(crate) fn hello(key: &Key, n0: &Nonce, h: &Hello) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(MAGIC);
    for (i, w) in [h.rank, h.world, h.fingerprint].into_iter().enumerate() {
        out[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
    }
    out[32..HELLO_BODY].copy_from_slice(&h.nonce);
    let tag = key.mac(&[b"sdpa ring hello", n0, &out[..HELLO_BODY]]);
    out[HELLO_BODY..].copy_from_slice(&tag);
    out
}

/// What rank 0 makes of a greeting.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Greeting {
    /// Not this protocol's (a port scanner, another program, an older sdpa).
    Garbage,
    /// This protocol's, but its MAC is not the key's for this connection: a process without
    /// the token, another ring's rank, or a replayed greeting.
    Unauthenticated,
    Hello(Hello),
}

pub(crate) fn open_hello(key: &Key, n0: &Nonce, buf: &[u8; HELLO_LEN]) -> Greeting {
    if &buf[..8] != MAGIC {
        return Greeting::Garbage;
    }
    let (body, tag) = buf.split_at(HELLO_BODY);
    if !key.verify(&[b"sdpa ring hello", n0, body], tag) {
        return Greeting::Unauthenticated;
    }
    let word = |i: usize| u64::from_le_bytes(body[8 + 8 * i..16 + 8 * i].try_into().expect("8"));
    Greeting::Hello(Hello {
        rank: word(0),
        world: word(1),
        fingerprint: word(2),
        nonce: body[32..].try_into().expect("32 bytes"),
    })
}

/// Rank 0's answer handing over `id` on the connection of nonces `n0` (rank 0's), `n1` (the
/// joining rank's).
pub(crate) fn answer_ok(key: &Key, n0: &Nonce, n1: &Nonce, id: &[u8; ID_LEN]) -> Vec<u8> {
    let stream = key.id_stream(n0, n1);
    let sealed: Vec<u8> = id.iter().zip(stream).map(|(a, b)| a ^ b).collect();
    let tag = key.mac(&[b"sdpa ring answer", n0, n1, &[OK], &sealed]);
    [&[OK][..], &sealed, &tag].concat()
}

/// Rank 0's answer refusing the rendezvous, saying why (cut at [`MAX_MESSAGE`] bytes).
pub(crate) fn answer_refused(key: &Key, n0: &Nonce, n1: &Nonce, why: &str) -> Vec<u8> {
    let mut end = why.len().min(MAX_MESSAGE);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    let why = &why.as_bytes()[..end];
    let len = (why.len() as u16).to_le_bytes();
    let tag = key.mac(&[b"sdpa ring answer", n0, n1, &[REFUSED], &len, why]);
    [&[REFUSED][..], &len, why, &tag].concat()
}

/// The NCCL id from an OK answer's body and MAC; `None` where the MAC is not the key's for this
/// connection.
pub(crate) fn open_ok(
    key: &Key,
    n0: &Nonce,
    n1: &Nonce,
    sealed: &[u8; ID_LEN],
    tag: &Tag,
) -> Option<[u8; ID_LEN]> {
    if !key.verify(&[b"sdpa ring answer", n0, n1, &[OK], sealed], tag) {
        return None;
    }
    let stream = key.id_stream(n0, n1);
    let mut id = [0u8; ID_LEN];
    for ((o, s), k) in id.iter_mut().zip(sealed).zip(stream) {
        *o = s ^ k;
    }
    Some(id)
}

/// A refusal's message, where its MAC is the key's for this connection (control characters
/// shown as `?`: it is printed).
pub(crate) fn open_refused(
    key: &Key,
    n0: &Nonce,
    n1: &Nonce,
    message: &[u8],
    tag: &Tag,
) -> Option<String> {
    let len = u16::try_from(message.len()).ok()?.to_le_bytes();
    if !key.verify(
        &[b"sdpa ring answer", n0, n1, &[REFUSED], &len, message],
        tag,
    ) {
        return None;
    }
    Some(
        String::from_utf8_lossy(message)
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::rendezvous::RingToken;

    fn key(t: &str) -> Key {
        Key::of(&RingAuth::Token(RingToken::new(t).unwrap()))
    }

    const N0: Nonce = [1; NONCE_LEN];
    const N1: Nonce = [2; NONCE_LEN];
    const HI: Hello = Hello {
        rank: 3,
        world: 8,
        fingerprint: 0xfeed,
        nonce: N1,
    };

    #[test]
    fn a_greeting_opens_only_with_its_key_on_its_connection() {
        let k = key("0123456789abcdef");
        let g = hello(&k, &N0, &HI);
        assert_eq!(open_hello(&k, &N0, &g), Greeting::Hello(HI));
        // Another token; a replay on a connection with another nonce; one flipped bit.
        assert_eq!(
            open_hello(&key("0123456789abcdeF"), &N0, &g),
            Greeting::Unauthenticated
        );
        assert_eq!(open_hello(&k, &N1, &g), Greeting::Unauthenticated);
        let mut bad = g;
        bad[9] ^= 1;
        assert_eq!(open_hello(&k, &N0, &bad), Greeting::Unauthenticated);
        bad[0] = b'x';
        assert_eq!(open_hello(&k, &N0, &bad), Greeting::Garbage);
        // The key never appears in what is sent.
        assert!(!g.windows(16).any(|w| w == b"0123456789abcdef"));
    }

    #[test]
    fn the_id_travels_sealed_and_authenticated() {
        let k = key("0123456789abcdef");
        let id = [7u8; ID_LEN];
        let a = answer_ok(&k, &N0, &N1, &id);
        assert_eq!((a.len(), a[0]), (1 + ID_LEN + MAC_LEN, OK));
        let sealed: [u8; ID_LEN] = a[1..1 + ID_LEN].try_into().unwrap();
        let tag: Tag = a[1 + ID_LEN..].try_into().unwrap();
        assert!(!sealed.windows(8).any(|w| w == [7u8; 8]), "sealed");
        assert_eq!(open_ok(&k, &N0, &N1, &sealed, &tag), Some(id));
        assert_eq!(open_ok(&k, &N1, &N0, &sealed, &tag), None);
        assert_eq!(
            open_ok(&key("another token..."), &N0, &N1, &sealed, &tag),
            None
        );
    }

    #[test]
    fn refusals_are_authenticated_and_cut() {
        let k = key("0123456789abcdef");
        let a = answer_refused(&k, &N0, &N1, "rank 2 is \u{1b}[31mmissing");
        assert_eq!(a[0], REFUSED);
        let len = u16::from_le_bytes([a[1], a[2]]) as usize;
        let (msg, tag) = (&a[3..3 + len], a[3 + len..].try_into().unwrap());
        assert_eq!(
            open_refused(&k, &N0, &N1, msg, &tag).unwrap(),
            "rank 2 is ?[31mmissing"
        );
        assert_eq!(open_refused(&k, &N1, &N1, msg, &tag), None);
        let long = "é".repeat(MAX_MESSAGE);
        let a = answer_refused(&k, &N0, &N1, &long);
        assert!(a.len() <= 3 + MAX_MESSAGE + MAC_LEN);
    }

    #[test]
    fn challenges_round_trip_and_nonces_differ() {
        let n = nonce().unwrap();
        assert_eq!(read_challenge(&challenge(&n)), Some(n));
        assert_ne!(nonce().unwrap(), n);
        let mut c = challenge(&n);
        c[0] = 0;
        assert_eq!(read_challenge(&c), None);
    }
}
