//! Postal's integration suite: one test binary, one module per scenario.
//!
//! Services come from `DATABASE_URL` / `KAFKA_BOOTSTRAP_SERVERS` when set, else from
//! testcontainers (see `postal_integration_tests`). Every test takes a fresh database and
//! unique topic names.

mod cancel;
mod chain;
mod chaos;
mod cluster;
mod common;
mod concurrent_writers;
mod consume;
mod consumer_crash;
mod dashboard;
mod dashboard_browser;
mod dashboard_charts;
mod dead_letters;
mod enqueue;
mod examples;
mod explorer;
mod fence;
mod fresh_topic;
mod handlers;
mod hostile;
mod idle;
mod interop;
mod key_order;
mod migrations;
mod missing_topic;
mod monitoring;
mod netsplit;
mod order;
mod oversized;
mod pg_security;
mod poolers;
mod previous_release;
mod procs;
mod protocol;
mod rabbit_random;
mod rabbitmq;
mod rebalance;
mod recreated_topic;
mod relay;
mod relay_random;
mod replay_partitions;
mod review_activity;
mod review_activity2;
mod review_break;
mod review_checkout;
mod review_consumer;
mod review_dashboard;
mod review_locks;
mod review_locks2;
mod review_marks;
mod review_order;
mod review_rabbit;
mod review_reset;
mod review_stops;
mod secrets;
mod security;
mod smoke;
mod takeover;
mod tasks;
mod throughput;
mod trace;
mod upgrade;
