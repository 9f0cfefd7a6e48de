/// Errors of the shared vocabulary: invalid values and migration failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value did not satisfy the rules of its type (empty topic, oversized key, …).
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// Which kind of value was rejected.
        what: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// Applying Postal's migrations failed.
    #[error("postal migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A database call failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// An advisory lock stayed taken for longer than Postal waits for it.
    #[error("{what} is still held by {holder} after {}s; wait for it to finish, or end that session (pg_terminate_backend) if it is stuck", waited.as_secs())]
    LockBusy {
        /// Which lock.
        what: &'static str,
        /// How long Postal waited.
        waited: std::time::Duration,
        /// Who holds it (backend pid and application name), as far as `pg_locks` tells.
        holder: String,
    },
    /// A librdkafka property that would break durability or per-key order for a Postal
    /// producer ([`crate::kafka_producer`]).
    #[error("Kafka property {name}={value} is refused: {why}")]
    KafkaPropertyRefused {
        /// The property.
        name: String,
        /// Its value (the refused properties hold no secrets).
        value: String,
        /// Why it is refused.
        why: String,
    },
    /// The database has no Postal schema.
    #[error("Postal's schema is missing in database {database:?}: run `postal migrate` (or postal_shared::migrate) first")]
    SchemaMissing {
        /// The database's name.
        database: String,
    },
    /// The database's schema lacks migrations this binary needs.
    #[error("this database's Postal schema is at migration {applied}, and this binary needs migration {known}: run `postal migrate` with this version first")]
    SchemaBehind {
        /// The newest migration applied.
        applied: i64,
        /// The newest migration this binary knows.
        known: i64,
    },
    /// The database connection goes through a pooler in transaction (or statement) mode, and
    /// the part that connected needs a session of its own (docs/operations.md, "Poolers").
    #[error("the database connection goes through a transaction pooler (PgBouncer pool_mode = transaction): this part of Postal needs a session of its own; connect it directly to PostgreSQL or through a session-mode pool (only the application's enqueue works through transaction pooling, see docs/operations.md#poolers)")]
    TransactionPooling,
    /// A one-shot command that needs a session could not tell whether its connection keeps
    /// one: the pooler gave the probe no server connection in time.
    #[error("could not tell whether the database connection goes through a transaction pooler: no server connection answered the probe within {0:?}; this command needs a session of its own, so connect it directly to PostgreSQL or through a session-mode pool, or run it again when the pool is less busy (docs/operations.md#poolers)")]
    PoolingUnknown(std::time::Duration),
    /// The database's schema no longer admits binaries as old as this one.
    #[error("this database's Postal schema (migration {applied}) needs binaries that know migration {oldest} or later, and this one knows up to {known}: upgrade it")]
    SchemaTooNew {
        /// The newest migration applied.
        applied: i64,
        /// The oldest migration a binary must know (`postal.schema_contract`).
        oldest: i64,
        /// The newest migration this binary knows.
        known: i64,
    },
}

impl Error {
    /// Whether this failure means PostgreSQL is (for now) unreachable or refusing work — also
    /// when it happened inside a migration — rather than something retrying cannot fix (a
    /// modified migration, an invalid value). See [`crate::database_unavailable`].
    pub fn is_unavailable(&self) -> bool {
        self.database_error()
            .is_some_and(crate::database_unavailable)
    }

    /// The database error behind this failure, also when it happened inside a migration.
    pub fn database_error(&self) -> Option<&sqlx::Error> {
        use sqlx::migrate::MigrateError;
        match self {
            Error::Database(e)
            | Error::Migrate(MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)) => {
                Some(e)
            }
            _ => None,
        }
    }

    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::Invalid {
            what,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use sqlx::migrate::MigrateError;

    use super::*;

    fn lost() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ))
    }

    /// A connection lost in the middle of a migration is an outage (wait and retry), the same
    /// as one lost outside it; a migration that no longer matches what was applied is not.
    #[test]
    fn connection_lost_inside_a_migration_is_unavailable_a_mismatch_is_not() {
        assert!(Error::Database(lost()).is_unavailable());
        assert!(Error::Migrate(MigrateError::Execute(lost())).is_unavailable());
        assert!(Error::Migrate(MigrateError::ExecuteMigration(lost(), 3)).is_unavailable());
        assert!(!Error::Migrate(MigrateError::VersionMismatch(3)).is_unavailable());
        assert!(!Error::Migrate(MigrateError::Execute(sqlx::Error::RowNotFound)).is_unavailable());
        assert!(!Error::invalid("topic", "empty").is_unavailable());
    }
}
