//! Validation of queue names that travel as topic routing-key words.
//!
//! The delay infrastructure routes a message with the key `b(L-1). ... .b0.{queue}`, and each
//! consumer queue binds to the deliver exchange with `*. ... .*.{queue}`. The queue name therefore
//! becomes topic words: a `*` or `#` in it would be a wildcard in the binding, and an empty word
//! (leading, trailing or doubled dot) would make the binding match a different number of words than
//! the routing key carries.

/// AMQP short strings (queue, exchange names and routing keys) are at most 255 bytes.
pub const MAX_NAME_BYTES: usize = 255;

/// Why a name cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// The name is the empty string.
    #[error("the queue name is empty")]
    Empty,
    /// The name contains a topic wildcard character.
    #[error("queue name '{name}' contains the topic wildcard '{wildcard}'")]
    Wildcard {
        /// The offending name.
        name: String,
        /// `*` or `#`.
        wildcard: char,
    },
    /// The name has an empty topic word: a leading, trailing or doubled `.`.
    #[error("queue name '{name}' has an empty word (leading, trailing or doubled '.')")]
    EmptyWord {
        /// The offending name.
        name: String,
    },
    /// The name (plus whatever is prepended to it on the wire) exceeds 255 bytes.
    #[error("name '{name}' is {len} bytes, at most {max} are allowed here")]
    TooLong {
        /// The offending name.
        name: String,
        /// Its length in bytes.
        len: usize,
        /// The allowed maximum in bytes.
        max: usize,
    },
}

/// Checks that `name` can be used as a queue reached through the delay infrastructure.
///
/// Rejects the empty name, `*` and `#`, empty topic words (leading, trailing or doubled dots) and
/// names longer than 255 bytes. The delay infrastructure prepends `2 * levels` bytes of routing
/// key to the name; [`validate_routed_queue_name`] checks that tighter bound.
///
/// ```
/// use redeliver::amqp::validate_queue_name;
/// assert!(validate_queue_name("orders.eu").is_ok());
/// assert!(validate_queue_name("orders.*").is_err());
/// assert!(validate_queue_name("orders..eu").is_err());
/// ```
pub fn validate_queue_name(name: &str) -> Result<(), NameError> {
    validate_with_overhead(name, 0)
}

/// Like [`validate_queue_name`], and also checks that the routing key through `levels` delay
/// levels (`levels` one-character words, each followed by a dot, then `name`) fits in 255 bytes.
///
/// ```
/// use redeliver::amqp::validate_routed_queue_name;
/// assert!(validate_routed_queue_name(&"a".repeat(207), 24).is_ok());
/// assert!(validate_routed_queue_name(&"a".repeat(208), 24).is_err());
/// ```
pub fn validate_routed_queue_name(name: &str, levels: u8) -> Result<(), NameError> {
    validate_with_overhead(name, 2 * usize::from(levels))
}

fn validate_with_overhead(name: &str, overhead: usize) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if let Some(wildcard) = name.chars().find(|c| *c == '*' || *c == '#') {
        return Err(NameError::Wildcard {
            name: name.to_owned(),
            wildcard,
        });
    }
    if name.split('.').any(str::is_empty) {
        return Err(NameError::EmptyWord {
            name: name.to_owned(),
        });
    }
    let max = MAX_NAME_BYTES.saturating_sub(overhead);
    if name.len() > max {
        return Err(NameError::TooLong {
            name: name.to_owned(),
            len: name.len(),
            max,
        });
    }
    Ok(())
}

/// Checks that an exchange name or routing key fits in an AMQP short string (255 bytes).
pub(crate) fn validate_short(name: &str) -> Result<(), NameError> {
    if name.len() > MAX_NAME_BYTES {
        return Err(NameError::TooLong {
            name: name.to_owned(),
            len: name.len(),
            max: MAX_NAME_BYTES,
        });
    }
    Ok(())
}

/// Converts to a lapin short string without the panic of `ShortString::from` on long input.
pub(crate) fn short(name: &str) -> Result<lapin::types::ShortString, NameError> {
    lapin::types::ShortString::try_new(name).map_err(|_| NameError::TooLong {
        name: name.to_owned(),
        len: name.len(),
        max: MAX_NAME_BYTES,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_names() {
        for n in ["q", "orders", "orders.eu", "a-b_c.d1", "ünïcode.wörds"] {
            assert_eq!(validate_queue_name(n), Ok(()), "{n}");
        }
    }

    #[test]
    fn rejects_bad_names() {
        assert_eq!(validate_queue_name(""), Err(NameError::Empty));
        for n in ["a*", "#", "a.#.b", "*.a"] {
            assert!(
                matches!(validate_queue_name(n), Err(NameError::Wildcard { .. })),
                "{n}"
            );
        }
        for n in [".a", "a.", "a..b", "."] {
            assert!(
                matches!(validate_queue_name(n), Err(NameError::EmptyWord { .. })),
                "{n}"
            );
        }
        assert!(matches!(
            validate_queue_name(&"x".repeat(256)),
            Err(NameError::TooLong {
                len: 256,
                max: 255,
                ..
            })
        ));
        assert!(validate_queue_name(&"x".repeat(255)).is_ok());
    }

    #[test]
    fn routed_length_accounts_for_levels() {
        assert!(validate_routed_queue_name(&"x".repeat(207), 24).is_ok());
        assert!(matches!(
            validate_routed_queue_name(&"x".repeat(208), 24),
            Err(NameError::TooLong { max: 207, .. })
        ));
        assert!(short(&"x".repeat(256)).is_err());
        assert!(short(&"x".repeat(255)).is_ok());
    }
}
