//! The `reliability_worker` processes a scenario runs: their command line (the broker URLs
//! only in their environment) and what their events files tell.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use redeliver_amqp::url::redact;

use super::read_lines;
use crate::examples::workspace_root;
use crate::process::LoggedChild;

/// Path of the `reliability_worker` example, built once per test process.
///
/// `cargo test --workspace` builds every example next to the test binaries
/// (`<target>/<profile>/examples/`, whatever CARGO_TARGET_DIR says), so it is found there from
/// this executable's own path (`<target>/<profile>/deps/<test>-<hash>`). When a narrower command
/// (`cargo test --test reliability_kill`) did not build it, it is built here with the same cargo.
pub fn worker_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| crate::examples::example_binary(&workspace_root(), "reliability_worker"))
}

/// Command line of a `reliability_worker` process. The broker URLs, which hold the password,
/// are not part of it: they reach the process through its environment (`AMQP_URL`), so `ps`,
/// `/proc/<pid>/cmdline` and any message quoting the command never show them.
#[derive(Clone)]
pub struct WorkerCmd {
    /// Comma-separated broker URLs, passwords included: only ever put in the child's
    /// environment.
    pub(super) urls: String,
    /// Its arguments, the scenario's and the test's.
    pub(super) args: Vec<String>,
    /// Directory of its log, events and records.
    pub(super) dir: PathBuf,
}

impl std::fmt::Debug for WorkerCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerCmd")
            .field("urls", &redact(&self.urls))
            .field("args", &self.args)
            .field("dir", &self.dir)
            .finish()
    }
}

impl WorkerCmd {
    /// Adds `--flag value`.
    pub fn arg(mut self, flag: &str, value: impl ToString) -> Self {
        self.args.push(format!("--{flag}"));
        self.args.push(value.to_string());
        self
    }

    /// Adds a flag without value.
    pub fn flag(mut self, flag: &str) -> Self {
        self.args.push(format!("--{flag}"));
        self
    }

    /// Replaces the broker URLs (several, comma-separated, are tried in turn).
    pub fn urls(mut self, urls: &str) -> Self {
        urls.clone_into(&mut self.urls);
        self
    }

    /// The process `spawn` starts as `label`: the arguments (no URL among them) and, in the
    /// environment, `AMQP_URL` with the broker URLs.
    pub fn command(&self, label: &str) -> Command {
        self.command_of(worker_binary(), label)
    }

    /// [`Self::command`] running `program`.
    fn command_of(&self, program: &Path, label: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.args)
            .arg("--events")
            .arg(self.dir.join(format!("{label}.events")))
            // Its success records name the process, so a duplicate says who handled it.
            .arg("--label")
            .arg(label)
            .env(
                "RUST_LOG",
                std::env::var("RELIABILITY_WORKER_LOG").unwrap_or_else(|_| "info".into()),
            )
            // The one source of the URLs, replacing whatever the test process was given.
            .env("AMQP_URL", &self.urls);
        cmd
    }

    /// Starts the process; its output goes to `<scenario dir>/<label>.log`, its state changes
    /// to `<label>.events`.
    pub fn spawn(&self, label: &str) -> WorkerProc {
        let log = self.dir.join(format!("{label}.log"));
        WorkerProc {
            process: LoggedChild::spawn(self.command(label), label, log),
            events: self.dir.join(format!("{label}.events")),
        }
    }
}

/// A running worker process; killed (SIGKILL) if still running when dropped.
pub struct WorkerProc {
    process: LoggedChild,
    /// Its state changes, one `unix-ms state url-index` line each.
    pub events: PathBuf,
}

/// One outage of a worker, in unix ms, as its events file tells it.
#[derive(Clone, Copy, Debug)]
pub struct Outage {
    /// When it stopped consuming.
    pub lost_at: u128,
    /// When it consumed again.
    pub back_at: u128,
    /// Index (in its `--url` list) of the URL it consumes through again.
    pub url: usize,
}

impl Outage {
    /// From losing the connection to consuming again.
    pub fn duration(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.back_at - self.lost_at).unwrap_or(u64::MAX))
    }
}

/// Milliseconds since the Unix epoch (the clock of the workers' events files).
pub fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

impl std::ops::Deref for WorkerProc {
    type Target = LoggedChild;

    fn deref(&self) -> &LoggedChild {
        &self.process
    }
}

impl std::ops::DerefMut for WorkerProc {
    fn deref_mut(&mut self) -> &mut LoggedChild {
        &mut self.process
    }
}

impl WorkerProc {
    /// State changes written by the worker: (unix ms, state, index of the URL in use).
    pub fn state_changes(&self) -> Vec<(u128, String, usize)> {
        read_lines(&self.events)
            .into_iter()
            .filter_map(|l| {
                let mut it = l.split(' ');
                Some((
                    it.next()?.parse().ok()?,
                    it.next()?.to_owned(),
                    // `-`: not connected yet.
                    it.next()?.parse().unwrap_or(usize::MAX),
                ))
            })
            .collect()
    }

    /// The retry mode each session chose (`levels` or `native`), one per `consuming` line of
    /// the events file (a worker that never consumed has none).
    pub fn retry_modes(&self) -> Vec<String> {
        read_lines(&self.events)
            .into_iter()
            .filter_map(|l| {
                let mut it = l.split(' ').skip(1);
                (it.next()? == "consuming").then_some(())?;
                Some(it.nth(1).unwrap_or("-").to_owned())
            })
            .collect()
    }

    /// The worker's own outage after `since` (unix ms): from the first moment it stopped
    /// consuming to the next moment it consumed again. `None` while it has not recovered (or
    /// never lost its connection).
    pub fn outage_after(&self, since: u128) -> Option<Outage> {
        let changes = self.state_changes();
        let lost = changes
            .iter()
            .find(|(t, s, _)| *t >= since && s != "consuming")?;
        let back = changes
            .iter()
            .find(|(t, s, _)| *t >= lost.0 && s == "consuming")?;
        Some(Outage {
            lost_at: lost.0,
            back_at: back.0,
            url: back.2,
        })
    }

    /// Every outage of the worker so far: from leaving `consuming` to the next `consuming`
    /// (the first connection does not count; the final shutdown is not an outage).
    pub fn outages(&self) -> Vec<Duration> {
        let mut out = Vec::new();
        let mut lost_at = None;
        let mut consumed = false;
        for (t, state, _) in self.state_changes() {
            match state.as_str() {
                "consuming" => {
                    if let Some(l) = lost_at.take() {
                        out.push(Duration::from_millis(
                            u64::try_from(t - l).unwrap_or(u64::MAX),
                        ));
                    }
                    consumed = true;
                }
                "draining" | "stopped" if lost_at.is_none() => {}
                _ if consumed && lost_at.is_none() => lost_at = Some(t),
                _ => {}
            }
        }
        out
    }

    /// Waits up to `timeout` for [`Self::outage_after`].
    pub async fn wait_recovered(&self, since: u128, timeout: Duration) -> Outage {
        let start = Instant::now();
        loop {
            if let Some(r) = self.outage_after(since) {
                return r;
            }
            assert!(
                start.elapsed() < timeout,
                "{}: no recovery within {timeout:?}; state changes: {:?}\n{}",
                self.label(),
                self.state_changes(),
                self.log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worker_command_line_holds_no_password() {
        let urls = "amqp://app:s3cret@127.0.0.1:5672/%2f,amqp://app:s3cret@127.0.0.1:5673/%2f";
        let cmd = WorkerCmd {
            urls: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            args: vec!["--queue".into(), "work".into()],
            dir: std::env::temp_dir(),
        }
        .urls(urls)
        .arg("fail-rate", 0.3);
        let run = cmd.command_of(Path::new("reliability_worker"), "a-1");
        let args: Vec<String> = run
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(
            !args
                .iter()
                .any(|a| a.contains("s3cret") || a.contains("://")),
            "{args:?}"
        );
        let env: Vec<_> = run.get_envs().collect();
        assert!(env.contains(&(
            std::ffi::OsStr::new("AMQP_URL"),
            Some(std::ffi::OsStr::new(urls))
        )));
        let shown = format!("{cmd:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("amqp://app:***@127.0.0.1:5673"), "{shown}");
    }
}
