//! What the fuzz targets share: arbitrary AMQP values ([`amqp`]), the CLI's rendering code
//! ([`cli`]) and the check that a secret never shows ([`secret`]).
//!
//! The CLI has no library target, and its rendering modules are private to it: they are
//! compiled here from their own files (`#[path]`), at the crate root where their `crate::`
//! paths point, so the fuzzer runs the CLI's code itself, not a copy. They use nothing of the
//! CLI but each other; a change that makes them use more breaks this build in `.ci/run`.

#[allow(dead_code, unreachable_pub)]
#[path = "../../crates/cli/src/message.rs"]
mod message;
#[allow(dead_code, unreachable_pub)]
#[path = "../../crates/cli/src/output.rs"]
mod output;
#[allow(dead_code, unreachable_pub)]
#[path = "../../crates/cli/src/select.rs"]
mod select;
#[allow(dead_code, unreachable_pub)]
#[path = "../../crates/cli/src/text.rs"]
mod text;

pub mod amqp;
pub mod cli;
pub mod secret;
