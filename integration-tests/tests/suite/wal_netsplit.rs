//! A network cut between the WAL relay holding the slot and the database (docs/wal-relay.md
//! "One reader per slot"): PostgreSQL and Kafka on a test host of their own, two WAL relay
//! processes on two other hosts (network namespaces, `postal_integration_tests::hosts`).
//! Needs root and iproute2 (it says so and does nothing otherwise).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use postal_integration_tests::hosts::TestHosts;
use postal_integration_tests::private::HostStack;
use postal_integration_tests::{create_db, unique};

use crate::wal_lease::{await_progress, finish, wal_relay_proc, write_until, LEASE_SECS};
use crate::wal_relay::Slot;

/// Guarantee: when the host of the WAL relay holding the slot is cut off (silence, no reset)
/// while events flow, the standby on another host takes the slot over once the lease expired
/// (ending the cut-off relay's walsender) and publishing resumes within the lease plus 5 s;
/// the cut-off relay counts its lease lost by its own clock, and once the link is back it does
/// not take the slot back; every event is published, per key in commit order by first copy.
/// Before the lease, the cut-off relay's walsender kept the slot until `wal_sender_timeout`
/// and the backends' TCP timeouts, and no standby took over.
#[test]
fn a_cut_off_wal_relay_loses_its_slot_to_the_standby() {
    if let Err(why) = TestHosts::available() {
        eprintln!("wal_netsplit NOT RUN: {why}");
        return;
    }
    let hosts = TestHosts::create(&["srv", "wal1", "wal2"]);
    let stack = HostStack::start(hosts.netns("srv"), hosts.addr("srv"));
    std::thread::scope(|s| {
        s.spawn(|| {
            hosts.enter("srv");
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(run(&hosts, &stack));
        });
    });
}

async fn run(hosts: &TestHosts, stack: &HostStack) {
    let db = create_db(&stack.database_url()).await;
    postal_shared::migrate(&db.pool).await.expect("migrate");
    let bootstrap = stack.bootstrap();
    let slot = Slot::create(&db).await;
    let topic = unique("wal-split");
    let mut a = wal_relay_proc(&db, &slot, &bootstrap, "wal-netsplit", "relay-a")
        .on_host(hosts.netns("wal1"));
    let mut b = wal_relay_proc(&db, &slot, &bootstrap, "wal-netsplit", "relay-b")
        .on_host(hosts.netns("wal2"));
    a.start();
    a.await_log("WAL relay: holding the", Duration::from_secs(60))
        .await;
    b.start();
    b.await_log("WAL relay: standing by", Duration::from_secs(60))
        .await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write_until(db.pool.clone(), topic.clone(), stop.clone()));
    await_progress(&db.pool, "the holder publishing").await;
    hosts.cut("wal1");
    let cut = Instant::now();
    await_progress(&db.pool, "the standby publishing").await;
    let took = cut.elapsed();
    assert!(b.logged("WAL relay: holding the"), "the standby took over");
    a.await_log("lost the slot", Duration::from_secs(30)).await;
    hosts.heal("wal1");
    await_progress(&db.pool, "publishing after the link came back").await;
    let token: i64 =
        sqlx::query_scalar("SELECT token FROM postal.wal_slot_leases WHERE slot_name = $1")
            .bind(&slot.source.slot)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(token, 2, "the cut-off relay did not take the slot back");
    let (written, duplicates) = finish(&db, &bootstrap, &topic, stop, writer).await;
    b.stop();
    drop(a);
    eprintln!("network cut: publishing again {took:?} after the cut; {written} events, {duplicates} duplicates");
    assert!(
        took < Duration::from_secs(LEASE_SECS + 5),
        "publishing resumed within the lease and a few seconds: {took:?}"
    );
}
