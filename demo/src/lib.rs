//! The one-command demo (`bash scripts/demo.sh`) and the services it runs as separate
//! processes (`src/bin/`): `order_service` writes orders and their `order.created` events
//! through the outbox, `billing_service` applies them once each and emits `invoice.created`
//! (consume-transform-produce), `invoice_recorder` records those; `demo` starts them with
//! `postal relay` and checks that every order was applied exactly once, in order. The
//! integration suite's process-level tests run the same services.
//!
//! [`service`] holds the start-up pieces they share.

pub mod service;

/// The programs `demo` starts, each found next to its own executable: `postal` (from
/// `postal-cli`) and this package's services. The Dockerfile copies exactly these.
pub const DEMO_PROGRAMS: [&str; 4] = [
    "postal",
    "billing_service",
    "invoice_recorder",
    "order_service",
];

/// The variables `demo` reads besides `DATABASE_URL` and `KAFKA_BOOTSTRAP_SERVERS` (and the
/// consumer variables it passes on). docker-compose.yml's demo service sets only these and
/// Postal's own (a test checks).
pub const DEMO_VARIABLES: [&str; 5] = [
    "DEMO_ORDERS",
    "DEMO_RATE",
    "DEMO_CUSTOMERS",
    "DEMO_LOGS",
    "DEMO_STOP_HINT",
];
