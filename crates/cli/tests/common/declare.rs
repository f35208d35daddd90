//! Declaring a topology through the binary, for the tests that start from one.

use crate::cleanup::cli;
use crate::common::LEVELS;

/// Declares `queue`'s topology (and the delay levels) through the binary.
pub(crate) fn declare(queue: &str, prefix: &str, extra: &[&str]) {
    let levels = LEVELS.to_string();
    let mut args = vec![
        "topology", "declare", queue, "--prefix", prefix, "--levels", &levels,
    ];
    args.extend_from_slice(extra);
    cli(&args).ok();
}
