//! A review's reproduction: which exchange a channel closed by a refusal is blamed on.

use std::time::{Duration, Instant};

use postal_integration_tests::rabbit::{self, PrivateRabbit};
use postal_integration_tests::{services, unique};
use postal_producer::{enqueue_batch, Backoff, NewEvent, RabbitConfig, RabbitTransport};

use crate::common::{fast_config, RunningRelay};

async fn good_events_delay(
    user_named_after_good_exchange: bool,
) -> (Duration, usize, Vec<(String, String, i32, Option<String>)>) {
    let db = services().await.fresh_db().await;
    let mq = PrivateRabbit::start().await;
    let good = unique("rmq-allowed");
    let bad = unique("rmq-refused");
    let user = if user_named_after_good_exchange {
        good.clone()
    } else {
        "relay".to_string()
    };
    mq.ctl(&["add_user", &user, "pw"]);
    let write = format!("^{good}$");
    mq.ctl(&["set_permissions", "-p", "/", &user, ".*", &write, ".*"]);
    let _gq = rabbit::bind_queue(&mq.url(), &good, "#").await;
    let _bq = rabbit::bind_queue(&mq.url(), &bad, "#").await;
    let url = mq.url().replace("guest:guest", &format!("{user}:pw"));
    let mut cfg = RabbitConfig::new(url);
    cfg.confirm_timeout = Duration::from_secs(1);
    // The refused event first, then 20 permitted ones, in one batch (one channel).
    let mut events = vec![NewEvent::json(bad.as_str(), "kb", "e", &0).unwrap()];
    for i in 0..20 {
        events.push(NewEvent::json(good.as_str(), format!("g{i}"), "e", &i).unwrap());
    }
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    let relay = RunningRelay::start(
        &db.pool,
        RabbitTransport::new(cfg).unwrap(),
        fast_config().backoff(Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(300),
        }),
    );
    let t0 = Instant::now();
    let mut left;
    loop {
        left = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE topic = $1")
            .bind(&good)
            .fetch_one(&db.pool)
            .await
            .unwrap() as usize;
        if left == 0 || t0.elapsed() > Duration::from_secs(15) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rows: Vec<(String, String, i32, Option<String>)> = sqlx::query_as(
        "SELECT event_key, status, attempts, last_error FROM postal.outbox ORDER BY seq LIMIT 4",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    relay.stop().await;
    (t0.elapsed(), left, rows)
}

/// Guarantee: a refusal is blamed on its own exchange only, whatever the user and vhost are
/// called. The relay's user is named like the exchange it may publish to, so the broker's
/// refusal text ("… exchange 'rmq-refused-…' in vhost '/' refused for user 'rmq-allowed-…'")
/// quotes both names; a batch of the refused event and 20 permitted ones on one channel: the
/// permitted ones are all published. (Before: they waited a minute, told to grant a
/// permission they had.)
#[tokio::test]
async fn a_refusal_naming_the_user_holds_up_no_other_exchange() {
    let (took, left, rows) = good_events_delay(true).await;
    eprintln!("user named after the exchange: took {took:?}, left {left}, rows {rows:?}");
    assert_eq!(
        left, 0,
        "permitted events still waiting after {took:?}: {rows:?}"
    );
}
