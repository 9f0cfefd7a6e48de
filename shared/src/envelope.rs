//! Validated newtypes for the parts of an event envelope. Each constructor checks its rules once,
//! so a value of these types is always acceptable to PostgreSQL and to Kafka.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::Error;

macro_rules! string_newtype {
    ($(#[$doc:meta])* $name:ident, $what:literal, $check:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps the value.
            pub fn new(value: impl Into<String>) -> Result<Self, Error> {
                let value = value.into();
                let check: fn(&str) -> Result<(), String> = $check;
                check(&value).map_err(|reason| Error::invalid($what, reason))?;
                Ok($name(value))
            }

            /// The value as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The owned string.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<&str> for $name {
            type Error = Error;
            fn try_from(value: &str) -> Result<Self, Error> {
                Self::new(value)
            }
        }

        impl TryFrom<String> for $name {
            type Error = Error;
            fn try_from(value: String) -> Result<Self, Error> {
                Self::new(value)
            }
        }

        /// So that a `&String` is taken where a `&str` is (`NewEvent::json(&topic, &key, …)`).
        impl TryFrom<&String> for $name {
            type Error = Error;
            fn try_from(value: &String) -> Result<Self, Error> {
                Self::new(value.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = Error;
            fn from_str(value: &str) -> Result<Self, Error> {
                Self::new(value)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::new(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

/// Longest Kafka topic name the broker accepts.
pub const MAX_TOPIC_LEN: usize = 249;
/// Longest event key Postal accepts (bytes).
pub const MAX_KEY_LEN: usize = 4096;
/// Longest event type / content type Postal accepts (bytes).
pub const MAX_NAME_LEN: usize = 255;

string_newtype!(
    /// A Kafka topic name: 1–249 characters of `[a-zA-Z0-9._-]`, not `.` or `..`.
    Topic,
    "topic",
    |s| {
        if s.is_empty() {
            return Err("must not be empty".into());
        }
        if s.len() > MAX_TOPIC_LEN {
            return Err(format!("{} characters, at most {MAX_TOPIC_LEN} allowed", s.len()));
        }
        if s == "." || s == ".." {
            return Err(format!("{s:?} is reserved"));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(format!("{s:?} contains {c:?}; only [a-zA-Z0-9._-] are allowed"));
        }
        Ok(())
    }
);

string_newtype!(
    /// The event key — usually the aggregate id. It becomes the Kafka record key, so all events
    /// of one key land in one Kafka partition, and Postal keeps them in order. Non-empty, at
    /// most 4096 bytes, no NUL characters.
    EventKey,
    "event key",
    |s| {
        if s.is_empty() {
            return Err("must not be empty".into());
        }
        if s.len() > MAX_KEY_LEN {
            return Err(format!("{} bytes, at most {MAX_KEY_LEN} allowed", s.len()));
        }
        if s.contains('\0') {
            return Err("must not contain NUL".into());
        }
        Ok(())
    }
);

string_newtype!(
    /// The event type, e.g. `order.created` (CloudEvents `type`). Non-empty, at most 255 bytes,
    /// no whitespace or control characters.
    EventType,
    "event type",
    |s| name_rules(s)
);

string_newtype!(
    /// A MIME content type such as `application/json` or `application/avro`.
    ContentType,
    "content type",
    |s| {
        if s.len() > MAX_NAME_LEN || s.is_empty() {
            return Err(format!("must be 1–{MAX_NAME_LEN} bytes"));
        }
        if s.chars().any(|c| c.is_control()) || !s.contains('/') {
            return Err(format!("{s:?} is not a MIME type of the form type/subtype"));
        }
        Ok(())
    }
);

fn name_rules(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > MAX_NAME_LEN {
        return Err(format!("{} bytes, at most {MAX_NAME_LEN} allowed", s.len()));
    }
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{s:?} contains whitespace or control characters"));
    }
    Ok(())
}

impl ContentType {
    /// `application/json`, the content type of JSON payloads.
    pub fn json() -> Self {
        ContentType("application/json".to_owned())
    }
}

/// The schema version of an event's payload: 1 or more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "i32", into = "i32")]
pub struct SchemaVersion(i32);

impl SchemaVersion {
    /// Version 1.
    pub const ONE: SchemaVersion = SchemaVersion(1);

    /// Validates a version number (must be ≥ 1).
    pub fn new(v: i32) -> Result<Self, Error> {
        if v < 1 {
            return Err(Error::invalid("schema version", format!("{v} is below 1")));
        }
        Ok(SchemaVersion(v))
    }

    /// The number.
    pub fn get(self) -> i32 {
        self.0
    }
}

impl Default for SchemaVersion {
    fn default() -> Self {
        Self::ONE
    }
}

impl TryFrom<i32> for SchemaVersion {
    type Error = Error;
    fn try_from(v: i32) -> Result<Self, Error> {
        Self::new(v)
    }
}

impl From<SchemaVersion> for i32 {
    fn from(v: SchemaVersion) -> i32 {
        v.0
    }
}

impl fmt::Display for SchemaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_rules() {
        assert!(Topic::new("orders.v1_x-y").is_ok());
        assert!(Topic::new("").is_err());
        assert!(Topic::new("..").is_err());
        assert!(Topic::new("has space").is_err());
        assert!(Topic::new("a".repeat(250)).is_err());
        let err = Topic::new("bad/topic").unwrap_err().to_string();
        assert!(err.contains("invalid topic"), "{err}");
    }

    #[test]
    fn key_type_version_rules() {
        assert!(EventKey::new("customer-42").is_ok());
        assert!(EventKey::new("").is_err());
        assert!(EventKey::new("k".repeat(MAX_KEY_LEN + 1)).is_err());
        assert!(EventType::new("order.created").is_ok());
        assert!(EventType::new("order created").is_err());
        assert!(SchemaVersion::new(0).is_err());
        assert_eq!(SchemaVersion::new(3).unwrap().get(), 3);
        assert!(ContentType::new("application/avro").is_ok());
        assert!(ContentType::new("avro").is_err());
    }

    #[test]
    fn deserialising_validates() {
        assert!(serde_json::from_str::<Topic>("\"ok\"").is_ok());
        assert!(serde_json::from_str::<Topic>("\"not ok\"").is_err());
        assert!(serde_json::from_str::<SchemaVersion>("0").is_err());
    }
}
