//! [`shutdown_on_signal`]: SIGINT and SIGTERM as a [`CancellationToken`], the one way a service
//! stops its workers, relays and health server together.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::error::WorkerError;

/// A token cancelled on SIGTERM or SIGINT (Ctrl-C); on non-Unix platforms on Ctrl-C only. Give
/// it (or clones of it) to everything the service runs, so that one signal drains them all:
/// [`Worker::run`](crate::Worker::run), [`run_all`](crate::run_all), a `Relay`'s `run`, the
/// health server's `serve`. The signal is logged at INFO (event "shutdown requested").
///
/// The handlers are installed before it returns, so a signal arriving right after is not
/// missed. Once installed they stay for the life of the process (Tokio never restores the
/// default action): a second signal does nothing more, the drain still ends within the
/// [grace period](crate::WorkerBuilder::shutdown_grace); only SIGKILL cuts it short.
///
/// Must be called inside a Tokio runtime with its I/O driver enabled (`#[tokio::main]` is).
///
/// ```no_run
/// use redeliver::{Context, HandlerError, Raw, Worker};
///
/// #[tokio::main]
/// async fn main() -> Result<(), redeliver::WorkerError> {
///     let token = redeliver::shutdown_on_signal()?;
///     Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
///         .queue("images")
///         .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
///         .build()?
///         .run(token)
///         .await
/// }
/// ```
///
/// # Errors
///
/// [`WorkerError::Signal`] when called outside a Tokio runtime or when the SIGTERM handler (on
/// non-Unix platforms the Ctrl-C one) cannot be installed. A SIGINT handler that cannot be
/// installed on Unix is only logged: SIGTERM, what a supervisor sends, still works.
pub fn shutdown_on_signal() -> Result<CancellationToken, WorkerError> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| WorkerError::Signal(std::io::Error::other(e)))?;
    // Entered so that the handlers below register with this runtime's driver.
    let _entered = runtime.enter();
    let token = CancellationToken::new();
    runtime.spawn(cancel_on(token.clone(), installed()?));
    Ok(token)
}

/// Installs the handlers now and returns the future that waits for the first signal, with its
/// name.
#[cfg(unix)]
fn installed() -> Result<impl Future<Output = &'static str> + Send + 'static, WorkerError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(WorkerError::Signal)?;
    let mut int = match signal(SignalKind::interrupt()) {
        Ok(s) => Some(s),
        Err(e) => {
            // Without Ctrl-C support SIGTERM still works.
            warn!(error = %e, "cannot listen for SIGINT (Ctrl-C)");
            None
        }
    };
    Ok(async move {
        let interrupted = async {
            match int.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = interrupted => "SIGINT",
        }
    })
}

/// Installs the handler now and returns the future that waits for Ctrl-C, with its name.
#[cfg(not(unix))]
fn installed() -> Result<impl Future<Output = &'static str> + Send + 'static, WorkerError> {
    let mut ctrl_c = tokio::signal::windows::ctrl_c().map_err(WorkerError::Signal)?;
    Ok(async move {
        ctrl_c.recv().await;
        "Ctrl-C"
    })
}

/// Cancels `token` when `signal` completes; ends without cancelling when the token is cancelled
/// some other way first (the service stopped for another reason).
async fn cancel_on(token: CancellationToken, signal: impl Future<Output = &'static str>) {
    tokio::select! {
        name = signal => {
            info!(signal = name, "shutdown requested");
            token.cancel();
        }
        _ = token.cancelled() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_cancels_the_token() {
        let token = CancellationToken::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(cancel_on(token.clone(), async move {
            let _ = rx.await;
            "SIGTERM"
        }));
        tokio::task::yield_now().await;
        assert!(!token.is_cancelled(), "no signal yet");
        assert!(tx.send(()).is_ok());
        assert!(task.await.is_ok());
        assert!(token.is_cancelled());
    }

    #[tokio::test]
    async fn cancelled_otherwise_the_wait_ends() {
        let token = CancellationToken::new();
        token.cancel();
        // The signal never comes, yet the task ends: it holds nothing for the rest of the run.
        cancel_on(token, std::future::pending()).await;
    }

    #[test]
    fn outside_a_runtime_is_an_error_not_a_panic() {
        assert!(matches!(shutdown_on_signal(), Err(WorkerError::Signal(_))));
    }

    // The real signals are tested in tests/signal.rs, a binary of its own: installing the
    // handlers here would make this whole test binary ignore SIGTERM (a CI timeout's).
}
