//! Text and times that come from the broker, made safe to print.
//!
//! Anyone with publish rights chooses a message's properties, headers and body, and the routing
//! key and queue names it travels through. Printed raw, an ESC sequence repaints or retitles the
//! operator's terminal, a `\r` overwrites a line, a `\n` forges one, and a bidi override (U+202E)
//! makes `rm-queue` read as something else. So every string from the broker goes through
//! [`escape`] before it reaches a table or a message dump, and every JSON document through
//! [`json_safe`]; numbers the broker hands over go through [`unix_time`], which has no range to
//! overflow.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::{Duration, UNIX_EPOCH};

/// Characters that act on a terminal, or hide or reorder the text around them, rather than
/// show as themselves: every control character (C0, DEL, C1: U+009B is CSI for terminals that
/// take 8-bit controls), the bidi embeddings, overrides and isolates, zero-width characters and
/// joiners, the line and paragraph separators, the BOM, interlinear annotations and the tag
/// characters (invisible text that some tools still pass on).
pub(crate) fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}'
                | '\u{061C}'
                | '\u{180E}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{206F}'
                | '\u{FEFF}'
                | '\u{FFF9}'..='\u{FFFB}'
                | '\u{E0000}'..='\u{E007F}'
        )
}

/// `s` with every [`is_unsafe`] character written as a visible escape: `\n`, `\r`, `\t`, `\0`,
/// else `\u{1b}` (Rust's notation). Everything else, backslashes included, is left as it is:
/// the text stays readable, and `--json` gives the exact value when one is ambiguous.
pub(crate) fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        push_escaped(&mut out, c);
    }
    Cow::Owned(out)
}

fn push_escaped(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        '\0' => out.push_str("\\0"),
        c if is_unsafe(c) => {
            // Writing to a String cannot fail.
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
        c => out.push(c),
    }
}

/// Like [`escape`], for text shown on several lines (a text body in `peek`): each newline is
/// escaped too, so no line of it can pass for one of ours, and followed by a real line break so
/// the text stays readable.
pub(crate) fn escape_lines(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        push_escaped(&mut out, c);
        if c == '\n' {
            out.push('\n');
        }
    }
    out
}

/// A document serialized by serde_json with every [`is_unsafe`] character it leaves raw
/// written as a `\uXXXX` escape. serde_json escapes U+0000..U+001F inside strings itself, so
/// a raw one is the layout of pretty output and stays; the others (DEL, C1, bidi, invisible)
/// can only occur inside strings, where the escape means the same character. The document
/// keeps its exact values and stays valid, and a terminal showing it sees no control character.
pub(crate) fn json_safe(json: &str) -> Cow<'_, str> {
    let escaped = |c: char| c >= ' ' && is_unsafe(c);
    if !json.chars().any(escaped) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if escaped(c) {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{u:04x}");
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Last second that RFC 3339 can write (9999-12-31T23:59:59Z).
pub(crate) const RFC3339_MAX_SECS: u64 = 253_402_300_799;

/// Unix seconds (an AMQP `timestamp`, any u64 a publisher chose) as text: RFC 3339
/// (`2024-05-01T12:00:00Z`) up to the end of year 9999, beyond that the ISO 8601 expanded year
/// (`+584554051223-11-09T07:00:15Z`). Total: no value overflows or panics, and a time past 9999
/// is shown for what it is, yet never parses as RFC 3339, so it counts as undated wherever a
/// time is compared (`--older-than`, `stats`).
pub(crate) fn unix_time(secs: u64) -> String {
    if secs <= RFC3339_MAX_SECS {
        return humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs))
            .to_string();
    }
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "+{y}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 -> (year, month, day) in the proleptic Gregorian calendar (Howard
/// Hinnant's `civil_from_days`, unsigned since the days are never before the epoch). u128
/// because u64::MAX seconds are 2.1e14 days, and the intermediate products need more than u64.
fn civil_from_days(days: u64) -> (u128, u32, u32) {
    let z = u128::from(days) + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + u128::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_what_a_terminal_acts_on() {
        assert_eq!(escape("plain é ü 中文 \\ \"q\""), "plain é ü 中文 \\ \"q\"");
        assert_eq!(
            escape("\x1b[31mred\r\nnext\0\t\u{7f}\u{9b}"),
            "\\u{1b}[31mred\\r\\nnext\\0\\t\\u{7f}\\u{9b}"
        );
        assert_eq!(escape("abc\u{202e}fed"), "abc\\u{202e}fed");
        assert_eq!(
            escape("a\u{2066}b\u{200b}c\u{e0041}"),
            "a\\u{2066}b\\u{200b}c\\u{e0041}"
        );
        assert_eq!(escape_lines("one\ntwo\r"), "one\\n\ntwo\\r");
    }

    #[test]
    fn json_stays_exact_and_valid() {
        let value = serde_json::json!({ "k\u{202e}": "a\u{9b}b\u{1b}c\u{e0041}" });
        let text = serde_json::to_string(&value).unwrap();
        let safe = json_safe(&text);
        assert!(!safe.chars().any(is_unsafe), "{safe}");
        assert_eq!(
            safe, r#"{"k\u202e":"a\u009bb\u001bc\udb40\udc41"}"#,
            "surrogate pair for the tag character"
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&safe).unwrap(),
            value
        );
    }

    #[test]
    fn times_past_9999_are_expanded_years() {
        assert_eq!(unix_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(unix_time(RFC3339_MAX_SECS), "9999-12-31T23:59:59Z");
        assert_eq!(unix_time(RFC3339_MAX_SECS + 1), "+10000-01-01T00:00:00Z");
        assert_eq!(unix_time(u64::MAX), "+584554051223-11-09T07:00:15Z");
        assert_eq!(crate::message::parse_rfc3339(&unix_time(u64::MAX)), None);
    }

    proptest! {
        #[test]
        fn calendar_agrees_with_humantime(secs in 0..=RFC3339_MAX_SECS) {
            let (days, rem) = (secs / 86_400, secs % 86_400);
            let (y, m, d) = civil_from_days(days);
            let ours = format!(
                "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
                rem / 3600,
                rem / 60 % 60,
                rem % 60
            );
            prop_assert_eq!(ours, unix_time(secs));
        }

        #[test]
        fn any_time_renders(secs in any::<u64>()) {
            let t = unix_time(secs);
            prop_assert!(t.ends_with('Z'));
            prop_assert!(!t.chars().any(is_unsafe));
        }

        #[test]
        fn escaped_text_has_no_unsafe_character(
            s in proptest::collection::vec(any::<char>(), 0..64).prop_map(String::from_iter)
        ) {
            prop_assert!(!escape(&s).chars().any(is_unsafe));
            prop_assert!(!escape_lines(&s).chars().any(|c| is_unsafe(c) && c != '\n'));
            let json = serde_json::to_string_pretty(&[&s]).unwrap();
            let safe = json_safe(&json);
            prop_assert!(!safe.chars().any(|c| is_unsafe(c) && c != '\n'));
            prop_assert_eq!(serde_json::from_str::<[String; 1]>(&safe).unwrap(), [s]);
        }
    }
}
