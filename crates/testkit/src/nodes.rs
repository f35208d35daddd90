//! Extra RabbitMQ nodes for the disruptive tests, started and driven by `scripts/cluster.sh`,
//! so faults never touch the default broker the other suites use.

use std::path::PathBuf;
use std::process::Command;

use crate::examples::workspace_root;

/// Extra RabbitMQ nodes started by `scripts/cluster.sh` (a dedicated single node, or the
/// 3-node cluster), so disruptive faults never touch the default broker other suites use.
pub struct Nodes {
    /// Node (or cluster) name given to `scripts/cluster.sh`.
    pub name: String,
    /// Number of nodes.
    pub count: u32,
    /// AMQP port of node 1; node i listens on `base_port + i - 1`.
    pub base_port: u16,
    /// Whether the nodes run the management plugin.
    pub management: bool,
    /// True when this value started them (and so stops them when dropped).
    owned: bool,
}

impl Nodes {
    fn script_path() -> PathBuf {
        workspace_root().join("scripts/cluster.sh")
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(Self::script_path())
            .args(args)
            .env("RD_CLUSTER_NAME", &self.name)
            .env("RD_CLUSTER_NODES", self.count.to_string())
            .env("RD_CLUSTER_BASE_PORT", self.base_port.to_string())
            .env(
                "RD_CLUSTER_MANAGEMENT",
                if self.management { "1" } else { "0" },
            );
        cmd
    }

    fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .command(args)
            .output()
            .map_err(|e| format!("run scripts/cluster.sh: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "scripts/cluster.sh {} failed ({}):\n{}\n{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Starts the nodes unless they already run (then they are left running afterwards).
    pub async fn start(name: &str, count: u32, base_port: u16, management: bool) -> Nodes {
        let mut nodes = Nodes {
            name: name.to_owned(),
            count,
            base_port,
            management,
            owned: false,
        };
        let already = nodes.run(&["status"]).is_ok_and(|s| !s.contains(" down"));
        if !already {
            let n = Nodes {
                owned: false,
                name: nodes.name.clone(),
                ..nodes
            };
            let started = tokio::task::spawn_blocking(move || n.run(&["start"]))
                .await
                .expect("cluster.sh task");
            if let Err(e) = started {
                panic!(
                    "{e}\nThe disruptive tests start their own RabbitMQ node(s) with \
                     scripts/cluster.sh; it needs the rabbitmq-server package (run it as root \
                     or as the user owning ~/.erlang.cookie)."
                );
            }
            nodes.owned = true;
        }
        nodes
    }

    /// AMQP URL of node `i` (1-based).
    pub fn amqp_url(&self, i: u32) -> String {
        format!(
            "amqp://guest:guest@127.0.0.1:{}/%2f",
            u32::from(self.base_port) + i - 1
        )
    }

    /// Management API base URL of node `i` (1-based).
    pub fn mgmt_url(&self, i: u32) -> String {
        format!(
            "http://127.0.0.1:{}",
            u32::from(self.base_port) + 10000 + i - 1
        )
    }

    /// Erlang node name of node `i` (1-based).
    pub fn node_name(&self, i: u32) -> String {
        format!("{}-{i}@localhost", self.name)
    }

    /// `scripts/cluster.sh` with `args`, off the async runtime; panics on failure.
    pub async fn script(&self, args: &[&str]) -> String {
        let n = Nodes {
            owned: false,
            name: self.name.clone(),
            ..*self
        };
        let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            n.run(&refs)
        })
        .await
        .expect("cluster.sh task")
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `rabbitmqctl -n <node i> eval <expr>`; the printed result.
    pub async fn eval(&self, i: u32, expr: &str) -> String {
        let i = i.to_string();
        self.script(&["ctl", &i, "eval", expr])
            .await
            .trim()
            .to_owned()
    }

    /// `rabbitmqctl -n <node i> args...` (through the script, which knows the nodes' user and,
    /// for another RabbitMQ version, its chroot); panics on failure.
    pub async fn rabbitmqctl(&self, i: u32, args: &[&str]) {
        let i = i.to_string();
        let mut full = vec!["ctl", i.as_str()];
        full.extend_from_slice(args);
        self.script(&full).await;
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        if self.owned {
            if let Err(e) = self.run(&["clean"]) {
                eprintln!("{e}");
            }
        }
    }
}
