//! `outbox status` and `outbox parked …`: the PostgreSQL outbox of redeliver-postgres.
//!
//! The only commands that talk to the database instead of the broker, so main runs them before
//! reading any broker setting. Errors go through the same rendering as the others
//! ([`errors::render_with`]), with hints of their own and the database password scrubbed;
//! the exit codes are the same: 1 when the database cannot be reached or the table is missing,
//! 2 for the command line (no URL, a bad URL or table name, a purge without --yes, a build
//! without the feature). The parked-row commands are in [`crate::parked`].

use std::process::ExitCode;
use std::time::Duration;

use crate::cli::OutboxCmd;
use crate::errors;

/// Runs `cmd` and prints its error, if any, as the other commands do.
pub(crate) fn main(cmd: OutboxCmd, connect_timeout: Duration) -> ExitCode {
    let password = cmd.db().database_url.as_deref().and_then(password_of);
    match run(cmd, connect_timeout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let scrubbed = |s: &str| scrub(s, password.as_deref());
            eprint!("{}", errors::render_with(&e, &hints(&e), &scrubbed));
            ExitCode::from(errors::exit_code(&e))
        }
    }
}

#[cfg(not(feature = "postgres"))]
fn run(_: OutboxCmd, _: Duration) -> anyhow::Result<()> {
    Err(errors::UsageError(
        "this redeliver was built without its `postgres` feature, which the outbox commands \
         need: build it with the default features (`cargo install --path crates/cli`) or \
         `--features postgres`"
            .to_owned(),
    )
    .into())
}

#[cfg(not(feature = "postgres"))]
fn hints(_: &anyhow::Error) -> Vec<String> {
    Vec::new()
}

#[cfg(feature = "postgres")]
fn run(cmd: OutboxCmd, timeout: Duration) -> anyhow::Result<()> {
    match cmd {
        OutboxCmd::Status(args) => db::status(&args, timeout),
        OutboxCmd::Parked(cmd) => crate::parked::run(cmd, timeout),
    }
}

#[cfg(feature = "postgres")]
use db::hints;

#[cfg(feature = "postgres")]
use crate::outbox_db as db;

/// The password of a PostgreSQL URL (in the user info, or a `password=` parameter), as written.
fn password_of(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let from_userinfo = rest[..end]
        .rsplit_once('@')
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, password)| password.to_owned());
    let from_query = rest
        .split_once('?')
        .and_then(|(_, query)| query.split('&').find_map(|kv| kv.strip_prefix("password=")))
        .map(str::to_owned);
    from_userinfo.or(from_query).filter(|p| !p.is_empty())
}

/// `text` with every spelling of `password` (as written in the URL, and percent-decoded)
/// replaced by `***`.
fn scrub(text: &str, password: Option<&str>) -> String {
    let Some(password) = password else {
        return text.to_owned();
    };
    let mut out = text.replace(password, "***");
    let decoded = percent_decode(password);
    if !decoded.is_empty() && decoded != password {
        out = out.replace(&decoded, "***");
    }
    out
}

/// `%XX` escapes decoded (invalid ones kept as they are), lossily as UTF-8.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_found_and_scrubbed_in_every_spelling() {
        assert_eq!(
            password_of("postgres://app:p%40ss@db/app").as_deref(),
            Some("p%40ss")
        );
        assert_eq!(
            password_of("postgres://db/app?user=app&password=s3cret").as_deref(),
            Some("s3cret")
        );
        assert_eq!(password_of("postgres://app@db/app"), None);
        assert_eq!(scrub("a p%40ss b p@ss c", Some("p%40ss")), "a *** b *** c");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%41"), "%zzA");
    }
}
