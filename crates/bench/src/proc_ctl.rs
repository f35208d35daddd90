//! The parent's handle on one consumer child process.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::child::{ChildArgs, Ready, RunReport, Stat};

/// Environment variable naming a command that starts each consumer child, its words separated
/// by spaces: `valgrind --tool=callgrind` counts each consumer's instructions, a figure that
/// does not move with the host's load as times do (BENCHMARKS.md, "Counting instructions").
pub const CHILD_WRAPPER_ENV: &str = "REDELIVER_BENCH_CHILD_WRAPPER";

fn wrapper() -> Option<(String, Vec<String>)> {
    parse_wrapper(&std::env::var(CHILD_WRAPPER_ENV).ok()?)
}

/// The program and its arguments; `None` for a blank value (no wrapper).
fn parse_wrapper(value: &str) -> Option<(String, Vec<String>)> {
    let mut words = value.split_whitespace().map(str::to_owned);
    let program = words.next()?;
    Some((program, words.collect()))
}

pub struct ChildProc {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    pub pid: u32,
    pub ready: Ready,
    label: String,
}

impl ChildProc {
    /// Starts a consumer process and waits for it to be connected (not consuming yet).
    pub async fn spawn(url: &str, args: &ChildArgs) -> Result<Self> {
        Self::spawn_with_db(url, None, args).await
    }

    /// [`Self::spawn`] with the database of scenario 7, passed in the environment like the
    /// broker's URL (both may carry a password: not in the command line).
    pub async fn spawn_with_db(
        url: &str,
        database_url: Option<&str>,
        args: &ChildArgs,
    ) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the bench binary")?;
        let label = format!("{} consumer on '{}'", args.side.name(), args.queue_name());
        let mut command = match wrapper() {
            Some((program, wrapper_args)) => {
                let mut c = Command::new(program);
                c.args(wrapper_args).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        command.args(args.to_args()).env("AMQP_URL", url);
        if let Some(db) = database_url {
            command.env("DATABASE_URL", db);
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting the {label}"))?;
        let pid = child.id().context("child pid")?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let mut me = ChildProc {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            pid,
            ready: Ready { rss_kb: 0 },
            label,
        };
        let line = me.expect("@@READY", Duration::from_secs(30)).await?;
        me.ready = serde_json::from_str(&line).context("decoding READY")?;
        Ok(me)
    }

    /// Waits for the next protocol line starting with `tag`; returns the rest of it.
    async fn expect(&mut self, tag: &str, timeout: Duration) -> Result<String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .map_err(|_| anyhow!("the {} sent no {tag} within {timeout:?}", self.label))?
                .with_context(|| format!("reading from the {}", self.label))?;
            let Some(line) = line else {
                let status = self.child.wait().await.ok();
                bail!(
                    "the {} exited before {tag} (status {status:?}; its error is above)",
                    self.label
                );
            };
            if let Some(rest) = line.strip_prefix(tag) {
                return Ok(rest.trim().to_string());
            }
            if !line.starts_with("@@") {
                eprintln!("[child {}] {line}", self.pid);
            }
        }
    }

    async fn send(&mut self, line: &str) -> Result<()> {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .with_context(|| format!("writing to the {}", self.label))?;
        self.stdin.flush().await.context("flushing child stdin")
    }

    /// Starts a RUN and waits until the child's consumer is up.
    pub async fn start_run(&mut self, kind: &str, n: u64) -> Result<()> {
        self.send_run(kind, n).await?;
        self.wait_started().await
    }

    /// Sends a RUN without waiting (several children started together: then [`Self::wait_started`]).
    pub async fn send_run(&mut self, kind: &str, n: u64) -> Result<()> {
        self.send(&format!("RUN {kind} {n}")).await
    }

    pub async fn wait_started(&mut self) -> Result<()> {
        self.expect("@@STARTED", Duration::from_secs(60)).await?;
        Ok(())
    }

    /// The counts of the current RUN so far.
    pub async fn stat(&mut self) -> Result<Stat> {
        self.send("STAT").await?;
        let line = self.expect("@@STAT", Duration::from_secs(10)).await?;
        serde_json::from_str(&line).context("decoding STAT")
    }

    pub async fn wait_done(&mut self, timeout: Duration) -> Result<RunReport> {
        let line = self.expect("@@DONE", timeout).await?;
        serde_json::from_str(&line).context("decoding DONE")
    }

    pub async fn run(&mut self, kind: &str, n: u64, timeout: Duration) -> Result<RunReport> {
        self.start_run(kind, n).await?;
        self.wait_done(timeout).await
    }

    pub async fn quit(mut self) -> Result<()> {
        self.send("QUIT").await?;
        self.expect("@@BYE", Duration::from_secs(30)).await?;
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::parse_wrapper;

    #[test]
    fn a_wrapper_is_a_program_and_its_arguments() {
        assert_eq!(parse_wrapper("  "), None);
        assert_eq!(parse_wrapper("nice"), Some(("nice".into(), vec![])));
        assert_eq!(
            parse_wrapper("valgrind --tool=callgrind  --callgrind-out-file=/tmp/cg/%p.out"),
            Some((
                "valgrind".into(),
                vec![
                    "--tool=callgrind".into(),
                    "--callgrind-out-file=/tmp/cg/%p.out".into()
                ]
            ))
        );
    }
}
