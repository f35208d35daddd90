//! What a handler reports, and how an unclassified error is classified.

use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A boxed error as handlers produce it.
pub type BoxError = Box<dyn Error + Send + Sync + 'static>;

/// What kind of failure a [`HandlerError`] is.
///
/// Non-exhaustive: a match outside this crate needs a `_` arm, so that a new kind (a new way to
/// settle a message) is not a breaking change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Worth retrying with the policy's backoff (Celery: an exception in `autoretry_for`).
    Transient,
    /// Never worth retrying: dead-letter at once (Celery: `Reject(requeue=False)`).
    Permanent,
    /// Retry after exactly this delay instead of the backoff, still counting against
    /// `max_retries` (Celery: `self.retry(countdown=...)`).
    RetryAfter(Duration),
    /// The handler did not say; the policy's [`Classifier`] decides. This is what an
    /// [`anyhow::Error`] converts to.
    Unclassified,
    /// Send the message on to the policy's [`Forward`](crate::Forward) destination (Celery: a
    /// task past its time limit sent to a bigger queue). Retried here like a transient error
    /// until the destination's [`after_attempts`](crate::Forward::after_attempts); without a
    /// destination the message is dead-lettered (reason `forward_unconfigured`).
    Forward,
}

#[derive(Debug)]
enum Source {
    Boxed(BoxError),
    // Kept as anyhow::Error (not boxed) so that `anyhow::Error::downcast_ref` can find typed
    // `.context(..)` layers, which a plain source-chain walk cannot see.
    Anyhow(anyhow::Error),
}

/// The error a handler returns: a [`kind`](ErrorKind) and the underlying error.
///
/// ```
/// use std::time::Duration;
/// use redeliver::{ErrorKind, HandlerError};
///
/// let e = HandlerError::transient("connection reset");
/// assert_eq!(e.kind(), ErrorKind::Transient);
///
/// let e = HandlerError::retry_after(Duration::from_secs(30), "rate limited");
/// assert_eq!(e.kind(), ErrorKind::RetryAfter(Duration::from_secs(30)));
///
/// // anyhow errors are Unclassified: the policy's Classifier decides.
/// let e: HandlerError = anyhow::anyhow!("disk full").context("saving thumbnail").into();
/// assert_eq!(e.kind(), ErrorKind::Unclassified);
/// assert_eq!(e.message(), "saving thumbnail: disk full");
/// ```
#[derive(Debug)]
pub struct HandlerError {
    kind: ErrorKind,
    source: Source,
    /// The dead-letter reason the handler named (see [`HandlerError::permanent_because`]).
    reason: Option<&'static str>,
}

impl HandlerError {
    /// An error of the given kind.
    pub fn new(kind: ErrorKind, e: impl Into<BoxError>) -> Self {
        HandlerError {
            kind,
            source: Source::Boxed(e.into()),
            reason: None,
        }
    }

    /// A failure worth retrying with the policy's backoff.
    pub fn transient(e: impl Into<BoxError>) -> Self {
        Self::new(ErrorKind::Transient, e)
    }

    /// A failure never worth retrying: the message is dead-lettered at once.
    pub fn permanent(e: impl Into<BoxError>) -> Self {
        Self::new(ErrorKind::Permanent, e)
    }

    /// Retry after exactly `d` (overriding the backoff and its jitter); the retry still counts
    /// against `max_retries`.
    pub fn retry_after(d: Duration, e: impl Into<BoxError>) -> Self {
        Self::new(ErrorKind::RetryAfter(d), e)
    }

    /// A permanent failure with a dead-letter reason of its own, shown in the
    /// `x-redeliver-dead-letter-reason` header (annotate mode), the `reason` label of
    /// `redeliver_messages_dead_lettered_total` and the span, instead of `permanent`; for a
    /// failure an operator should tell apart from the handler's other permanent errors (a
    /// message without the `message_id` an inbox needs, say). Use a stable `snake_case` name.
    ///
    /// ```
    /// use redeliver::{Decision, HandlerError, RetryPolicy};
    ///
    /// let e = HandlerError::permanent_because("no_message_id", "the inbox needs a message_id");
    /// match RetryPolicy::default().decide(0, None, &e) {
    ///     Decision::DeadLetter(reason) => assert_eq!(reason.as_str(), "no_message_id"),
    ///     other => panic!("unexpected {other:?}"),
    /// }
    /// ```
    pub fn permanent_because(reason: &'static str, e: impl Into<BoxError>) -> Self {
        HandlerError {
            reason: Some(reason),
            ..Self::permanent(e)
        }
    }

    /// The dead-letter reason given with [`permanent_because`](Self::permanent_because).
    pub fn dead_letter_reason(&self) -> Option<&'static str> {
        self.reason
    }

    /// A failure to send on to the policy's [`Forward`](crate::Forward) destination.
    pub fn forward(e: impl Into<BoxError>) -> Self {
        Self::new(ErrorKind::Forward, e)
    }

    /// An error whose kind the policy's [`Classifier`] decides.
    pub fn unclassified(e: impl Into<BoxError>) -> Self {
        Self::new(ErrorKind::Unclassified, e)
    }

    /// The kind the handler gave (possibly [`ErrorKind::Unclassified`]); see
    /// [`Classifier::classify`] for the effective one.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The underlying error.
    pub fn source_error(&self) -> &(dyn Error + Send + Sync + 'static) {
        match &self.source {
            Source::Boxed(b) => b.as_ref(),
            Source::Anyhow(a) => a.as_ref(),
        }
    }

    /// The underlying error and its sources, joined by `": "` ("a: b: c"), each text once (see
    /// [`error_chain`]). This is the text stored in the `x-redeliver-last-error` header.
    pub fn message(&self) -> String {
        error_chain(self.source_error())
    }

    /// The underlying error, then each of its sources in turn.
    pub fn chain(&self) -> impl Iterator<Item = &(dyn Error + 'static)> {
        let first: &(dyn Error + 'static) = self.source_error();
        std::iter::successors(Some(first), |e: &&(dyn Error + 'static)| (*e).source())
    }

    /// Whether the underlying error, any of its sources, or (for an `anyhow::Error`) any of its
    /// context layers is an `E`.
    pub fn is<E: Error + Send + Sync + 'static>(&self) -> bool {
        self.find::<E>().is_some()
    }

    /// The first `E` found in the error, its sources, or (for an `anyhow::Error`) its context
    /// layers.
    pub fn find<E: Error + Send + Sync + 'static>(&self) -> Option<&E> {
        if let Source::Anyhow(a) = &self.source {
            if let Some(e) = a.downcast_ref::<E>() {
                return Some(e);
            }
        }
        self.chain().find_map(|link| link.downcast_ref::<E>())
    }
}

impl From<anyhow::Error> for HandlerError {
    /// Kind [`ErrorKind::Unclassified`]: the policy's [`Classifier`] decides.
    fn from(e: anyhow::Error) -> Self {
        HandlerError {
            kind: ErrorKind::Unclassified,
            source: Source::Anyhow(e),
            reason: None,
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.source_error(), f)
    }
}

impl Error for HandlerError {
    // Transparent: Display already shows the underlying error, so its sources come next.
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source_error().source()
    }
}

/// An error and its `source()` chain on one line, joined by `": "` ("a: b: c").
///
/// A source whose text the previous text written already contains is left out, and so is an
/// empty one: many errors repeat their source in their own message (thiserror's
/// `#[error("reading config: {0}")]`, lapin's errors), and "reading config: not found: not
/// found" would tell the reader the same thing twice.
///
/// ```
/// use redeliver::policy::error_chain;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("saving thumbnail")]
/// struct Saving(#[source] std::io::Error);
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("saving thumbnail: {0}")]
/// struct Repeats(#[source] std::io::Error);
///
/// let disk_full = || std::io::Error::other("disk full");
/// assert_eq!(error_chain(&Saving(disk_full())), "saving thumbnail: disk full");
/// assert_eq!(error_chain(&Repeats(disk_full())), "saving thumbnail: disk full");
///
/// // anyhow's context layers are sources too.
/// let e = anyhow::anyhow!("disk full").context("saving thumbnail");
/// assert_eq!(error_chain(e.as_ref()), "saving thumbnail: disk full");
/// ```
pub fn error_chain(error: &dyn Error) -> String {
    let mut out = error.to_string();
    // Compared with the last text written, not with all of `out`: a short source text is then
    // less likely to be dropped because some unrelated link happened to contain it.
    let mut last = out.clone();
    let mut source = error.source();
    while let Some(link) = source {
        let text = link.to_string();
        if !last.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
            last = text;
        }
        source = link.source();
    }
    out
}

type Rule = Arc<dyn Fn(&HandlerError) -> Option<ErrorKind> + Send + Sync>;

/// Decides whether an [`ErrorKind::Unclassified`] error is transient or permanent, in the spirit
/// of Celery's `autoretry_for`.
///
/// Errors the handler already classified (transient, permanent, retry-after) are left alone.
/// For an unclassified one, the rules are tried in the order they were added and the first that
/// matches decides; if none matches, the default applies.
///
/// **The default is transient**: [`Classifier::default`] and
/// [`Classifier::transient_by_default`] retry an unclassified error (within `max_retries` and the
/// budget), on the grounds that a failure not known to be permanent deserves bounded retries.
/// Celery's own default is the opposite (only `autoretry_for` errors are retried); use
/// [`Classifier::permanent_by_default`] for that.
///
/// Type rules ([`transient_on`](Self::transient_on), [`permanent_on`](Self::permanent_on)) match
/// when the error, any error in its `source()` chain, or any `anyhow` context layer is of the
/// type.
///
/// ```
/// use redeliver::{Classifier, ErrorKind, HandlerError};
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("invalid image")]
/// struct InvalidImage;
///
/// let c = Classifier::transient_by_default().permanent_on::<InvalidImage>();
///
/// let e: HandlerError = anyhow::Error::new(InvalidImage).context("resizing").into();
/// assert_eq!(c.classify(&e), ErrorKind::Permanent);
///
/// let e: HandlerError = anyhow::anyhow!("timeout").into();
/// assert_eq!(c.classify(&e), ErrorKind::Transient);
/// ```
#[derive(Clone)]
pub struct Classifier {
    default: ErrorKind,
    rules: Vec<Rule>,
}

impl Classifier {
    /// Unclassified errors are transient unless a rule says otherwise. The default.
    pub fn transient_by_default() -> Self {
        Classifier {
            default: ErrorKind::Transient,
            rules: Vec::new(),
        }
    }

    /// Unclassified errors are permanent unless a rule says otherwise (Celery's behaviour: only
    /// `autoretry_for` errors are retried).
    pub fn permanent_by_default() -> Self {
        Classifier {
            default: ErrorKind::Permanent,
            rules: Vec::new(),
        }
    }

    /// Unclassified errors containing an `E` (see [`HandlerError::is`]) are transient.
    pub fn transient_on<E: Error + Send + Sync + 'static>(self) -> Self {
        self.rule(|e| e.is::<E>().then_some(ErrorKind::Transient))
    }

    /// Unclassified errors containing an `E` (see [`HandlerError::is`]) are permanent.
    pub fn permanent_on<E: Error + Send + Sync + 'static>(self) -> Self {
        self.rule(|e| e.is::<E>().then_some(ErrorKind::Permanent))
    }

    /// Unclassified errors containing an `E` are forwarded to the policy's
    /// [`Forward`](crate::Forward) destination; [`TimedOut`](crate::TimedOut) names handler
    /// timeouts.
    pub fn forward_on<E: Error + Send + Sync + 'static>(self) -> Self {
        self.rule(|e| e.is::<E>().then_some(ErrorKind::Forward))
    }

    /// A custom rule, called on the error and then on each of its sources, outermost first; the
    /// first `Some` decides (`Some(ErrorKind::Unclassified)` counts as no answer).
    ///
    /// ```
    /// use std::time::Duration;
    /// use redeliver::{Classifier, ErrorKind, HandlerError};
    ///
    /// let c = Classifier::default().with_fn(|e| {
    ///     e.to_string().contains("429").then_some(ErrorKind::RetryAfter(Duration::from_secs(60)))
    /// });
    /// let e: HandlerError = anyhow::anyhow!("HTTP 429").into();
    /// assert_eq!(c.classify(&e), ErrorKind::RetryAfter(Duration::from_secs(60)));
    /// ```
    pub fn with_fn(
        self,
        f: impl Fn(&(dyn Error + 'static)) -> Option<ErrorKind> + Send + Sync + 'static,
    ) -> Self {
        self.rule(move |e| {
            e.chain()
                .filter_map(&f)
                .find(|k| *k != ErrorKind::Unclassified)
        })
    }

    fn rule(
        mut self,
        r: impl Fn(&HandlerError) -> Option<ErrorKind> + Send + Sync + 'static,
    ) -> Self {
        self.rules.push(Arc::new(r));
        self
    }

    /// The kind used when no rule matches an unclassified error.
    pub fn default_kind(&self) -> ErrorKind {
        self.default
    }

    /// The effective kind of `err`: its own kind if the handler gave one, else the first
    /// matching rule's, else transient for a handler timeout ([`TimedOut`](crate::TimedOut)),
    /// else the default. Never [`ErrorKind::Unclassified`].
    pub fn classify(&self, err: &HandlerError) -> ErrorKind {
        if err.kind() != ErrorKind::Unclassified {
            return err.kind();
        }
        if let Some(kind) = self
            .rules
            .iter()
            .find_map(|r| r(err).filter(|k| *k != ErrorKind::Unclassified))
        {
            return kind;
        }
        // A timeout says nothing about the message: even a permanent-by-default policy retries
        // it, as it did when timeouts were reported as transient errors.
        if err.is::<crate::TimedOut>() {
            return ErrorKind::Transient;
        }
        self.default
    }
}

impl Default for Classifier {
    /// [`Classifier::transient_by_default`].
    fn default() -> Self {
        Self::transient_by_default()
    }
}

impl fmt::Debug for Classifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Classifier")
            .field("default", &self.default)
            .field("rules", &self.rules.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;

    #[derive(Debug, thiserror::Error)]
    #[error("invalid input {0}")]
    struct Invalid(u32);

    #[derive(Debug, thiserror::Error)]
    #[error("timed out")]
    struct Timeout;

    #[derive(Debug, thiserror::Error)]
    #[error("saving thumbnail")]
    struct Saving(#[source] Invalid);

    #[derive(Debug, thiserror::Error)]
    #[error("while processing order")]
    struct OrderCtx;

    fn unclassified(e: anyhow::Error) -> HandlerError {
        e.into()
    }

    #[test]
    fn default_is_transient() {
        let e = unclassified(anyhow::anyhow!("who knows"));
        assert_eq!(e.kind(), ErrorKind::Unclassified);
        assert_eq!(Classifier::default().classify(&e), ErrorKind::Transient);
        assert_eq!(Classifier::default().default_kind(), ErrorKind::Transient);
        assert_eq!(
            Classifier::transient_by_default().classify(&e),
            ErrorKind::Transient
        );
        assert_eq!(
            Classifier::permanent_by_default().classify(&e),
            ErrorKind::Permanent
        );
        let e = HandlerError::unclassified("plain");
        assert_eq!(Classifier::default().classify(&e), ErrorKind::Transient);
    }

    #[test]
    fn explicit_kinds_are_not_reclassified() {
        let c = Classifier::permanent_by_default().permanent_on::<Invalid>();
        assert_eq!(
            c.classify(&HandlerError::transient(Invalid(1))),
            ErrorKind::Transient
        );
        let d = Duration::from_secs(9);
        assert_eq!(
            c.classify(&HandlerError::retry_after(d, Invalid(1))),
            ErrorKind::RetryAfter(d)
        );
        let c = Classifier::transient_by_default().transient_on::<Invalid>();
        assert_eq!(
            c.classify(&HandlerError::permanent(Invalid(1))),
            ErrorKind::Permanent
        );
    }

    #[test]
    fn typed_rules_on_boxed_errors_and_source_chains() {
        let c = Classifier::transient_by_default().permanent_on::<Invalid>();
        assert_eq!(
            c.classify(&HandlerError::unclassified(Invalid(3))),
            ErrorKind::Permanent
        );
        // Found as the source of another error.
        assert_eq!(
            c.classify(&HandlerError::unclassified(Saving(Invalid(3)))),
            ErrorKind::Permanent
        );
        assert_eq!(
            c.classify(&HandlerError::unclassified(Timeout)),
            ErrorKind::Transient
        );
    }

    #[test]
    fn anyhow_downcast_through_context_layers() {
        let c = Classifier::permanent_by_default().transient_on::<Timeout>();
        let e = Err::<(), _>(Timeout)
            .context("calling the thumbnailer")
            .context("job 42")
            .unwrap_err();
        let e = unclassified(e);
        assert_eq!(c.classify(&e), ErrorKind::Transient);
        assert_eq!(e.message(), "job 42: calling the thumbnailer: timed out");

        // Deep inside a std source chain wrapped by anyhow context.
        let c = Classifier::transient_by_default().permanent_on::<Invalid>();
        let e = unclassified(anyhow::Error::new(Saving(Invalid(7))).context("outer"));
        assert_eq!(c.classify(&e), ErrorKind::Permanent);
        assert_eq!(e.find::<Invalid>().map(|i| i.0), Some(7));

        // A typed *context* value, only reachable through anyhow's own downcast.
        let c = Classifier::transient_by_default().permanent_on::<OrderCtx>();
        let e = unclassified(anyhow::anyhow!("db down").context(OrderCtx));
        assert_eq!(c.classify(&e), ErrorKind::Permanent);

        let e = unclassified(anyhow::anyhow!("db down").context("plain"));
        assert_eq!(c.classify(&e), ErrorKind::Transient);
    }

    #[test]
    fn first_matching_rule_wins() {
        let e = unclassified(anyhow::Error::new(Saving(Invalid(1))));
        let c = Classifier::default()
            .permanent_on::<Saving>()
            .transient_on::<Invalid>();
        assert_eq!(c.classify(&e), ErrorKind::Permanent);
        let c = Classifier::permanent_by_default()
            .transient_on::<Invalid>()
            .permanent_on::<Saving>();
        assert_eq!(c.classify(&e), ErrorKind::Transient);
    }

    #[test]
    fn with_fn_sees_every_link() {
        let c = Classifier::default()
            .with_fn(|_| Some(ErrorKind::Unclassified)) // no answer: ignored
            .with_fn(|e| {
                e.downcast_ref::<Invalid>()
                    .filter(|i| i.0 > 10)
                    .map(|_| ErrorKind::Permanent)
            });
        let big = HandlerError::unclassified(Saving(Invalid(11)));
        let small = HandlerError::unclassified(Saving(Invalid(1)));
        assert_eq!(c.classify(&big), ErrorKind::Permanent);
        assert_eq!(c.classify(&small), ErrorKind::Transient);
        assert!(format!("{c:?}").contains("rules: 2"));
    }

    #[test]
    fn display_message_and_source() {
        let e = HandlerError::permanent(Saving(Invalid(5)));
        assert_eq!(e.to_string(), "saving thumbnail");
        assert_eq!(e.message(), "saving thumbnail: invalid input 5");
        assert_eq!(
            Error::source(&e).map(|s| s.to_string()),
            Some("invalid input 5".to_string())
        );
        assert_eq!(e.source_error().to_string(), "saving thumbnail");
        let e = HandlerError::transient("just text");
        assert_eq!(e.message(), "just text");
        assert!(Error::source(&e).is_none());
        let e: HandlerError = anyhow::anyhow!("inner").context("outer").into();
        assert_eq!(e.to_string(), "outer");
        assert_eq!(e.message(), "outer: inner");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct Link {
        text: &'static str,
        #[source]
        source: Option<Box<Link>>,
    }

    /// An error whose chain has exactly these texts, outermost first.
    fn chain_of(texts: &[&'static str]) -> Link {
        let mut links = texts.iter().rev();
        let first = Link {
            text: links.next().copied().unwrap_or(""),
            source: None,
        };
        links.fold(first, |inner, text| Link {
            text,
            source: Some(Box::new(inner)),
        })
    }

    #[test]
    fn error_chain_does_not_repeat() {
        // thiserror's `{source}` in the message (the worker's former `error_chain` test).
        #[derive(Debug, thiserror::Error)]
        #[error("outer: {0}")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&e), "outer: inner");
        assert_eq!(HandlerError::transient(e).message(), "outer: inner");

        // A context repeating its cause (the CLI's former `chain_text` test).
        let e = anyhow::anyhow!("inner").context("outer: inner");
        assert_eq!(error_chain(e.as_ref()), "outer: inner");

        // The source quoted inside the message, not only at its end.
        let e = chain_of(&[
            "publish failed (connection reset), giving up",
            "connection reset",
        ]);
        assert_eq!(
            error_chain(&e),
            "publish failed (connection reset), giving up"
        );
    }

    #[test]
    fn error_chain_keeps_every_new_text() {
        assert_eq!(error_chain(&chain_of(&["a", "b", "c"])), "a: b: c");
        assert_eq!(error_chain(&chain_of(&["just one"])), "just one");
        // Skipped links do not hide the ones after them; empty texts are left out.
        assert_eq!(
            error_chain(&chain_of(&["reading x: eof", "eof", "", "disk"])),
            "reading x: eof: disk"
        );
        // Compared with the previous text only: "a" comes back after "b".
        assert_eq!(error_chain(&chain_of(&["a", "b", "a"])), "a: b: a");
    }
}
