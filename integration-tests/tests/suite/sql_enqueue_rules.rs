//! The SQL `postal.enqueue` refuses what the Rust `enqueue` refuses (headers, content types,
//! event types, payloads, schema versions, topics, keys), with the same one-line reason: each
//! case is given to both and the messages compared.

use std::collections::BTreeMap;

use postal_integration_tests::services;

/// What the Rust enqueue says about an event with `headers` and `content_type`: `None` when
/// it takes it, else its error as shown.
fn rust_verdict(headers: &BTreeMap<String, String>, content_type: &str) -> Option<String> {
    let ct = match postal_shared::ContentType::new(content_type) {
        Ok(ct) => ct,
        Err(e) => return Some(e.to_string()),
    };
    let mut e = postal_producer::NewEvent::bytes("t", "k", "e", ct, vec![0u8]).unwrap();
    for (n, v) in headers {
        e = match e.with_header(n.as_str(), v.as_str()) {
            Ok(e) => e,
            Err(err) => return Some(err.to_string()),
        };
    }
    None
}

/// What `postal.enqueue_bytes` says about the same event: `None` when it writes it, else the
/// database's message.
async fn sql_verdict(
    pool: &sqlx::PgPool,
    headers: &BTreeMap<String, String>,
    content_type: &str,
) -> Option<String> {
    let r =
        sqlx::query("SELECT postal.enqueue_bytes('t', 'k', 'e', $1, '\\x00'::bytea, $2::jsonb)")
            .bind(content_type)
            .bind(serde_json::to_value(headers).unwrap())
            .execute(pool)
            .await;
    match r {
        Ok(_) => None,
        Err(e) => Some(
            e.as_database_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string()),
        ),
    }
}

fn headers(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect()
}

/// Guarantee: `postal.enqueue_bytes` (and `postal.enqueue`, which calls it) refuses exactly
/// what the Rust `enqueue` refuses among header counts, header names and content types, with
/// the same one-line reason after `postal.enqueue: `; what Rust takes at the limits (128
/// headers, a 255-byte name, `ce_<letters and digits>`) SQL takes too.
///
/// Broken before migration 31: SQL wrote 129 headers, `ce_traceparent`, `CE_TraceState`,
/// an empty name, `ce_dataschema`, `ce_DataContentType`, `ce_tenant-id`, `ce_`, `ce_é` and
/// a 256-byte name (each then parked by the relay, or refused by consumers), and every reason
/// it gave for a reserved name, a header size or a content type differed from Rust's (checked
/// by re-creating migration 23's function in the test database).
#[tokio::test]
async fn sql_enqueue_refuses_what_rust_refuses_with_the_same_reason() {
    let db = services().await.fresh_db().await;
    let json = "application/json";
    let many = |n: usize| -> BTreeMap<String, String> {
        (0..n)
            .map(|i| (format!("h{i:03}"), "v".to_owned()))
            .collect()
    };
    let long_name = "x".repeat(256);
    let at_limit_name = "x".repeat(255);
    let odd_long_name = format!("é\"'\\\u{7}{}", "y".repeat(300));
    let big_value = "v".repeat(8193);
    let wide: BTreeMap<String, String> = (0..9)
        .map(|i| (format!("w{i}"), "v".repeat(8000)))
        .collect();
    let cases: Vec<(&str, BTreeMap<String, String>, &str)> = vec![
        ("128 headers", many(128), json),
        ("129 headers", many(129), json),
        (
            "ce_traceparent",
            headers(&[("ce_traceparent", "00-x")]),
            json,
        ),
        ("CE_TraceState", headers(&[("CE_TraceState", "x")]), json),
        ("empty name", headers(&[("", "x")]), json),
        ("Content-Type", headers(&[("Content-Type", "x")]), json),
        ("ce_dataschema", headers(&[("ce_dataschema", "x")]), json),
        (
            "ce_DataContentType",
            headers(&[("ce_DataContentType", "x")]),
            json,
        ),
        ("ce_tenant-id", headers(&[("ce_tenant-id", "x")]), json),
        ("ce_", headers(&[("ce_", "x")]), json),
        ("ce_é", headers(&[("ce_é", "x")]), json),
        ("ce_tenant1", headers(&[("ce_tenant1", "x")]), json),
        ("255-byte name", headers(&[(&at_limit_name, "x")]), json),
        ("256-byte name", headers(&[(&long_name, "x")]), json),
        ("odd long name", headers(&[(&odd_long_name, "x")]), json),
        ("8193-byte value", headers(&[("a\"b", &big_value)]), json),
        ("72,000 bytes of headers", wide, json),
        ("C1 in content type", BTreeMap::new(), "text/plain\u{85}"),
        (
            "DEL in content type",
            BTreeMap::new(),
            "application/x\u{7f}",
        ),
        (
            "ESC in content type",
            BTreeMap::new(),
            "text/plain\u{1b}[2J",
        ),
        ("empty content type", BTreeMap::new(), ""),
        ("no slash", BTreeMap::new(), "json"),
        ("non-ASCII content type", BTreeMap::new(), "text/é"),
    ];
    let long_ct = format!("application/{}", "x".repeat(243));
    let over_ct = format!("application/{}", "x".repeat(244));
    let mut all = cases;
    all.push(("255-byte content type", BTreeMap::new(), &long_ct));
    all.push(("256-byte content type", BTreeMap::new(), &over_ct));
    let mut wrong = Vec::new();
    let mut refused = 0;
    for (what, h, ct) in &all {
        let rust = rust_verdict(h, ct);
        let sql = sql_verdict(&db.pool, h, ct).await;
        let expected = rust.as_ref().map(|r| format!("postal.enqueue: {r}"));
        if sql != expected {
            wrong.push(format!("{what}: Rust {expected:?}, SQL {sql:?}"));
        }
        refused += usize::from(rust.is_some());
    }
    // Not vacuous: most cases are refused, some taken.
    assert!(refused >= 18 && refused < all.len(), "refused {refused}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Guarantee: `postal.enqueue_bytes` refuses exactly the event types the Rust `EventType`
/// refuses (empty, over 255 bytes, whitespace or control characters as Rust's
/// `char::is_whitespace`/`is_control` say), with the same reason after `postal.enqueue: `;
/// 255 bytes of `é` are taken by both.
///
/// Broken before: SQL counted 255 characters, not bytes (it wrote a 256-byte type of 128
/// `é`, which an AMQP `type` property, a short string, cannot carry), and named the type
/// with its own reason.
#[tokio::test]
async fn sql_enqueue_refuses_the_event_types_rust_refuses_with_the_same_reason() {
    let db = services().await.fresh_db().await;
    let at_limit = format!("{}x", "é".repeat(127));
    let types = [
        ("128 é (256 bytes)", "é".repeat(128)),
        ("127 é and x (255 bytes)", at_limit),
        ("256 x", "x".repeat(256)),
        ("empty", String::new()),
        ("space", "order created".into()),
        ("tab", "order\tcreated".into()),
        ("NBSP", "order\u{a0}created".into()),
        ("U+2028", "order\u{2028}created".into()),
        ("U+3000", "order\u{3000}created".into()),
        ("NEL", "order\u{85}created".into()),
        ("DEL", "order\u{7f}".into()),
        ("quote", "order\"created".into()),
        ("plain", "order.created".into()),
    ];
    let mut wrong = Vec::new();
    let mut refused = 0;
    for (what, t) in &types {
        let rust = postal_shared::EventType::new(t.as_str())
            .err()
            .map(|e| format!("postal.enqueue: {e}"));
        let sql = sqlx::query(
            "SELECT postal.enqueue_bytes('t', 'k', $1, 'application/json', '\\x00'::bytea)",
        )
        .bind(t)
        .execute(&db.pool)
        .await
        .err()
        .map(|e| {
            e.as_database_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string())
        });
        if sql != rust {
            wrong.push(format!("{what}: Rust {rust:?}, SQL {sql:?}"));
        }
        refused += usize::from(rust.is_some());
    }
    assert_eq!(refused, types.len() - 3, "the cases Rust refuses");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Guarantee: `postal.enqueue_bytes` refuses a payload over `MAX_PAYLOAD_BYTES` (16 MiB) and a
/// schema version below 1 as the Rust enqueue does, with the same reason after
/// `postal.enqueue: `; a payload of exactly 16 MiB and version 1 are taken by both.
///
/// Broken before: SQL wrote a 16 MiB + 1 payload (for the relay to park, or a broker to
/// refuse), and refused versions 0 and -1 only by the outbox's check constraint (`new row for
/// relation "outbox" violates check constraint …`), not with the reason.
#[tokio::test]
async fn sql_enqueue_refuses_the_payloads_and_schema_versions_rust_refuses() {
    let db = services().await.fresh_db().await;
    let max = postal_producer::MAX_PAYLOAD_BYTES;
    let cases: [(&str, usize, i32); 5] = [
        ("16 MiB + 1", max + 1, 1),
        ("16 MiB", max, 1),
        ("version 0", 1, 0),
        ("version -1", 1, -1),
        ("version 2", 1, 2),
    ];
    let mut wrong = Vec::new();
    for (what, size, version) in cases {
        let rust = postal_shared::SchemaVersion::new(version)
            .map_err(postal_producer::Error::from)
            .and_then(|v| {
                postal_producer::NewEvent::bytes(
                    "t",
                    "k",
                    "e",
                    postal_shared::ContentType::json(),
                    vec![b'x'; size],
                )
                .map(|e| e.with_schema_version(v))
            })
            .err()
            .map(|e| format!("postal.enqueue: {e}"));
        let sql = sqlx::query(
            "SELECT postal.enqueue_bytes('t', 'k', 'e', 'application/json',
                                         $1, p_schema_version => $2)",
        )
        .bind(vec![b'x'; size])
        .bind(version)
        .execute(&db.pool)
        .await
        .err()
        .map(|e| {
            e.as_database_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string())
        });
        if sql != rust {
            wrong.push(format!("{what}: Rust {rust:?}, SQL {sql:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(written, 2, "the two events both take are written");
}

/// Guarantee: `postal.enqueue_bytes` refuses the topics and keys the Rust `Topic` and
/// `EventKey` refuse with their reasons after `postal.enqueue: ` (it refused the same ones
/// before, each with a reason of its own).
#[tokio::test]
async fn sql_enqueue_gives_the_rust_reasons_for_topics_and_keys() {
    let db = services().await.fresh_db().await;
    let cases: Vec<(&str, String, String)> = vec![
        ("empty topic", String::new(), "k".into()),
        ("250-byte topic", "t".repeat(250), "k".into()),
        ("dot", ".".into(), "k".into()),
        ("dot dot", "..".into(), "k".into()),
        ("space", "a b".into(), "k".into()),
        ("quote", "a'b".into(), "k".into()),
        ("double quote", "a\"b".into(), "k".into()),
        ("é", "caf\u{e9}".into(), "k".into()),
        ("tab", "a\tb".into(), "k".into()),
        ("empty key", "t".into(), String::new()),
        ("4097-byte key", "t".into(), "k".repeat(4097)),
        ("fine", "t.a_b-c".into(), "k".repeat(4096)),
    ];
    let mut wrong = Vec::new();
    for (what, topic, key) in &cases {
        let rust = postal_shared::Topic::new(topic.as_str())
            .err()
            .or_else(|| postal_shared::EventKey::new(key.as_str()).err())
            .map(|e| format!("postal.enqueue: {e}"));
        let sql = sqlx::query(
            "SELECT postal.enqueue_bytes($1, $2, 'e', 'application/json', '\\x00'::bytea)",
        )
        .bind(topic)
        .bind(key)
        .execute(&db.pool)
        .await
        .err()
        .map(|e| {
            e.as_database_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string())
        });
        if sql != rust {
            wrong.push(format!("{what}: Rust {rust:?}, SQL {sql:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
