//! .npy in (float64, float32 or float16, little-endian, C order) and out (float32).
//!
//! Both directions are done here rather than by a general .npy library: the header is read by a
//! small strict parser that accepts exactly what numpy writes for a plain array (a dict of
//! 'descr', 'fortran_order' and 'shape'), so a hostile header costs at most its capped length in
//! time and memory; and the data is allocated only after the file's length has been checked to
//! hold exactly what the shape says.

use crate::output::{self, Staged};
use sdpa::{Error, Result};
use std::io::{BufReader, Read, Write};
use std::path::Path;

/// The first six bytes of every .npy file.
const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// The longest header read, in bytes: numpy's own reader refuses longer ones by default.
const MAX_HEADER_LEN: u64 = 10_000;
/// The most dimensions a shape may have (numpy's limit before version 2).
const MAX_DIMS: usize = 32;
/// Bytes converted per read while loading the data.
const CHUNK: usize = 64 * 1024;

fn io_err(path: &Path, msg: impl ToString) -> Error {
    Error::Io {
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}

/// The element types read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F64,
    F32,
    F16,
}

impl Elem {
    fn from_descr(descr: &str) -> std::result::Result<Elem, String> {
        match descr {
            "<f8" => Ok(Elem::F64),
            "<f4" => Ok(Elem::F32),
            "<f2" => Ok(Elem::F16),
            // The parser admits only printable ASCII without quotes here: one line as is.
            other => Err(format!(
                "dtype {other} is not supported (float64 '<f8', float32 '<f4' or float16 '<f2' \
                 expected)"
            )),
        }
    }

    fn size(self) -> usize {
        match self {
            Elem::F64 => 8,
            Elem::F32 => 4,
            Elem::F16 => 2,
        }
    }
}

/// What a .npy header says.
#[derive(Debug, PartialEq)]
struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// Reads an array as f32, with its shape. Only a regular file is opened (see `input`).
pub fn read(path: &Path) -> Result<(Vec<f32>, Vec<usize>)> {
    let (file, len) = crate::input::open_regular(path)?;
    read_from(BufReader::new(file), len).map_err(|msg| io_err(path, msg))
}

/// Reads an array from `r`, a file of `file_len` bytes. Nothing larger than the header cap is
/// allocated before the file's length has been checked against the header's claims.
fn read_from(
    mut r: impl Read,
    file_len: u64,
) -> std::result::Result<(Vec<f32>, Vec<usize>), String> {
    let (header, header_end) = read_header(&mut r, file_len)?;
    let elem = Elem::from_descr(&header.descr)?;
    if header.fortran_order {
        return Err("Fortran-order arrays are not supported; save with C order".into());
    }
    let too_large = || format!("shape {:?} is too large to address", header.shape);
    let count = (header.shape.iter())
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(too_large)?;
    let data_len = count.checked_mul(elem.size()).ok_or_else(too_large)? as u64;
    let present = file_len - header_end;
    if present != data_len {
        return Err(format!(
            "shape {:?} of {} needs {data_len} data bytes, the file has {present}",
            header.shape, header.descr
        ));
    }
    let data = read_data(r, elem, count)?;
    Ok((data, header.shape))
}

/// Reads and parses the preamble and header; returns the header and the offset of the data.
fn read_header(r: &mut impl Read, file_len: u64) -> std::result::Result<(Header, u64), String> {
    let mut start = [0u8; 8];
    if file_len < start.len() as u64 || r.read_exact(&mut start).is_err() || start[..6] != *MAGIC {
        return Err("not a .npy file: it does not start with \\x93NUMPY".into());
    }
    let len_field = match (start[6], start[7]) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        (major, minor) => {
            return Err(format!(
                "not a .npy file: format version {major}.{minor} (1.0, 2.0 or 3.0 expected)"
            ));
        }
    };
    let mut field = [0u8; 4];
    r.read_exact(&mut field[..len_field])
        .map_err(|_| "not a .npy file: it ends inside the preamble".to_string())?;
    let header_len = u64::from(u32::from_le_bytes(field));
    let preamble_len = (8 + len_field) as u64;
    if header_len > MAX_HEADER_LEN {
        return Err(format!(
            "not a .npy file: the header claims {header_len} bytes, more than the \
             {MAX_HEADER_LEN} numpy reads"
        ));
    }
    let header_end = preamble_len + header_len;
    if header_end > file_len {
        return Err(format!(
            "not a .npy file: the header claims {header_len} bytes, the file has {} after the \
             preamble",
            file_len.saturating_sub(preamble_len)
        ));
    }
    let mut text = vec![0u8; header_len as usize];
    r.read_exact(&mut text)
        .map_err(|e| format!("not a .npy file: reading the header: {e}"))?;
    let header = parse_header(&text).map_err(|e| format!("not a .npy file: header: {e}"))?;
    Ok((header, header_end))
}

/// Parses the header text: a Python dict literal with exactly the keys 'descr' (a string),
/// 'fortran_order' (True or False) and 'shape' (a tuple of non-negative integers), in any
/// order, with optional whitespace and trailing commas.
fn parse_header(text: &[u8]) -> std::result::Result<Header, String> {
    let mut p = Parser { text, pos: 0 };
    let (mut descr, mut fortran_order, mut shape) = (None, None, None);
    p.expect(b'{')?;
    while !p.eat(b'}') {
        let key = p.string()?;
        p.expect(b':')?;
        match key {
            b"descr" => set_once(&mut descr, "descr", p.string()?)?,
            b"fortran_order" => set_once(&mut fortran_order, "fortran_order", p.boolean()?)?,
            b"shape" => set_once(&mut shape, "shape", p.tuple()?)?,
            other => {
                return Err(format!(
                    "unexpected key {:?}",
                    String::from_utf8_lossy(other)
                ));
            }
        }
        if !p.eat(b',') {
            p.expect(b'}')?;
            break;
        }
    }
    p.skip_space();
    if p.pos != text.len() {
        return Err(p.unexpected("the end of the header"));
    }
    let missing = |key: &str| format!("no '{key}' key");
    Ok(Header {
        descr: String::from_utf8_lossy(descr.ok_or_else(|| missing("descr"))?).into_owned(),
        fortran_order: fortran_order.ok_or_else(|| missing("fortran_order"))?,
        shape: shape.ok_or_else(|| missing("shape"))?,
    })
}

fn set_once<T>(slot: &mut Option<T>, key: &str, value: T) -> std::result::Result<(), String> {
    if slot.replace(value).is_some() {
        return Err(format!("'{key}' appears twice"));
    }
    Ok(())
}

/// A cursor over header text; every method skips leading whitespace and consumes one token.
struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    /// Consumes `c` if it comes next.
    fn eat(&mut self, c: u8) -> bool {
        self.skip_space();
        let found = self.peek() == Some(c);
        self.pos += usize::from(found);
        found
    }

    fn expect(&mut self, c: u8) -> std::result::Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.unexpected(&format!("'{}'", c as char)))
        }
    }

    /// An error naming what was expected and what stands at the cursor instead.
    fn unexpected(&self, wanted: &str) -> String {
        match self.peek() {
            Some(c) => format!(
                "expected {wanted} at byte {}, found {:?}",
                self.pos,
                char::from(c)
            ),
            None => format!("expected {wanted} at byte {}, found the end", self.pos),
        }
    }

    /// A quoted string without escapes: printable ASCII between matching ' or ".
    fn string(&mut self) -> std::result::Result<&'a [u8], String> {
        self.skip_space();
        let quote = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(self.unexpected("a quoted string")),
        };
        let start = self.pos + 1;
        let len = self.text[start..]
            .iter()
            .position(|&c| c == quote || c == b'\\' || !(b' '..=b'~').contains(&c))
            .filter(|&n| self.text[start + n] == quote)
            .ok_or_else(|| format!("unterminated or unsupported string at byte {}", self.pos))?;
        self.pos = start + len + 1;
        Ok(&self.text[start..start + len])
    }

    fn boolean(&mut self) -> std::result::Result<bool, String> {
        self.skip_space();
        let rest = &self.text[self.pos..];
        for (word, value) in [(&b"True"[..], true), (&b"False"[..], false)] {
            if rest.starts_with(word) {
                self.pos += word.len();
                return Ok(value);
            }
        }
        Err(self.unexpected("True or False"))
    }

    /// `()`, `(n,)` or `(n, m, ...)` with an optional trailing comma, at most MAX_DIMS long.
    fn tuple(&mut self) -> std::result::Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            if self.eat(b')') {
                return Ok(dims);
            }
            if dims.len() == MAX_DIMS {
                return Err(format!("the shape has more than {MAX_DIMS} dimensions"));
            }
            dims.push(self.integer()?);
            if !self.eat(b',') {
                self.expect(b')')?;
                if dims.len() == 1 {
                    return Err("the shape (n) is not a tuple; numpy writes (n,)".into());
                }
                return Ok(dims);
            }
        }
    }

    /// A non-negative decimal integer that fits a usize (a Python 2 `L` suffix allowed).
    fn integer(&mut self) -> std::result::Result<usize, String> {
        self.skip_space();
        let start = self.pos;
        let digits = self.text[start..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        if digits == 0 {
            return Err(self.unexpected("a non-negative integer"));
        }
        self.pos += digits;
        if self.peek() == Some(b'L') {
            self.pos += 1;
        }
        let text = &self.text[start..start + digits];
        text.iter()
            .try_fold(0usize, |n, &c| {
                n.checked_mul(10)?.checked_add(usize::from(c - b'0'))
            })
            .ok_or_else(|| format!("dimension {} is too large", String::from_utf8_lossy(text)))
    }
}

/// Reads `count` elements, converting to f32 chunk by chunk. A finite float64 beyond float32's
/// range is refused (naming the element) rather than read as an infinity.
fn read_data(mut r: impl Read, elem: Elem, count: usize) -> std::result::Result<Vec<f32>, String> {
    let mut out: Vec<f32> = Vec::new();
    out.try_reserve_exact(count)
        .map_err(|_| format!("cannot allocate memory for {count} elements"))?;
    let mut buf = vec![0u8; CHUNK.min(count * elem.size())];
    let mut left = count * elem.size();
    while left > 0 {
        let chunk = &mut buf[..left.min(CHUNK)];
        r.read_exact(chunk)
            .map_err(|e| format!("reading the data: {e}"))?;
        match elem {
            // numpy's default dtype; rounded to f32 here, then to the problem's dtype.
            Elem::F64 => {
                for b in chunk.chunks_exact(8) {
                    let x = f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                    let y = x as f32;
                    if y.is_infinite() && x.is_finite() {
                        return Err(format!(
                            "element {} is {x:e}, beyond float32's range (largest finite {:e})",
                            out.len(),
                            f32::MAX
                        ));
                    }
                    out.push(y);
                }
            }
            Elem::F32 => out.extend(
                chunk
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            Elem::F16 => out.extend(
                chunk
                    .chunks_exact(2)
                    .map(|b| f32::from(half::f16::from_le_bytes([b[0], b[1]]))),
            ),
        }
        left -= chunk.len();
    }
    Ok(out)
}

/// The .npy header of a little-endian float32 C-order array of `shape`, padded as numpy pads
/// it: preamble and header together a multiple of 64 bytes, ending in a newline.
fn header_bytes(shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = match dims.as_slice() {
        [one] => format!("({one},)"),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple}, }}");
    while !(10 + dict.len() + 1).is_multiple_of(64) {
        dict.push(' ');
    }
    dict.push('\n');
    // At most MAX_DIMS dimensions of 20 digits: always within version 1.0's u16 length.
    let header_len = u16::try_from(dict.len()).expect("header shorter than 64 KiB");
    let mut bytes = MAGIC.to_vec();
    bytes.extend([1, 0]);
    bytes.extend(header_len.to_le_bytes());
    bytes.extend(dict.as_bytes());
    bytes
}

/// f32 data with the given shape, written in full beside `path` and not yet in its place (see
/// `output::stage`): `commit` puts it there.
pub fn stage(path: &Path, data: &[f32], shape: &[usize]) -> Result<Staged> {
    debug_assert_eq!(shape.iter().product::<usize>(), data.len());
    output::stage(path, |w| {
        w.write_all(&header_bytes(shape))?;
        for x in data {
            w.write_all(&x.to_le_bytes())?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    /// The system allocator, noting the largest single request made on each thread, so a test
    /// can assert that reading a file allocated no more than the file justifies.
    struct Tracking;

    thread_local! {
        static LARGEST: Cell<usize> = const { Cell::new(0) };
    }

    fn note(size: usize) {
        let _ = LARGEST.try_with(|c| c.set(c.get().max(size)));
    }

    // SAFETY: every call is forwarded unchanged to the system allocator.
    unsafe impl GlobalAlloc for Tracking {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            note(new_size);
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Tracking = Tracking;

    type Read = std::result::Result<(Vec<f32>, Vec<usize>), String>;

    /// Reads `bytes` as a file of `file_len` bytes; returns the result, the time taken and the
    /// largest single allocation made meanwhile.
    fn read_measured(bytes: &[u8], file_len: u64) -> (Read, Duration, usize) {
        LARGEST.with(|c| c.set(0));
        let t0 = Instant::now();
        let result = read_from(bytes, file_len);
        let elapsed = t0.elapsed();
        (result, elapsed, LARGEST.with(Cell::get))
    }

    /// A file with the given header text (padded as numpy pads) and data bytes.
    fn npy_with(dict: &str, data: &[u8]) -> Vec<u8> {
        let mut text = dict.to_string();
        while !(10 + text.len() + 1).is_multiple_of(64) {
            text.push(' ');
        }
        text.push('\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((text.len() as u16).to_le_bytes());
        bytes.extend(text.as_bytes());
        bytes.extend(data);
        bytes
    }

    fn read_bytes(bytes: &[u8]) -> Read {
        read_from(bytes, bytes.len() as u64)
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn what_write_writes_reads_back() {
        for shape in [&[][..], &[3], &[2, 3], &[1, 2, 3, 4]] {
            let values: Vec<f32> = (0..shape.iter().product::<usize>())
                .map(|i| i as f32 * 0.5 - 1.0)
                .collect();
            let mut bytes = header_bytes(shape);
            assert_eq!(bytes.len() % 64, 0);
            bytes.extend(f32_bytes(&values));
            assert_eq!(read_bytes(&bytes), Ok((values, shape.to_vec())));
        }
    }

    #[test]
    fn headers_as_numpy_and_others_write_them_are_read() {
        let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        for dict in [
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            "{'descr':'<f4','fortran_order':False,'shape':(2,3)}",
            "{\"shape\": (2, 3,), \"fortran_order\": False, \"descr\": \"<f4\"}",
            "{ 'fortran_order' : False ,\t'shape' : ( 2L , 3L ) , 'descr' : '<f4' , }",
        ] {
            let got = read_bytes(&npy_with(dict, &data));
            assert_eq!(got.map(|r| r.1), Ok(vec![2, 3]), "{dict}");
        }
        let halves: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        let dict = "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }";
        assert_eq!(
            read_bytes(&npy_with(dict, &halves)),
            Ok((vec![1.5, -2.0], vec![2]))
        );
        // float64, numpy's default, rounds to f32.
        let doubles: Vec<u8> = [0.1f64, -3.0]
            .iter()
            .flat_map(|&x| x.to_le_bytes())
            .collect();
        let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }";
        assert_eq!(
            read_bytes(&npy_with(dict, &doubles)),
            Ok((vec![0.1f32, -3.0], vec![2]))
        );
    }

    #[test]
    fn malformed_headers_are_errors() {
        let data = f32_bytes(&[0.0; 6]);
        let cases = [
            ("{'descr': '<f4', 'fortran_order': False}", "no 'shape'"),
            ("{'descr': '<f4', 'shape': (2, 3)}", "no 'fortran_order'"),
            ("{'fortran_order': False, 'shape': (2, 3)}", "no 'descr'"),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}",
                "twice",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}",
                "unexpected key",
            ),
            (
                "{'descr': '<f4', 'fortran_order': 0, 'shape': (6,)}",
                "True or False",
            ),
            (
                "{'descr': '>f4', 'fortran_order': False, 'shape': (6,)}",
                "not supported",
            ),
            (
                "{'descr': '<i4', 'fortran_order': False, 'shape': (3,)}",
                "not supported",
            ),
            (
                "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,)}",
                "string",
            ),
            (
                "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}",
                "Fortran",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}",
                "'('",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (6)}",
                "not a tuple",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-6,)}",
                "non-negative",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': ((6,),)}",
                "integer",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4)}",
                "needs 32",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (6,)} x",
                "end of the header",
            ),
            (
                "{'descr': '<f4\\', 'fortran_order': False, 'shape': (6,)}",
                "string",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (6,)",
                "'}'",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,)}",
                "too large",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, \
                 'shape': (4294967296, 4294967296, 4294967296)}",
                "too large",
            ),
        ];
        for (dict, fragment) in cases {
            let err = read_bytes(&npy_with(dict, &data)).unwrap_err();
            assert!(err.contains(fragment), "{dict}: {err:?} lacks {fragment:?}");
            assert!(!err.contains('\n'), "{err:?}");
        }
        let too_many = format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}",
            "1, ".repeat(MAX_DIMS + 1)
        );
        let err = read_bytes(&npy_with(&too_many, &data[..4])).unwrap_err();
        assert!(err.contains("dimensions"), "{err}");
    }

    #[test]
    fn malformed_preambles_are_errors() {
        let good = npy_with(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)}",
            &[0; 4],
        );
        let mut version_9 = good.clone();
        version_9[6] = 9;
        let mut v2_huge_len = b"\x93NUMPY\x02\x00".to_vec();
        v2_huge_len.extend(0xFFFF_FFF0u32.to_le_bytes());
        v2_huge_len.extend(b"{'descr':'<f4'\n");
        let mut v1_past_the_end = good[..8].to_vec();
        v1_past_the_end.extend(5000u16.to_le_bytes());
        v1_past_the_end.extend(b"{'descr':'<f4'\n");
        let cases: [(&[u8], &str); 6] = [
            (b"", "\\x93NUMPY"),
            (b"not numpy at all", "\\x93NUMPY"),
            (&good[..9], "preamble"),
            (&version_9, "version 9.0"),
            (&v2_huge_len, "more than the 10000"),
            (&v1_past_the_end, "the file has 15 after"),
        ];
        for (bytes, fragment) in cases {
            let (result, _, largest) = read_measured(bytes, bytes.len() as u64);
            let err = result.unwrap_err();
            assert!(err.contains(fragment), "{err:?} lacks {fragment:?}");
            assert!(largest <= 4096, "allocated {largest} bytes");
        }
    }

    /// The shape of 32 nested lists that made a general Python-literal parser take exponential
    /// time: refused at its first '['.
    #[test]
    fn deep_nesting_is_refused_at_once() {
        for depth in [32, 4000] {
            let dict = format!(
                "{{'descr': '<f4', 'fortran_order': False, 'shape': {}{}}}",
                "[".repeat(depth),
                "]".repeat(depth)
            );
            let bytes = npy_with(&dict, &[]);
            let (result, elapsed, _) = read_measured(&bytes, bytes.len() as u64);
            assert!(result.unwrap_err().contains("expected '('"));
            assert!(elapsed < Duration::from_millis(50), "{elapsed:?}");
        }
    }

    /// A tiny file whose shape implies terabytes: refused by comparing with the file's length,
    /// before anything of that size is allocated.
    #[test]
    fn a_huge_shape_in_a_tiny_file_allocates_nothing_large() {
        let dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (1048576, 1048576, 64), }";
        let bytes = npy_with(dict, &[0; 16]);
        let (result, _, largest) = read_measured(&bytes, bytes.len() as u64);
        assert!(result.unwrap_err().contains("the file has 16"));
        assert!(largest <= 4096, "allocated {largest} bytes");
    }

    /// A small deterministic generator (xorshift64*), so failures reproduce.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// A case for the fuzz loop: a valid file, then one of several kinds of damage.
    fn fuzz_case(rng: &mut Rng) -> Vec<u8> {
        let shapes = ["(2, 3)", "(1, 2, 8, 4)", "()", "(0,)", "(6,)"];
        let shape = shapes[rng.below(shapes.len())];
        let elems: usize = shape
            .trim_matches(|c| c == '(' || c == ')')
            .split(',')
            .filter_map(|d| d.trim().parse::<usize>().ok())
            .product();
        let descr = ["<f4", "<f2", "<f8"][rng.below(3)];
        let size = match descr {
            "<f8" => 8,
            "<f4" => 4,
            _ => 2,
        };
        let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        let mut bytes = npy_with(&dict, &vec![0x3c; elems * size]);
        match rng.below(9) {
            // Random data behind a valid header: NaN, infinities, float64 beyond float32.
            8 => {
                let start = bytes.len() - elems * size;
                for b in &mut bytes[start..] {
                    *b = rng.next() as u8;
                }
            }
            // Bit flips anywhere.
            0 => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(bytes.len());
                    bytes[i] ^= 1 << rng.below(8);
                }
            }
            // Bytes replaced with header punctuation, to reach deeper parser states.
            1 => {
                for _ in 0..1 + rng.below(4) {
                    let i = 10 + rng.below(bytes.len() - 10);
                    bytes[i] = b"{}()[],:'\"0123456789 TrueFalse-L\\\n"[rng.below(34)];
                }
            }
            // Truncated, or extended with junk.
            2 => bytes.truncate(rng.below(bytes.len() + 1)),
            3 => bytes.extend((0..rng.below(100)).map(|_| rng.next() as u8)),
            // A random header length, in version 1, 2 or 3.
            4 => {
                let version = 1 + rng.below(3) as u8;
                let len = match rng.below(3) {
                    0 => rng.next() as u32,
                    1 => rng.below(bytes.len() + 16) as u32,
                    _ => u32::MAX - rng.below(16) as u32,
                };
                let mut out = MAGIC.to_vec();
                out.extend([version, 0]);
                match version {
                    1 => out.extend((len as u16).to_le_bytes()),
                    _ => out.extend(len.to_le_bytes()),
                }
                out.extend(&bytes[10..]);
                bytes = out;
            }
            // Deep nesting, huge dimensions, many dimensions.
            5 => {
                let depth = rng.below(5000);
                let open = ["[", "(", "{"][rng.below(3)];
                let text = format!(
                    "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}1,)}}",
                    open.repeat(depth)
                );
                bytes = npy_with(&text, &bytes[bytes.len().min(64)..]);
            }
            6 => {
                let dims: Vec<String> = (0..rng.below(40))
                    .map(|_| (rng.next() >> rng.below(64)).to_string())
                    .collect();
                let text = format!(
                    "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},)}}",
                    dims.join(", ")
                );
                bytes = npy_with(&text, &vec![0; rng.below(256)]);
            }
            // Random bytes behind a valid magic, or none at all.
            _ => {
                let n = rng.below(200);
                let with_magic = rng.below(2) == 0;
                let random = (0..n).map(|_| rng.next() as u8);
                bytes = if with_magic {
                    MAGIC.iter().copied().chain([1, 0]).chain(random).collect()
                } else {
                    random.collect()
                };
            }
        }
        bytes
    }

    /// Damaged and random files: the reader never panics, answers each within 50 ms, and never
    /// makes an allocation larger than twice the file's (claimed) length or a few KiB.
    #[test]
    fn fuzzed_files_are_answered_fast_with_bounded_allocation() {
        let mut rng = Rng(0x5d9a_7c11_e3f0_4b27);
        let (mut accepted, mut refused) = (0, 0);
        for case in 0..20_000 {
            let bytes = fuzz_case(&mut rng);
            // Mostly the true length; sometimes a file length that disagrees with the bytes.
            let file_len = match rng.below(4) {
                0 => rng.below(2 * bytes.len() + 1) as u64,
                _ => bytes.len() as u64,
            };
            let (result, elapsed, largest) = std::panic::catch_unwind(|| {
                read_measured(&bytes, file_len)
            })
            .unwrap_or_else(|_| panic!("case {case} panicked on {bytes:?} ({file_len} bytes)"));
            assert!(
                elapsed < Duration::from_millis(50),
                "case {case}: {elapsed:?} on {bytes:?}"
            );
            let limit = (2 * file_len as usize).max(4096);
            assert!(
                largest <= limit,
                "case {case}: allocated {largest} bytes for a {file_len}-byte file: {bytes:?}"
            );
            match result {
                Ok(_) => accepted += 1,
                Err(e) => {
                    assert!(!e.contains('\n'), "case {case}: {e:?}");
                    refused += 1;
                }
            }
        }
        // Both outcomes are exercised.
        assert!(accepted > 100 && refused > 10_000, "{accepted} {refused}");
    }

    #[test]
    fn a_staged_array_reads_back_once_committed() {
        let dir = std::env::temp_dir().join(format!("sdpa-npy-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.npy");
        let staged = stage(&path, &[1.0, 2.0], &[2]).unwrap();
        assert!(!path.exists());
        staged.commit().unwrap();
        assert_eq!(read(&path).unwrap(), (vec![1.0, 2.0], vec![2]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// float64 values that float32 cannot hold are refused, naming the first; infinities and
    /// NaN in the file are read as they are.
    #[test]
    fn float64_beyond_float32_is_refused() {
        let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (4,), }";
        let doubles =
            |xs: [f64; 4]| -> Vec<u8> { xs.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let err = read_bytes(&npy_with(dict, &doubles([1.0, -2.0, -1e39, 1e300]))).unwrap_err();
        assert!(err.contains("element 2 is -1e39, beyond float32"), "{err}");
        let (got, _) =
            read_bytes(&npy_with(dict, &doubles([f64::INFINITY, 0.0, 3.5, 1e-50]))).unwrap();
        assert_eq!(got[..3], [f32::INFINITY, 0.0, 3.5]);
        assert_eq!(got[3], 0.0);
    }
}
