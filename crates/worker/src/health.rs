//! Health and metrics over HTTP: `/livez`, `/readyz` and `/metrics`, for Kubernetes probes and
//! Prometheus scrapes. Nothing here runs unless the service starts it.
//!
//! | path | 200 when | otherwise |
//! |---|---|---|
//! | `/livez` | the process answers and its Tokio event loop is responsive (a heartbeat task ticked within the [stall threshold](Health::stall_threshold)) | 503 `event loop stalled` |
//! | `/readyz` | **every** registered worker is [consuming](crate::WorkerState::Consuming) | 503 while starting, connecting, reconnecting, draining or stopped, and when no worker is registered |
//! | `/metrics` | a [`PrometheusHandle`] was given: the Prometheus text format | 404 |
//!
//! Liveness never looks at the broker: a broker outage must not make Kubernetes restart every pod
//! (a restart cannot fix the broker, and all pods would crash-loop together). Readiness does: a pod
//! that is reconnecting or draining is taken out of rotation. Both answer a small JSON body
//! (`{"status":"ready","workers":[{"queue":"images","state":"consuming","ready":true}]}`) so that
//! `curl` tells an operator which worker is not ready.
//!
//! # Metrics
//!
//! The worker emits through the [`metrics`] facade (names in [`metrics_names`](crate::metrics_names)), which records
//! nothing until a recorder is installed. [`install_prometheus`] installs the Prometheus recorder
//! of `metrics-exporter-prometheus` as the process-wide recorder (once; later calls return the same
//! handle) with histogram buckets for [`HANDLER_DURATION`](crate::metrics_names::HANDLER_DURATION) and a
//! `# HELP` line for every worker metric. To combine it with other recorders, build one from
//! [`prometheus_builder`] yourself and pass its handle to [`Health::metrics`].
//!
//! # Example
//!
//! ```no_run
//! use redeliver::worker::health::{self, Health};
//! use redeliver::{CancellationToken, Context, HandlerError, Raw, Worker};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let worker = Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .queue("images")
//!     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
//!     .build()?;
//! let server = Health::new()
//!     .worker(worker.status_handle()) // 503 until the worker consumes
//!     .metrics(health::install_prometheus()?)
//!     .bind("0.0.0.0:8080")
//!     .await?;
//! println!("health on http://{}", server.local_addr());
//! // A token of its own, cancelled after the drain, so that probes see 503 while it happens.
//! let http_stop = CancellationToken::new();
//! let http = server.spawn(http_stop.clone());
//! worker.run(redeliver::shutdown_on_signal()?).await?;
//! http_stop.cancel();
//! http.await??;
//! # Ok(()) }
//! ```

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
// tokio's `net` feature comes with axum's `tokio` feature (axum::serve needs it).
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio_util::sync::CancellationToken;

use crate::status::WorkerStatus;

mod prometheus;

pub use prometheus::{install_prometheus, prometheus_builder, HANDLER_DURATION_BUCKETS};

/// Default [stall threshold](Health::stall_threshold) of `/livez`: well above any scheduling
/// hiccup, well below a probe's `periodSeconds * failureThreshold`.
pub const DEFAULT_STALL_THRESHOLD: Duration = Duration::from_secs(10);

/// Period of the heartbeat task that `/livez` watches.
const HEARTBEAT_PERIOD: Duration = Duration::from_millis(500);

/// Content type of the Prometheus text exposition format.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Why the health server or the metrics recorder could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HealthError {
    /// The address could not be bound (in use, no permission, unresolvable).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address as given.
        addr: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The server stopped with an I/O error.
    #[error("health server failed: {0}")]
    Serve(#[source] io::Error),
    /// Another `metrics` recorder is already installed in this process, so the Prometheus one
    /// cannot be: build one with [`prometheus_builder`] and compose the two yourself.
    #[error("cannot install the Prometheus recorder: another metrics recorder is already installed in this process")]
    RecorderInstalled,
}

/// Last heartbeat, in milliseconds since `start`.
struct Heartbeat {
    start: Instant,
    last_ms: AtomicU64,
}

impl Heartbeat {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn beat(&self) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(now, Ordering::Relaxed);
    }

    fn since_last(&self) -> Duration {
        let now = self.start.elapsed();
        now.saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// Ticks the heartbeat until the router that reads it is dropped (it only holds a `Weak`).
async fn heartbeat_task(beat: Weak<Heartbeat>) {
    let mut tick = tokio::time::interval(HEARTBEAT_PERIOD);
    // After a stall, one late tick is the truth; a burst of catch-up ticks would hide it.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match beat.upgrade() {
            Some(b) => b.beat(),
            None => return,
        }
    }
}

#[derive(Clone)]
struct AppState {
    workers: Arc<[WorkerStatus]>,
    metrics: Option<PrometheusHandle>,
    heartbeat: Option<Arc<Heartbeat>>,
    stall_threshold: Duration,
}

/// What the health endpoints report on: the workers whose readiness counts, and the metrics
/// handle. Turn it into a server with [`bind`](Self::bind), or into an [`axum::Router`] to mount
/// in a server of your own with [`into_router`](Self::into_router).
#[derive(Clone)]
pub struct Health {
    workers: Vec<WorkerStatus>,
    metrics: Option<PrometheusHandle>,
    stall_threshold: Duration,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field(
                "workers",
                &self
                    .workers
                    .iter()
                    .map(WorkerStatus::queue)
                    .collect::<Vec<_>>(),
            )
            .field("metrics", &self.metrics.is_some())
            .field("stall_threshold", &self.stall_threshold)
            .finish()
    }
}

impl Health {
    /// No workers (so `/readyz` is 503), no metrics (so `/metrics` is 404).
    pub fn new() -> Self {
        Self {
            workers: Vec::new(),
            metrics: None,
            stall_threshold: DEFAULT_STALL_THRESHOLD,
        }
    }

    /// Adds a worker whose readiness `/readyz` requires (from
    /// [`Worker::status_handle`](crate::Worker::status_handle), so the server can
    /// start, and answer 503, before the worker connects).
    pub fn worker(mut self, status: WorkerStatus) -> Self {
        self.workers.push(status);
        self
    }

    /// Adds several workers (see [`worker`](Self::worker)).
    pub fn workers(mut self, statuses: impl IntoIterator<Item = WorkerStatus>) -> Self {
        self.workers.extend(statuses);
        self
    }

    /// Serves `/metrics` from this handle (from [`install_prometheus`], or from a recorder built
    /// with [`prometheus_builder`]).
    pub fn metrics(mut self, handle: PrometheusHandle) -> Self {
        self.metrics = Some(handle);
        self
    }

    /// How long the heartbeat may be late before `/livez` answers 503. Default
    /// [`DEFAULT_STALL_THRESHOLD`] (10 s).
    pub fn stall_threshold(mut self, d: Duration) -> Self {
        self.stall_threshold = d;
        self
    }

    /// The three routes as an [`axum::Router`], to merge into an existing server.
    ///
    /// Called inside a Tokio runtime it also spawns the heartbeat task that `/livez` watches (it
    /// ends when the router is dropped); outside one, `/livez` only proves that the server
    /// answers.
    pub fn into_router(self) -> Router {
        let heartbeat = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let beat = Arc::new(Heartbeat::new());
            rt.spawn(heartbeat_task(Arc::downgrade(&beat)));
            beat
        });
        let state = AppState {
            workers: self.workers.into(),
            metrics: self.metrics,
            heartbeat,
            stall_threshold: self.stall_threshold,
        };
        Router::new()
            .route("/livez", get(livez))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics_route))
            .with_state(state)
    }

    /// Binds the listener (`"0.0.0.0:8080"`, `"127.0.0.1:0"` for a random port, a
    /// [`SocketAddr`]...). Binding is separate from serving so that a bad address fails at
    /// startup and so that the chosen port is known ([`HealthServer::local_addr`]).
    pub async fn bind<A>(self, addr: A) -> Result<HealthServer, HealthError>
    where
        A: ToSocketAddrs + fmt::Debug,
    {
        let shown = format!("{addr:?}").trim_matches('"').to_owned();
        let bind_error = |source| HealthError::Bind {
            addr: shown.clone(),
            source,
        };
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(bind_error)?
            .collect();
        let listener = match TcpListener::bind(addrs.as_slice()).await {
            Ok(l) => l,
            // `[::]` (a bare port) is dual-stack on Linux; on a host without IPv6 fall back to
            // every IPv4 address.
            Err(e) => match addrs.as_slice() {
                [only] if only.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) => {
                    TcpListener::bind((Ipv4Addr::UNSPECIFIED, only.port()))
                        .await
                        .map_err(|_| bind_error(e))?
                }
                _ => return Err(bind_error(e)),
            },
        };
        let local_addr = listener.local_addr().map_err(bind_error)?;
        Ok(HealthServer {
            listener,
            local_addr,
            health: self,
        })
    }
}

/// A bound health server; [`serve`](Self::serve) or [`spawn`](Self::spawn) it.
#[derive(Debug)]
pub struct HealthServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    health: Health,
}

impl HealthServer {
    /// The address actually bound (the real port when `:0` was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` is cancelled, then stops accepting, lets open requests finish and
    /// returns.
    pub async fn serve(self, shutdown: CancellationToken) -> Result<(), HealthError> {
        tracing::info!(addr = %self.local_addr, "health server listening (/livez, /readyz, /metrics)");
        let router = self.health.into_router();
        axum::serve(self.listener, router)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
            .map_err(HealthError::Serve)
    }

    /// [`serve`](Self::serve) on a new Tokio task.
    pub fn spawn(
        self,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<Result<(), HealthError>> {
        tokio::spawn(self.serve(shutdown))
    }
}

fn json(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn livez(State(state): State<AppState>) -> Response {
    // Answering at all proves the runtime runs this task; the heartbeat proves timers and other
    // tasks are being driven too (a handler blocking a worker thread shows up here).
    let late = state.heartbeat.as_ref().map(|b| b.since_last());
    match late {
        Some(late) if late > state.stall_threshold => json(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({
                "status": "event loop stalled",
                "heartbeat_age_ms": u64::try_from(late.as_millis()).unwrap_or(u64::MAX),
            }),
        ),
        _ => json(StatusCode::OK, serde_json::json!({ "status": "alive" })),
    }
}

async fn readyz(State(state): State<AppState>) -> Response {
    let workers: Vec<serde_json::Value> = state
        .workers
        .iter()
        .map(|w| {
            let s = w.state();
            serde_json::json!({
                "queue": w.queue(),
                "state": s.as_str(),
                "blocked": w.is_blocked(),
                "retry_mode": w.retry_mode().map(|m| m.to_string()),
                "native_retry_ignored": w.native_retry_ignored(),
                "ready": w.is_ready(),
            })
        })
        .collect();
    // Not ready without workers: a server started before registering any must not receive
    // traffic it cannot serve.
    let ready = !state.workers.is_empty() && state.workers.iter().all(WorkerStatus::is_ready);
    let (code, status) = if ready {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    };
    json(
        code,
        serde_json::json!({ "status": status, "workers": workers }),
    )
}

async fn metrics_route(State(state): State<AppState>) -> Response {
    match &state.metrics {
        Some(handle) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            handle.render(),
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            "metrics are not enabled (Health::metrics was not given a handle)\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics_names as m;
    use crate::status::StatusSender;
    use crate::WorkerState;

    /// (status, body) of `GET http://{addr}{path}` (ureq in a blocking task: it is synchronous).
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let url = format!("http://{addr}{path}");
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(5)))
                .build()
                .into();
            let mut resp = agent.get(&url).call().expect("request");
            let status = resp.status().as_u16();
            let body = resp.body_mut().read_to_string().expect("body");
            (status, body)
        })
        .await
        .expect("join")
    }

    async fn start(health: Health) -> (SocketAddr, CancellationToken) {
        let token = CancellationToken::new();
        let server = health.bind("127.0.0.1:0").await.expect("bind");
        let addr = server.local_addr();
        server.spawn(token.clone());
        (addr, token)
    }

    #[tokio::test]
    async fn readyz_requires_every_worker_consuming() {
        let a = StatusSender::new();
        a.set_queue("a".into());
        let b = StatusSender::new();
        b.set_queue("b".into());
        let (addr, token) = start(Health::new().worker(a.handle()).worker(b.handle())).await;

        let (code, body) = get(addr, "/readyz").await;
        assert_eq!(code, 503, "{body}");
        assert!(body.contains(r#""state":"starting""#), "{body}");

        a.set(WorkerState::Consuming);
        let (code, body) = get(addr, "/readyz").await;
        assert_eq!(code, 503, "one worker still starting: {body}");

        b.set(WorkerState::Consuming);
        let (code, body) = get(addr, "/readyz").await;
        assert_eq!(code, 200, "{body}");
        assert!(body.contains(r#""status":"ready""#), "{body}");

        for not_ready in [
            WorkerState::Reconnecting,
            WorkerState::Draining,
            WorkerState::Stopped,
            WorkerState::Connecting,
        ] {
            b.set(not_ready);
            let (code, body) = get(addr, "/readyz").await;
            assert_eq!(code, 503, "{not_ready}: {body}");
            assert!(body.contains(not_ready.as_str()), "{body}");
        }
        token.cancel();
    }

    #[tokio::test]
    async fn no_worker_is_not_ready_and_livez_does_not_care() {
        let (addr, token) = start(Health::new()).await;
        assert_eq!(get(addr, "/readyz").await.0, 503);
        let (code, body) = get(addr, "/livez").await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(get(addr, "/metrics").await.0, 404);
        assert_eq!(get(addr, "/nope").await.0, 404);
        token.cancel();
    }

    #[tokio::test]
    async fn livez_reports_a_stalled_heartbeat() {
        // A heartbeat whose last beat is 2 s old, and no task to refresh it: what /livez sees
        // when the event loop could not run the heartbeat task.
        let beat = Arc::new(Heartbeat {
            start: Instant::now()
                .checked_sub(Duration::from_secs(2))
                .expect("uptime above 2 s"),
            last_ms: AtomicU64::new(0),
        });
        let state = AppState {
            workers: Arc::from(Vec::new()),
            metrics: None,
            heartbeat: Some(Arc::clone(&beat)),
            stall_threshold: Duration::from_secs(1),
        };
        let resp = livez(State(state.clone())).await;
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        beat.beat();
        assert_eq!(livez(State(state)).await.status(), StatusCode::OK);

        // And the real task keeps a served router alive.
        let (addr, token) = start(Health::new().stall_threshold(Duration::from_secs(1))).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(get(addr, "/livez").await.0, 200);
        token.cancel();
    }

    #[tokio::test]
    async fn metrics_render_prometheus_text() {
        let recorder = prometheus_builder().build_recorder();
        let handle = recorder.handle();
        // Recorded through the local recorder: no global state in unit tests.
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!(m::MESSAGES_RECEIVED, m::LABEL_QUEUE => "q1").increment(3);
            metrics::histogram!(m::HANDLER_DURATION, m::LABEL_QUEUE => "q1").record(0.02);
        });
        let (addr, token) = start(Health::new().metrics(handle)).await;
        let (code, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(
            body.contains(r#"redeliver_messages_received_total{queue="q1"} 3"#),
            "{body}"
        );
        assert!(
            body.contains(r#"redeliver_handler_duration_seconds_bucket{queue="q1",le="0.025"} 1"#),
            "histogram buckets expected: {body}"
        );
        token.cancel();
    }

    #[tokio::test]
    async fn a_bare_port_answers_on_ipv4_and_ipv6() {
        let token = CancellationToken::new();
        let server = Health::new()
            .bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)))
            .await
            .expect("bind");
        let port = server.local_addr().port();
        server.spawn(token.clone());
        let (code, _) = get(SocketAddr::from((Ipv4Addr::LOCALHOST, port)), "/livez").await;
        assert_eq!(code, 200, "over IPv4");
        if std::net::TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).is_ok() {
            let (code, _) = get(SocketAddr::from((Ipv6Addr::LOCALHOST, port)), "/livez").await;
            assert_eq!(code, 200, "over IPv6");
        }
        token.cancel();
    }

    #[tokio::test]
    async fn bind_error_names_the_address() {
        let taken = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = taken.local_addr().expect("addr");
        let err = Health::new().bind(addr).await.expect_err("port in use");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
