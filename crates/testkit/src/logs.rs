//! What the code under test logs, captured for the test to read.

use std::sync::{Arc, Mutex};

/// A writer into a shared buffer, for a tracing subscriber; clones write to the same buffer.
#[derive(Clone, Debug, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// Everything written so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }

    /// A plain-text (no colours) formatting subscriber at `level` and above, writing here.
    pub fn subscriber(&self, level: tracing::Level) -> impl tracing::Subscriber + Send + Sync {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures what this thread logs at `level` and above until the guard drops. Use it in a
/// `current_thread` test, so everything the code under test logs happens on this thread.
pub fn capture(level: tracing::Level) -> (Captured, tracing::subscriber::DefaultGuard) {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber(level));
    (captured, guard)
}
