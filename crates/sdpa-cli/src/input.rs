//! Every file the CLI reads is opened here: only a regular file (a symlink to one counts), whose
//! metadata is checked before it is opened, since opening a FIFO waits for a writer that may
//! never come, and reading a device may never end.

use sdpa::{Error, Result};
use serde_json::Value;
use std::fs::File;
use std::io::Read;
use std::path::Path;

fn io_err(path: &Path, msg: impl ToString) -> Error {
    Error::Io {
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}

/// The longest JSON file read (bench records, anchors): a full `sdpa bench` run writes well
/// under a megabyte, and the parsed records take several times the text in memory.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// Opens `path` for reading after checking that it is a regular file; returns it with its
/// length.
pub fn open_regular(path: &Path) -> Result<(File, u64)> {
    let before = std::fs::metadata(path).map_err(|e| io_err(path, e))?;
    if !before.is_file() {
        return Err(io_err(path, not_regular(&before)));
    }
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    // The path may have been replaced between the two looks: the file opened is the one read.
    let meta = file.metadata().map_err(|e| io_err(path, e))?;
    if !meta.is_file() {
        return Err(io_err(path, not_regular(&meta)));
    }
    Ok((file, meta.len()))
}

fn not_regular(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "is a folder, not a file"
    } else if t.is_fifo() {
        "is a FIFO (named pipe), not a regular file"
    } else if t.is_socket() {
        "is a socket, not a regular file"
    } else {
        "is a device or other special file, not a regular file"
    }
}

/// Host bytes a parsed JSON value may take per byte of its text: a `Value` is 32 bytes and a
/// number in the text can be two (`0,`), with room for the vectors' growth.
const PARSED_PER_TEXT_BYTE: usize = 32;

/// The records of a JSON list file (`sdpa bench --json`, the anchors' records): a regular file
/// of at most `MAX_JSON_BYTES`. An unreadable file or another shape is `Error::Io`; too little
/// memory to parse it, `Error::OutOfMemory` (checked before parsing).
pub fn read_records(path: &Path) -> Result<Vec<Value>> {
    let (file, len) = open_regular(path)?;
    let too_long = || {
        io_err(
            path,
            format!("longer than the {MAX_JSON_BYTES} bytes read of a records file"),
        )
    };
    if len > MAX_JSON_BYTES {
        return Err(too_long());
    }
    let mut text = String::new();
    // A file that grew since its length was read stops at the cap plus one byte.
    file.take(MAX_JSON_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| io_err(path, e))?;
    if text.len() as u64 > MAX_JSON_BYTES {
        return Err(too_long());
    }
    sdpa::memory::check_host(text.len().checked_mul(PARSED_PER_TEXT_BYTE))?;
    serde_json::from_str(&text)
        .map_err(|e| io_err(path, format!("not a JSON list of records: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A records file longer than the cap is refused by its length, before any of it is read.
    #[test]
    fn a_records_file_over_the_cap_is_refused_unread() {
        let path = std::env::temp_dir().join(format!("sdpa-input-{}.json", std::process::id()));
        let f = File::create(&path).unwrap();
        f.set_len(MAX_JSON_BYTES + 1).unwrap();
        drop(f);
        let e = read_records(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("longer than the"), "{e}");
        let e = read_records(Path::new("/dev/null")).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
