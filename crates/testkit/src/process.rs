//! Child processes of a test (example binaries run as the system under test): their output
//! goes to a log file the assertions quote, and they are killed when the handle drops, so a
//! failing test leaves no process behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running child process with its output in a log file; SIGKILLed if still running when
/// dropped.
#[derive(Debug)]
pub struct LoggedChild {
    child: Option<Child>,
    label: String,
    log: PathBuf,
}

impl LoggedChild {
    /// Starts `cmd` with stdin closed and stdout and stderr appended to `log`.
    ///
    /// # Panics
    ///
    /// When the log cannot be opened or the process cannot start.
    pub fn spawn(mut cmd: Command, label: &str, log: PathBuf) -> Self {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("clone the log handle"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {label} ({:?}): {e}", cmd.get_program()));
        Self {
            child: Some(child),
            label: label.to_owned(),
            log,
        }
    }

    /// The label it was started with.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Its process id (0 once stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILL and reap: no shutdown code of the child runs.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the exit (SIGKILL after `timeout`); returns the exit status as
    /// text.
    pub async fn terminate(&mut self, timeout: Duration) -> String {
        let Some(mut c) = self.child.take() else {
            return "already stopped".into();
        };
        // std has no SIGTERM; kill(1) avoids a libc dependency.
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let start = Instant::now();
        loop {
            match c.try_wait() {
                Ok(Some(status)) => return status.to_string(),
                Ok(None) if start.elapsed() < timeout => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return format!("killed after {timeout:?} without exiting");
                }
            }
        }
    }

    /// The last `lines` lines of its log, for assertion messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for LoggedChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What one run of a program printed, and how it exited.
#[derive(Debug)]
pub struct Output {
    /// Exit code; -1 when killed by a signal.
    pub code: i32,
    /// Standard output, lossily decoded.
    pub stdout: String,
    /// Standard error, lossily decoded.
    pub stderr: String,
}

impl Output {
    /// Runs `cmd` to completion, capturing both outputs.
    ///
    /// # Panics
    ///
    /// When it cannot start.
    pub fn of(cmd: &mut Command) -> Self {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
        Self {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Itself, after asserting exit code 0 (the failure shows both outputs).
    pub fn ok(self) -> Self {
        assert_eq!(
            self.code, 0,
            "expected success\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }
}
