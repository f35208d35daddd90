//! The name prefix of the broker tests' objects; everything else comes from
//! `redeliver-testkit`.

// Test code: helpers are `pub` for the test files that include this module.
#![allow(unreachable_pub)]

/// A unique prefix for every object a test declares, such as "t3f9a0c1b2d4e.".
pub fn prefix() -> String {
    redeliver_testkit::unique_prefix("t", 12, ".")
}
