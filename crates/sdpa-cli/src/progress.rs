//! A progress bar on stderr for the long commands (`validate`, `bench`) when stderr is a
//! terminal. When it is not (a log file, CI), there is no bar and the commands' own lines say
//! where they are.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// The bar of one command, or nothing off a terminal.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// A bar for `total` steps, labelled `what`.
    pub fn new(total: usize, what: &str) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress(None);
        }
        let bar = ProgressBar::new(total as u64);
        if let Ok(style) =
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {wide_msg} {elapsed}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(what.to_string());
        Progress(Some(bar))
    }

    /// Whether a bar is shown.
    pub fn shown(&self) -> bool {
        self.0.is_some()
    }

    /// Names the step now running.
    pub fn step(&self, msg: String) {
        if let Some(b) = &self.0 {
            b.set_message(msg);
        }
    }

    /// Counts a step done.
    pub fn tick(&self) {
        if let Some(b) = &self.0 {
            b.inc(1);
        }
    }

    /// Counts a step done, printing `line` above the bar.
    pub fn done(&self, line: String) {
        if let Some(b) = &self.0 {
            b.println(line);
            b.inc(1);
        }
    }

    /// Runs `f`, which writes to the terminal, with the bar hidden meanwhile.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.0 {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}
