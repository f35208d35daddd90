//! The name prefix of the broker tests' objects; everything else comes from
//! `redeliver-testkit`.

/// A unique prefix for every object a test declares, such as "t3f9a0c1b2d4e.".
pub fn prefix() -> String {
    redeliver_testkit::unique_prefix("t", 12, ".")
}
