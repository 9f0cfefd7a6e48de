//! The advisory locks that make a consumer pause exact (`postal pause consumer`).
//!
//! Every processing transaction of a consumer group takes, in its `BEGIN` statement, a
//! transaction-scoped *shared* advisory lock on its group ([`consumer_lock`] with no topic) and
//! one on its (group, topic), and reads `postal.pauses` later, where it advances the stored
//! offset. A pause takes the *exclusive* lock of what it pauses in the transaction that writes
//! its row. So the pause commits only after every transaction that held the lock has ended,
//! and a transaction that asks for the lock meanwhile waits for the pause's commit and then
//! sees it: once `postal pause` returns, no transaction of the group applies anything it pauses.
//!
//! The keys are computed here (FNV-1a, 32 bits) rather than in SQL so that the consumer's
//! `BEGIN` statement — a simple query with no parameters — carries numbers, never quoted names.
//! Two names whose keys collide only wait for each other's pauses, briefly.

/// The two keys of the advisory lock of a consumer group's pause (`topic: None`: the whole
/// group), for `pg_advisory_xact_lock[_shared](int4, int4)`.
pub fn consumer_lock(group: &str, topic: Option<&str>) -> (i32, i32) {
    let class = fnv(&[b"postal.pause:", group.as_bytes()]);
    let key = match topic {
        None => 0,
        // Never 0, which stands for the whole group.
        Some(t) => match fnv(&[b"topic:", t.as_bytes()]) {
            0 => 1,
            k => k,
        },
    };
    (class, key)
}

/// The SQL a consumer transaction runs (appended to its `BEGIN`): the shared locks of its
/// group and of its (group, topic).
pub fn consumer_lock_sql(group: &str, topic: &str) -> String {
    let (class, whole) = consumer_lock(group, None);
    let (_, key) = consumer_lock(group, Some(topic));
    format!(
        "SELECT pg_advisory_xact_lock_shared({class}, {whole}), pg_advisory_xact_lock_shared({class}, {key})"
    )
}

fn fnv(parts: &[&[u8]]) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for part in parts {
        for b in *part {
            h ^= u32::from(*b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys are stable (a consumer and the `postal` binary of the same release must agree,
    /// and a pause taken by one release must hold against consumers of the next): pinned.
    #[test]
    fn the_lock_keys_are_stable_and_a_topic_never_takes_the_group_key() {
        assert_eq!(
            consumer_lock("billing", None),
            (consumer_lock("billing", None).0, 0)
        );
        assert_eq!(
            consumer_lock("billing", None).0,
            fnv(&[b"postal.pause:billing"])
        );
        assert_eq!(fnv(&[b"a"]), 0xe40c292c_u32 as i32);
        assert_ne!(consumer_lock("billing", Some("orders")).1, 0);
        assert_ne!(
            consumer_lock("billing", Some("orders")),
            consumer_lock("billing", Some("payments"))
        );
        assert_eq!(
            consumer_lock_sql("g", "t"),
            format!(
                "SELECT pg_advisory_xact_lock_shared({0}, 0), pg_advisory_xact_lock_shared({0}, {1})",
                consumer_lock("g", None).0,
                consumer_lock("g", Some("t")).1
            )
        );
    }
}
