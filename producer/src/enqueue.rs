//! Writing events into the outbox inside the caller's transaction.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::event::NewEvent;
use crate::Error;
use postal_shared::EventId;

/// Channel on which enqueue wakes the relay (at most one notification per transaction:
/// PostgreSQL folds identical notifications of one transaction into one).
pub const NOTIFY_CHANNEL: &str = "postal_outbox";

/// Class id of the transaction-scoped advisory locks that serialise writers of one key
/// (`'post'` as a 32-bit integer). The object id is `hashtext(key)`.
pub const KEY_LOCK_CLASS: i32 = 0x706F_7374;

/// Writes one event into the outbox on the caller's connection — normally an open transaction:
/// `enqueue(&mut *tx, event)`. The event commits or rolls back with the caller's business rows.
///
/// It takes `&mut PgConnection`, never a pool, so the outbox write goes where the caller's
/// own writes go: into their transaction when they pass one (`&mut *tx`), and never onto a
/// connection of its own. A bare connection (`&mut *pool.acquire().await?`) compiles too and
/// commits the event on its own, which is what you ask for then:
///
/// ```compile_fail
/// # async fn f(pool: sqlx::PgPool, e: postal_producer::NewEvent) {
/// postal_producer::enqueue(&pool, e).await; // a pool is not a connection: does not compile
/// # }
/// ```
///
/// Writers of the same key are serialised until commit (a transaction-scoped advisory lock on
/// the key), so per key the outbox sequence is also the commit order. Like row locks, these
/// can deadlock: two transactions that enqueue for keys `a` then `b` and `b` then `a` wait for
/// each other until PostgreSQL aborts one of them (SQLSTATE `40P01`, to be retried like any
/// deadlock). [`enqueue_batch`] takes its keys' locks in one fixed order, so one batch per
/// transaction never deadlocks with another. The relay is woken with a `NOTIFY` that
/// PostgreSQL delivers once per transaction, after commit.
pub async fn enqueue(conn: &mut PgConnection, event: NewEvent) -> Result<EventId, Error> {
    let id = event.id;
    enqueue_batch(conn, vec![event]).await?;
    Ok(id)
}

/// Writes many events in one statement, in the order given (which becomes their outbox
/// sequence order). Returns their ids in the same order.
pub async fn enqueue_batch(
    conn: &mut PgConnection,
    events: Vec<NewEvent>,
) -> Result<Vec<EventId>, Error> {
    write(conn, events, false).await
}

/// Writes `event` unless the outbox already holds the same event: one with its id and the
/// same topic, key, type, schema version, content type, headers (the trace context aside) and
/// payload, byte for byte — serialize derived events deterministically (then nothing is
/// written and the id is returned). For
/// events whose id is derived from what caused them ([`EventId::derived`]): a handler that
/// emits an event while applying its input may be applied again (a replay past the dedup
/// retention, a replayed dead letter) and then emits the same event, which must not fail —
/// nor become a second event. If the earlier copy was already published and removed from the
/// outbox, it is written and published again with the same id, which consumers deduplicate.
/// A different event under the same id is [`Error::DuplicateEventId`].
///
/// [`EventId::derived`]: postal_shared::EventId::derived
pub async fn enqueue_once(conn: &mut PgConnection, event: NewEvent) -> Result<EventId, Error> {
    let id = event.id;
    write(conn, vec![event], true).await?;
    Ok(id)
}

/// [`write_in`] on the caller's connection, in whatever transaction the caller has open. It
/// never begins or commits one of its own: a transaction the caller opened with plain SQL
/// (`BEGIN`, then `SAVEPOINT`s) is not known to sqlx, and a `begin`/`commit` here would commit
/// it (`claim_schedules::an_enqueue_in_a_released_savepoint_keeps_its_key_locked_until_commit`).
/// Through a transaction pooler, call it inside a transaction (docs/operations.md#poolers).
async fn write(
    conn: &mut PgConnection,
    events: Vec<NewEvent>,
    once: bool,
) -> Result<Vec<EventId>, Error> {
    write_in(conn, events, once).await
}

/// Writes `events` on `conn`, which is inside a transaction. Its statements are not prepared
/// by name ([`sqlx::query::Query::persistent`] `false`): a transaction pooler hands the next
/// transaction of this connection to another server session, where a named statement does
/// not exist (or another client's of the same name does).
async fn write_in(
    conn: &mut PgConnection,
    events: Vec<NewEvent>,
    once: bool,
) -> Result<Vec<EventId>, Error> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let trace = crate::trace::current_traceparent();
    let n = events.len();
    let mut ids = Vec::with_capacity(n);
    let mut uuids: Vec<Uuid> = Vec::with_capacity(n);
    let mut topics = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut versions = Vec::with_capacity(n);
    let mut occurred = Vec::with_capacity(n);
    let mut content_types = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    let mut deliver_at = Vec::with_capacity(n);
    for e in events {
        ids.push(e.id);
        uuids.push(e.id.as_uuid());
        topics.push(e.topic.into_string());
        keys.push(e.key.into_string());
        types.push(e.event_type.into_string());
        versions.push(e.schema_version.get());
        occurred.push(e.occurred_at);
        content_types.push(e.content_type.into_string());
        payloads.push(e.payload);
        let mut h = e.headers;
        if let Some((parent, state)) = &trace {
            h.entry(postal_shared::headers::TRACEPARENT.to_owned())
                .or_insert_with(|| parent.clone());
            if let Some(state) = state {
                h.entry(postal_shared::headers::TRACESTATE.to_owned())
                    .or_insert_with(|| state.clone());
            }
        }
        // The trace context is added here: the headers' total is checked again with it.
        if let Some(reason) =
            postal_shared::headers::size_problem(h.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        {
            return Err(Error::Invalid(postal_shared::Error::Invalid {
                what: "headers",
                reason,
            }));
        }
        headers.push(serde_json::to_value(h).map_err(Error::Serialize)?);
        deliver_at.push(e.deliver_at);
    }

    let sql = if once { INSERT_ONCE } else { INSERT };
    let inserted: i64 = sqlx::query_scalar(sql)
        .bind(&uuids)
        .bind(&topics)
        .bind(&keys)
        .bind(&types)
        .bind(&versions)
        .bind(&occurred)
        .bind(&content_types)
        .bind(&payloads)
        .bind(&headers)
        .bind(&deliver_at)
        .bind(NOTIFY_CHANNEL)
        .bind(KEY_LOCK_CLASS)
        .persistent(false)
        .fetch_one(&mut *conn)
        .await
        .map_err(Error::from_insert)?;
    if once && inserted == 0 {
        // Already there: the same event, or a different one under this id?
        // The trace context is the current span's, different on every application.
        let same: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM postal.outbox
                            WHERE event_id = $1 AND topic = $2 AND event_key = $3
                              AND event_type = $4 AND payload = $5 AND schema_version = $6
                              AND content_type = $7
                              AND headers - 'traceparent' - 'tracestate'
                                  = $8::jsonb - 'traceparent' - 'tracestate')",
        )
        .bind(uuids[0])
        .bind(&topics[0])
        .bind(&keys[0])
        .bind(&types[0])
        .bind(&payloads[0])
        .bind(versions[0])
        .bind(&content_types[0])
        .bind(&headers[0])
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        if !same {
            return Err(Error::DuplicateEventId);
        }
        return Ok(ids);
    }
    debug_assert_eq!(inserted as usize, n);
    Ok(ids)
}

/// The insert, after taking the keys' advisory locks in one fixed order (`$12` their class).
macro_rules! insert {
    ($on_conflict:literal) => {
        concat!(
            r#"
        WITH key_locks AS MATERIALIZED (
            SELECT count(pg_advisory_xact_lock($12, h)) AS n
            FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest($3::text[]) AS k ORDER BY 1) AS s
        ), ins AS (
            INSERT INTO postal.outbox (event_id, topic, event_key, event_type, schema_version,
                                       occurred_at, content_type, payload, headers,
                                       available_at, held)
            SELECT u.id, u.topic, u.k, u.typ, u.ver, u.occ, u.ct, u.payload, u.hdr,
                   coalesce(u.deliver_at, now()), coalesce(u.deliver_at > now(), false)
            FROM key_locks,
                 unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
                        $6::timestamptz[], $7::text[], $8::bytea[], $9::jsonb[],
                        $10::timestamptz[])
                   WITH ORDINALITY AS u(id, topic, k, typ, ver, occ, ct, payload, hdr, deliver_at, ord)
            ORDER BY u.ord
            "#,
            $on_conflict,
            r#"
            RETURNING 1
        )
        SELECT count(*) FROM ins, (SELECT pg_notify($11, '')) AS wake
        "#
        )
    };
}

const INSERT: &str = insert!("");
const INSERT_ONCE: &str = insert!(" ON CONFLICT ON CONSTRAINT outbox_event_id_unique DO NOTHING");
