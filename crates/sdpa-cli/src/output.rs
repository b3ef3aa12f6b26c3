//! Every file the CLI writes (.npy results, JSON records, SVG charts) goes through here: the
//! paths are checked before any work starts, and each file is written whole or not at all.
//!
//! A file is written into a fresh temporary file in the folder it will live in, flushed, synced,
//! given the permissions of the file it replaces, and renamed over it: a reader sees the old
//! contents or the new, never a part, and a failure leaves the old file and no temporary.
//!
//! An output path that is a symlink is written through: the link stays and its target is
//! replaced (atomically, beside the target), as a shell's `>` writes through a link, so a link
//! kept in a results folder keeps pointing at the fresh results. A link whose target does not
//! exist is refused rather than followed: creating a file wherever a stray link points is
//! never what a benchmark run means to do. A link to one of the command's inputs is the same
//! file as that input, and is refused like the input itself.

use sdpa::{Error, Result};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

fn io_err(path: &Path, msg: impl ToString) -> Error {
    Error::Io {
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}

/// A path given on the command line, with the flag (or argument name) that gave it.
pub type Named<'a> = (&'a str, &'a Path);

/// Checks, before any work starts, that every output can be written and replaces none of the
/// inputs or another output: each output is a regular file or absent (a symlink to a regular
/// file counts as one), its folder exists and takes new files, and no two of the paths name
/// the same file (by device and inode where both exist, by canonical path otherwise).
pub fn check(outputs: &[Named], inputs: &[Named]) -> Result<()> {
    for (i, &(flag, out)) in outputs.iter().enumerate() {
        let target = target_of(out).map_err(|e| flagged(flag, e))?;
        probe_folder(&target).map_err(|e| flagged(flag, io_err(out, e)))?;
        for &(in_flag, input) in inputs {
            if same_file(out, input) {
                return Err(Error::InvalidArgument(format!(
                    "{flag} {} is the same file as {in_flag} {}; refusing to overwrite an input",
                    out.display(),
                    input.display()
                )));
            }
        }
        for &(other_flag, other) in &outputs[..i] {
            if same_file(out, other) {
                return Err(Error::InvalidArgument(format!(
                    "{flag} {} and {other_flag} {} are the same file; give each output its own",
                    out.display(),
                    other.display()
                )));
            }
        }
    }
    Ok(())
}

/// `e` with the flag in front of its path (`--json r.json: is a folder`), so the user knows
/// which argument it was.
fn flagged(flag: &str, e: Error) -> Error {
    match e {
        Error::Io { path, msg } => Error::Io {
            path: format!("{flag} {path}"),
            msg,
        },
        other => other,
    }
}

/// The file a write to `path` replaces or creates: `path` itself, or the target of the symlink
/// at `path`. Refused: a folder or other non-regular file, a dangling symlink, a path without a
/// file name.
fn target_of(path: &Path) -> Result<PathBuf> {
    if path.file_name().is_none() {
        return Err(io_err(path, "names a folder, not a file"));
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(path.to_path_buf()),
        Err(e) => Err(io_err(path, e)),
        Ok(link) => {
            let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => io_err(
                    path,
                    "is a symlink to a file that does not exist; refusing to create its target",
                ),
                _ => io_err(path, e),
            })?;
            if meta.is_dir() {
                return Err(io_err(path, "is a folder; give a file name"));
            }
            if !meta.is_file() {
                return Err(io_err(path, "exists and is not a regular file"));
            }
            match link.file_type().is_symlink() {
                true => std::fs::canonicalize(path).map_err(|e| io_err(path, e)),
                false => Ok(path.to_path_buf()),
            }
        }
    }
}

/// Creates and removes a temporary file beside `target`: the folder exists, is a folder, and
/// takes new files (what the write will need).
fn probe_folder(target: &Path) -> io::Result<()> {
    let (tmp, file) = create_temp_beside(target).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => io::Error::new(e.kind(), "its folder does not exist"),
        _ => e,
    })?;
    drop(file);
    std::fs::remove_file(tmp)
}

/// Whether `a` and `b` name the same file: the same device and inode where both exist (hard
/// links, symlinks and any spelling of the path), else the same canonical path.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => canonical(a) == canonical(b),
    }
}

/// `path` made absolute and resolved as far as it exists (its folder, for a file not yet
/// written).
fn canonical(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            std::fs::canonicalize(dir)
                .unwrap_or_else(|_| dir.to_path_buf())
                .join(name)
        }
        _ => path.to_path_buf(),
    }
}

/// Writes a file whole or not at all (see the module's comment): `fill` writes into the
/// temporary file, which then replaces `path`'s file.
pub fn write_atomically(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<&File>) -> io::Result<()>,
) -> Result<()> {
    stage(path, fill)?.commit()
}

/// A file written in full beside the one it will replace, not yet in its place: [`commit`]
/// renames it over its target; dropped uncommitted, it is removed. Staging every output of a
/// command before committing any of them keeps a failure in the last from leaving the first
/// written.
///
/// [`commit`]: Staged::commit
pub struct Staged {
    /// The temporary file; `None` once committed.
    tmp: Option<PathBuf>,
    /// The file it replaces (the symlink's target where `path` is a link).
    target: PathBuf,
    /// The path as the user gave it, for messages.
    path: PathBuf,
}

/// Writes `fill`'s bytes into a temporary file beside `path`'s file, flushed and synced, with
/// the permissions of the file it will replace (if any).
pub fn stage(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<&File>) -> io::Result<()>,
) -> Result<Staged> {
    let target = target_of(path)?;
    let (tmp, file) = create_temp_beside(&target).map_err(|e| io_err(path, e))?;
    let staged = Staged {
        tmp: Some(tmp),
        target,
        path: path.to_path_buf(),
    };
    let replaced = std::fs::metadata(&staged.target).ok();
    let written = (|| {
        if let Some(m) = replaced {
            file.set_permissions(m.permissions())?;
        }
        let mut w = BufWriter::new(&file);
        fill(&mut w)?;
        // into_inner flushes and reports a failed flush (dropping a BufWriter would not).
        w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()
    })();
    written.map_err(|e| io_err(path, e))?;
    Ok(staged)
}

impl Staged {
    /// Renames the file over its target.
    pub fn commit(mut self) -> Result<()> {
        let Some(tmp) = self.tmp.take() else {
            return Ok(());
        };
        if let Err(e) = std::fs::rename(&tmp, &self.target) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err(&self.path, e));
        }
        // The rename is durable once the folder is synced; a folder that cannot be opened
        // for it (no read permission) still holds the new file.
        let dir = self.target.parent().filter(|d| !d.as_os_str().is_empty());
        if let Ok(d) = File::open(dir.unwrap_or(Path::new("."))) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// Creates `.NAME.PID.N.tmp` in `path`'s folder, a name no other writer uses.
fn create_temp_beside(path: &Path) -> io::Result<(PathBuf, File)> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "names a folder, not a file"))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(
            ".{}.{}.{n}.tmp",
            name.to_string_lossy(),
            std::process::id()
        ));
        match File::options().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Writes `text` to `path` whole or not at all.
pub fn write_text(path: &Path, text: &str) -> Result<()> {
    write_atomically(path, |w| w.write_all(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sdpa-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn listing(d: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let d = dir("failed");
        let path = d.join("out.npy");
        std::fs::write(&path, b"old").unwrap();
        let err = write_atomically(&path, |w| {
            w.write_all(&[7; 100_000])?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("disk full"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(listing(&d), ["out.npy"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_symlinked_output_has_its_target_replaced_and_the_link_kept() {
        let d = dir("link");
        let (target, link) = (d.join("target.json"), d.join("link.json"));
        std::fs::write(&target, b"old").unwrap();
        std::os::unix::fs::symlink(&target, &link).unwrap();
        check(&[("--json", &link)], &[]).unwrap();
        write_text(&link, "new").unwrap();
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        // A link to nothing is refused, and creates nothing.
        let dangling = d.join("dangling.json");
        std::os::unix::fs::symlink(d.join("nowhere.json"), &dangling).unwrap();
        let e = check(&[("--json", &dangling)], &[]).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert!(write_text(&dangling, "x").is_err());
        assert_eq!(listing(&d), ["dangling.json", "link.json", "target.json"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_replaced_file_keeps_its_permissions() {
        let d = dir("mode");
        let path = d.join("r.json");
        std::fs::write(&path, b"old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_text(&path, "new").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o640);
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn outputs_are_checked_before_any_work() {
        let d = dir("check");
        let input = d.join("in.json");
        std::fs::write(&input, b"[]").unwrap();
        let link = d.join("in-link.json");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let fresh = d.join("fresh.svg");
        let missing = d.join("no-such-folder").join("x.svg");
        let cases: [(&[Named], &str); 6] = [
            (&[("--plot", &d)], "is a folder"),
            (&[("--plot", &missing)], "folder does not exist"),
            (&[("--plot", &input)], "same file as ours"),
            (&[("--plot", &link)], "same file as ours"),
            (
                &[("--json", &fresh), ("--plot", &fresh)],
                "are the same file",
            ),
            (&[("--plot", Path::new("/dev/null"))], "not a regular file"),
        ];
        for (outputs, fragment) in cases {
            let e = check(outputs, &[("ours", &input)]).unwrap_err();
            assert!(e.to_string().contains(fragment), "{outputs:?}: {e}");
        }
        check(&[("--plot", &fresh)], &[("ours", &input)]).unwrap();
        // Checking leaves nothing behind.
        assert_eq!(listing(&d), ["in-link.json", "in.json"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn staged_files_appear_only_when_committed() {
        let d = dir("staged");
        let (a, b) = (d.join("a.npy"), d.join("b.npy"));
        let first = stage(&a, |w| w.write_all(b"a")).unwrap();
        assert!(stage(&d.join("none").join("b.npy"), |w| w.write_all(b"b")).is_err());
        drop(first);
        assert!(listing(&d).is_empty(), "{:?}", listing(&d));
        let first = stage(&a, |w| w.write_all(b"a")).unwrap();
        let second = stage(&b, |w| w.write_all(b"b")).unwrap();
        first.commit().unwrap();
        second.commit().unwrap();
        assert_eq!(listing(&d), ["a.npy", "b.npy"]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
