//! Progress for long operator commands (shown on a terminal only).

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on stderr; hidden when stderr is not a terminal.
pub struct Progress(ProgressBar);

impl Progress {
    /// A bar for `total` items, labelled with what is being done.
    pub fn new(total: u64, what: &str) -> Self {
        let bar = ProgressBar::new(total);
        if let Ok(style) =
            ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} ({per_sec}, eta {eta})")
        {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
        Progress(bar)
    }

    /// Sets the count done.
    pub fn set(&self, done: u64) {
        self.0.set_position(done);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}
