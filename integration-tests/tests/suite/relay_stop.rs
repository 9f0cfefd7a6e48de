//! A relay stopped at any moment of its start gives its key partitions up.

use std::time::Duration;

use postal_integration_tests::services;
use postal_producer::{KafkaConfig, KafkaTransport, RelayConfig};

use crate::common::RunningRelay;

/// Guarantee: a relay's graceful stop, whenever it comes — also while its first lease
/// heartbeat is under way — leaves no key partition leased to it, so the next relay claims at
/// once rather than after a whole lease. 60 relays one after the other on one database (the
/// default 60 s lease), each stopped 0 to 59 ms after its start (the window of its first
/// heartbeat): after each stop, no partition has a lease that has not run out.
///
/// Seen in CI before the fix (`security::a_wrong_password_or_an_untrusted_broker_is_said_plainly_and_loses_nothing`):
/// a relay stopped 50 ms after its start left all 256 partitions leased to itself for 60 s
/// (acquired at its start, committed after its `lease::leave`: the stop aborted the
/// heartbeat's task with its commit under way), and the next relay published nothing for a
/// minute. This test, before the fix: one of two runs failed, at relay 16 (256 partitions
/// left leased); after it, 4 of 4 passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stopped_during_its_first_heartbeat_leaves_no_partition_leased() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    for i in 0..60u64 {
        let transport =
            KafkaTransport::new(KafkaConfig::new(&svc.bootstrap)).expect("kafka transport");
        let relay = RunningRelay::start(&db.pool, transport, RelayConfig::default());
        tokio::time::sleep(Duration::from_millis(i)).await;
        relay.stop().await;
        let leased: Vec<(String, i64)> = sqlx::query_as(
            "SELECT owner::text, count(*) FROM postal.relay_partitions
             WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert!(
            leased.is_empty(),
            "relay {i}, stopped {i} ms after its start, left partitions leased: {leased:?}"
        );
    }
}
