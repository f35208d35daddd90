//! Which dead letters a `replay` or `purge` acts on: `--reason`, `--error-contains`,
//! `--older-than`, `--message-id`. Every criterion given must hold (AND); several
//! `--message-id`s are alternatives (OR) among themselves.

use std::time::{Duration, SystemTime};

use crate::message::Summary;

/// The selection criteria. The default selects everything.
#[derive(Clone, Debug, Default)]
pub(crate) struct Filter {
    /// Only these message_ids (any of them); empty = no restriction.
    pub message_ids: Vec<String>,
    /// Only messages whose [`Summary::reason`] is exactly this.
    pub reason: Option<String>,
    /// Only messages whose [`Summary::final_error`] contains this (case-sensitive).
    pub error_contains: Option<String>,
    /// Only messages dead-lettered at least this long before the command started.
    pub older_than: Option<Duration>,
}

impl Filter {
    /// True when no criterion is given: everything is selected.
    pub(crate) fn is_empty(&self) -> bool {
        self.message_ids.is_empty()
            && self.reason.is_none()
            && self.error_contains.is_none()
            && self.older_than.is_none()
    }

    /// True when `id` is one of the requested message_ids (false when none were requested).
    pub(crate) fn names_id(&self, id: Option<&str>) -> bool {
        id.is_some_and(|id| self.message_ids.iter().any(|m| m == id))
    }

    /// Does `s` meet every criterion? `now` is the command's start, so one run uses one cutoff
    /// however long it takes. A message whose dead-lettering time is unknown (no annotation, no
    /// x-death time, or a header that is not RFC 3339) is never "older than": a purge must not
    /// delete what it cannot prove old.
    pub(crate) fn matches(&self, s: &Summary, now: SystemTime) -> bool {
        let id_ok = self.message_ids.is_empty() || self.names_id(s.message_id.as_deref());
        let reason_ok = self
            .reason
            .as_ref()
            .is_none_or(|r| s.reason.as_ref() == Some(r));
        let error_ok = self.error_contains.as_ref().is_none_or(|needle| {
            s.final_error
                .as_deref()
                .is_some_and(|e| e.contains(needle.as_str()))
        });
        let age_ok = self.older_than.is_none_or(|min| {
            s.dead_lettered_time()
                .and_then(|at| now.duration_since(at).ok())
                .is_some_and(|age| age >= min)
        });
        id_ok && reason_ok && error_ok && age_ok
    }

    /// The criteria as command-line options, for reports ("matching --reason permanent").
    pub(crate) fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(r) = &self.reason {
            parts.push(format!("--reason {r}"));
        }
        if let Some(e) = &self.error_contains {
            parts.push(format!("--error-contains {e:?}"));
        }
        if let Some(d) = self.older_than {
            parts.push(format!("--older-than {}", humantime::format_duration(d)));
        }
        for id in &self.message_ids {
            parts.push(format!("--message-id {id}"));
        }
        parts.join(" ")
    }

    /// Requested message_ids that are not in `seen`, in the order they were given.
    pub(crate) fn missing_ids(&self, seen: &[String]) -> Vec<String> {
        self.message_ids
            .iter()
            .filter(|id| !seen.contains(id))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(id: &str, reason: Option<&str>, error: Option<&str>, at: Option<&str>) -> Summary {
        Summary {
            position: 1,
            message_id: Some(id.to_owned()),
            correlation_id: None,
            content_type: None,
            timestamp: None,
            exchange: String::new(),
            routing_key: String::new(),
            redelivered: false,
            first_failed_at: None,
            attempts: 0,
            last_error: None,
            original_exchange: None,
            original_routing_key: None,
            death_reason: None,
            death_count: None,
            x_death: Vec::new(),
            reason: reason.map(str::to_owned),
            final_error: error.map(str::to_owned),
            dead_lettered_at: at.map(str::to_owned),
            dead_letter_attempts: None,
            dead_lettered_by: None,
            delivery_count: None,
            destination: None,
            body_bytes: 0,
            body_preview: String::new(),
        }
    }

    fn now() -> SystemTime {
        humantime::parse_rfc3339("2024-05-01T12:00:00Z").unwrap()
    }

    #[test]
    fn empty_filter_selects_everything() {
        let f = Filter::default();
        assert!(f.is_empty());
        assert!(f.matches(&summary("a", None, None, None), now()));
    }

    #[test]
    fn criteria_combine_with_and() {
        let f = Filter {
            reason: Some("retries_exhausted".into()),
            error_contains: Some("timeout".into()),
            ..Filter::default()
        };
        let at = Some("2024-05-01T11:00:00Z");
        let both = summary("a", Some("retries_exhausted"), Some("read timeout"), at);
        let wrong_reason = summary("b", Some("permanent"), Some("read timeout"), at);
        let wrong_error = summary("c", Some("retries_exhausted"), Some("refused"), at);
        let no_error = summary("d", Some("retries_exhausted"), None, at);
        let upper = summary("e", Some("retries_exhausted"), Some("Timeout"), at);
        assert!(f.matches(&both, now()));
        assert!(!f.matches(&wrong_reason, now()));
        assert!(!f.matches(&wrong_error, now()));
        assert!(!f.matches(&no_error, now()));
        assert!(!f.matches(&upper, now()), "case-sensitive");
    }

    #[test]
    fn older_than_needs_a_known_time() {
        let f = Filter {
            older_than: Some(Duration::from_secs(1800)),
            ..Filter::default()
        };
        let old = summary("a", None, None, Some("2024-05-01T11:00:00Z"));
        let recent = summary("b", None, None, Some("2024-05-01T11:50:00.000Z"));
        let exact = summary("c", None, None, Some("2024-05-01T11:30:00Z"));
        let future = summary("d", None, None, Some("2024-05-02T00:00:00Z"));
        let unknown = summary("e", None, None, None);
        let garbage = summary("f", None, None, Some("last tuesday"));
        assert!(f.matches(&old, now()));
        assert!(!f.matches(&recent, now()));
        assert!(f.matches(&exact, now()), "at least that long ago");
        assert!(!f.matches(&future, now()));
        assert!(!f.matches(&unknown, now()));
        assert!(!f.matches(&garbage, now()));
    }

    #[test]
    fn message_ids_are_alternatives() {
        let f = Filter {
            message_ids: vec!["a".into(), "b".into()],
            ..Filter::default()
        };
        assert!(f.matches(&summary("a", None, None, None), now()));
        assert!(f.matches(&summary("b", None, None, None), now()));
        assert!(!f.matches(&summary("c", None, None, None), now()));
        assert_eq!(f.missing_ids(&["b".into()]), vec!["a".to_owned()]);
        assert!(!f.names_id(None));
    }

    #[test]
    fn describe_reads_like_the_command_line() {
        let f = Filter {
            reason: Some("permanent".into()),
            error_contains: Some("bad input".into()),
            older_than: Some(Duration::from_secs(1800)),
            message_ids: vec!["m1".into()],
        };
        assert_eq!(
            f.describe(),
            "--reason permanent --error-contains \"bad input\" --older-than 30m --message-id m1"
        );
    }
}
