//! A password that must never show: every password the URL and environment targets build holds
//! a canary, and no text printed about the URL may contain it, in any spelling.

/// Stands in the password at a position the fuzzer chooses. Upper-case letters that no fixed
/// text of redeliver, lapin or amq-protocol-uri holds; the targets make sure the rest of the URL
/// (user, host, vhost, in every decoding) holds none of them either, so the canary can only
/// reach an output through the password.
pub const CANARY: &str = "QZJXK";

/// Every spelling of the canary a leak could take: as is, and percent-encoded.
pub fn spellings() -> Vec<String> {
    let upper: String = CANARY.bytes().map(|b| format!("%{b:02X}")).collect();
    vec![CANARY.to_owned(), upper.clone(), upper.to_lowercase()]
}

/// Whether `text` shows the canary in any spelling, ignoring case (a URL parser may change the
/// case of what it normalizes) and tabs and line breaks (which URL parsers drop).
pub fn leaks(text: &str) -> bool {
    let lower: String = text
        .to_lowercase()
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect();
    spellings()
        .iter()
        .any(|s| lower.contains(&s.to_lowercase()))
}

/// `s` without the canary's letters (either case): for the user, host and vhost parts of a
/// URL. Only a percent-encoded canary can then be in them, which [`leaks`] finds: the targets
/// skip such input.
pub fn without_canary(s: &str) -> String {
    s.chars()
        .filter(|c| !CANARY.contains(c.to_ascii_uppercase()))
        .collect()
}

/// A part of a URL as a user writes it (user, host, vhost): `s` without the canary and without
/// the characters in `not` (those that would end the part early, as `@` ends a user). The
/// password is what has to be hostile in the URL targets; outside this domain they found gaps,
/// listed in RELIABILITY.md ("Fuzzing").
pub fn plain(s: &str, not: &str) -> String {
    without_canary(s)
        .chars()
        .filter(|c| !not.contains(*c))
        .collect()
}

/// Whether a password written raw makes a URL list ambiguous: an `@` (in it or before it)
/// followed by a `;` in it reads as one URL as much as two (`amqp://app:a@b;amqp://c@host` is
/// also a URL whose user is `c`). No redaction can tell; such a password must be
/// percent-encoded, and the encoded forms are checked.
pub fn ambiguous(before_password: &str, password: &str) -> bool {
    password
        .rfind(';')
        .is_some_and(|semi| before_password.contains('@') || password[..semi].contains('@'))
}
