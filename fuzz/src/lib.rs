//! What the fuzz targets share: arbitrary AMQP values ([`amqp`]) and the check that a secret
//! never shows ([`secret`]). The CLI's rendering code is reached through the CLI's library,
//! `redeliver_cli::fuzzing`.

pub mod amqp;
pub mod secret;
