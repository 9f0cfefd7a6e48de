//! Secrets kept out of logs, errors and `Debug` output: passwords in connection URLs (in the
//! user part or as a query parameter such as `?password=` or `sslpassword=`), and client
//! properties that hold credentials (`sasl.password`, `ssl.key.password`,
//! `sasl.oauthbearer.config`, anything named password, secret, token, key, credential or jaas).
//! Also the `key=value,key=value` property lists given on command lines and in the
//! environment, split so that a comma inside a value stays in the value, and property files
//! (`--kafka-file`), so that a secret need not appear in a process listing at all.

use std::collections::BTreeMap;

/// What a redacted secret is shown as.
pub const REDACTED: &str = "<redacted>";

/// Whether a property or URL parameter of this name holds a secret (compared without case).
pub fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "passwd",
        "secret",
        "token",
        "key",
        "credential",
        "jaas",
        "oauthbearer.config",
    ]
    .iter()
    .any(|s| n.contains(s))
}

/// `url` with the password of its user part and the value of every secret query parameter
/// replaced by [`REDACTED`]. Works on malformed URLs too (a password with an unescaped `@`,
/// `/` or `?` included): everything between the user name and the last `@` is the password.
pub fn redact_url(url: &str) -> String {
    if ambiguous_at(url) {
        return "<URL not shown: an `@` after its `?` leaves unclear where a password ends>"
            .to_owned();
    }
    // A URL only when what comes before its first `://` is a scheme (RFC 3986: a letter, then
    // letters, digits, `+`, `-`, `.`): a `://` inside a password or a `key=value` string's value
    // does not make the text before it a scheme to show.
    let scheme_end = url
        .find("://")
        .filter(|&i| is_scheme(&url[..i]))
        .map(|i| i + 3);
    let Some(scheme_end) = scheme_end else {
        // Not a URL: a `key=value` connection string's quoting and spacing (`password = 'a
        // b'`) is not worth parsing here; one that names a secret is not shown at all. A
        // mistyped URL (`postgres//app:pw@db/shop`, `postgres:/app:pw@db`) may still carry
        // a user part: everything before its `@` is hidden, the host and the rest shown.
        return if is_secret_name(url) || key_value_form(url) {
            "<not a URL; not shown, it may hold a password>".to_owned()
        } else if let Some(at) = user_part_end(url) {
            let rest = &url[at..];
            match rest.find('?') {
                Some(q) => format!(
                    "{REDACTED}{}{}",
                    &rest[..=q],
                    redact_pairs(&rest[q + 1..], &['&'])
                ),
                None => format!("{REDACTED}{rest}"),
            }
        } else {
            url.to_owned()
        };
    };
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..scheme_end]);
    let rest = &url[scheme_end..];
    let rest = match user_part_end(rest) {
        Some(at) => {
            let user = &rest[..at];
            match user.find(':') {
                Some(colon) => {
                    out.push_str(&user[..colon + 1]);
                    out.push_str(REDACTED);
                }
                None => out.push_str(user),
            }
            &rest[at..]
        }
        None => rest,
    };
    match rest.find('?') {
        Some(q) => {
            out.push_str(&rest[..=q]);
            out.push_str(&redact_pairs(&rest[q + 1..], &['&']));
        }
        None => out.push_str(rest),
    }
    out
}

/// Whether `s` is a URL scheme (RFC 3986): a letter, then letters, digits, `+`, `-` or `.`.
fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// Where the user part of a URL (after `scheme://`) ends: its last `@`, unless a query
/// parameter comes before that `@` (`db/app?password=p@ss`: then the last `@` before the query
/// is, if any). So a password with an unescaped `@`, `/` or `?` in the user part is all
/// treated as the password, and an `@` inside a query value never is.
fn user_part_end(rest: &str) -> Option<usize> {
    let last = rest.rfind('@')?;
    if !rest[..last].contains('=') {
        return Some(last);
    }
    let query = rest.find('?').unwrap_or(rest.len());
    rest[..query].rfind('@')
}

/// Whether `url` has an `@` after a `?`: in a password (`app:p?ss@db`) or in a query value
/// (`db/app?password=p@ss`), which cannot be told apart for sure, so that the URL is not shown.
fn ambiguous_at(url: &str) -> bool {
    matches!((url.find('?'), url.rfind('@')), (Some(q), Some(at)) if at > q)
}

/// Whether a string that is not a URL reads as a libpq `key=value` connection string: an `=`
/// before any `@` (a mistyped URL's user part, `postgres//app:pw@db`, has none). Its keys may
/// be misspelt (`pass=…`), so none of it is shown.
fn key_value_form(s: &str) -> bool {
    let before_at = s.find('@').map_or(s, |at| &s[..at]);
    before_at.contains('=') || (s.contains('=') && !s.contains('@'))
}

/// Query parameters whose values are shown: those of PostgreSQL (as sqlx reads them) and
/// AMQP URLs that hold no secret. Any other parameter's value is redacted, whatever its name:
/// a misspelt `pasword=` is a password all the same.
const SHOWN_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "application_name",
    "options",
    "heartbeat",
    "frame_max",
    "channel_max",
    "connection_timeout",
    "auth_mechanism",
    "locale",
];

/// `s` split at `seps` into `name=value` pairs, with every value redacted but those of the
/// parameters known to hold none ([`SHOWN_PARAMETERS`]).
fn redact_pairs(s: &str, seps: &[char]) -> String {
    let mut out = String::with_capacity(s.len());
    let mut start = 0;
    for (i, c) in s.char_indices().chain(std::iter::once((s.len(), '\0'))) {
        if i == s.len() || seps.contains(&c) {
            let part = &s[start..i];
            match part.split_once('=') {
                // A value holding `=`, `;`, `#`, `%` or a space may have another parameter run
                // into it (`sslmode=require;password=…`, JDBC's separator, or percent-encoded:
                // `require%26password%3D…`): not shown either.
                Some((name, value))
                    if is_secret_name(name)
                        || !SHOWN_PARAMETERS.contains(&name.to_ascii_lowercase().as_str())
                        || value.contains(['=', ';', '#', '%'])
                        || value.contains(char::is_whitespace) =>
                {
                    out.push_str(name);
                    out.push('=');
                    out.push_str(REDACTED);
                }
                _ => out.push_str(part),
            }
            if i < s.len() {
                out.push(c);
            }
            start = i + c.len_utf8();
        }
    }
    out
}

/// The connection parameters sqlx reads from a PostgreSQL URL's query.
const PG_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// Parses a PostgreSQL URL (`DATABASE_URL`) into connect options. sqlx logs every query
/// parameter it does not know *with its value*: an unknown one that names a secret (e.g.
/// `sslpassword`, which sqlx cannot use) is refused here instead, naming the parameter only.
/// Errors never quote the URL.
pub fn database_url_options(url: &str) -> Result<sqlx::postgres::PgConnectOptions, crate::Error> {
    let invalid = |reason: String| crate::Error::Invalid {
        what: "DATABASE_URL",
        reason,
    };
    let after_scheme = url.find("://").map_or(url, |i| &url[i + 3..]);
    let after_user = user_part_end(after_scheme).map_or(after_scheme, |at| &after_scheme[at..]);
    if let Some((_, query)) = after_user.split_once('?') {
        for pair in query.split('&') {
            let name = pair.split_once('=').map_or(pair, |(n, _)| n);
            let known = PG_PARAMETERS.contains(&name) || name.starts_with("options[");
            if !known && is_secret_name(name) {
                return Err(invalid(format!(
                    "parameter {} is not supported (an encrypted client key cannot be used: \
                     give an unencrypted `sslkey` file readable only by this service)",
                    crate::text::quoted(name)
                )));
            }
            // sqlx would log it with its value, which may be a misspelt password.
            if !known {
                return Err(invalid(format!(
                    "parameter {} is not one PostgreSQL connections take here (supported: {})",
                    crate::text::quoted(name),
                    PG_PARAMETERS.join(", ")
                )));
            }
        }
    }
    url.parse().map_err(|e: sqlx::Error| {
        invalid(format!(
            "{} ({})",
            without_quoted(&e.to_string()),
            redact_url(url)
        ))
    })
}

/// `s` with every double-quoted part replaced by `"<value not shown>"`: sqlx's URL errors
/// quote the value they refuse (`unknown value "require;password=…" for ssl_mode`), which may
/// hold a password run into it.
fn without_quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut parts = s.split('"');
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    let rest: Vec<&str> = parts.collect();
    // Pairs of quotes enclose values; an unpaired last quote hides the rest too.
    for (i, part) in rest.iter().enumerate() {
        if i % 2 == 0 {
            out.push_str("\"<value not shown>\"");
        } else {
            out.push_str(part);
        }
    }
    out
}

/// A Kafka client error without the value of the property it is about: librdkafka's
/// configuration errors quote the value (`Invalid value "…" for configuration property
/// "sasl.jaas.config"`, and rdkafka appends it again), which may be a password — under a
/// misspelt name too, so every value is left out, and the property named.
pub fn kafka_error_without_value(e: rdkafka::error::KafkaError) -> rdkafka::error::KafkaError {
    use rdkafka::error::KafkaError;
    match e {
        KafkaError::ClientConfig(code, desc, key, value) => {
            let desc = if value.is_empty() {
                desc
            } else {
                desc.replace(&value, "<value not shown>")
            };
            KafkaError::ClientConfig(code, desc, key, "(value not shown)".to_owned())
        }
        other => other,
    }
}

/// Properties for `Debug` output and logs: secret values replaced by [`REDACTED`].
pub fn redacted_properties<'a, I>(props: I) -> BTreeMap<&'a str, &'a str>
where
    I: IntoIterator<Item = (&'a String, &'a String)>,
{
    props
        .into_iter()
        .map(|(k, v)| {
            let shown = if is_secret_name(k) {
                REDACTED
            } else {
                v.as_str()
            };
            (k.as_str(), shown)
        })
        .collect()
}

/// Parses one `key=value` property. The error never quotes the value (it may be a secret).
pub fn parse_property(s: &str) -> Result<(String, String), String> {
    let Some((k, v)) = s.split_once('=') else {
        return Err(format!(
            "a property of {} characters has no '=' (expected key=value)",
            s.chars().count()
        ));
    };
    let k = k.trim();
    if k.is_empty() {
        return Err("a property has an empty key (expected key=value)".to_owned());
    }
    Ok((k.to_owned(), v.to_owned()))
}

fn property_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// Parses a `key=value,key=value` list. A comma splits only where the text after it starts a
/// new `name=` (a name of letters, digits, `.`, `_` and `-`) or ends the text, so `sasl.password=a,b` keeps
/// `a,b` whole; a value that itself contains `,name=` belongs in a property file. Empty entries
/// are skipped. Errors never quote a value.
pub fn parse_properties(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut cuts = vec![0];
    for (i, c) in s.char_indices() {
        if c == ',' && starts_property(&s[i + 1..]) {
            cuts.push(i + 1);
        }
    }
    cuts.push(s.len() + 1);
    let mut out = Vec::new();
    for w in cuts.windows(2) {
        let part = &s[w[0]..w[1] - 1];
        if part.trim().is_empty() {
            continue;
        }
        out.push(parse_property(part.trim_start())?);
    }
    Ok(out)
}

/// Whether `s` starts with `name=` (after blanks), or is blank (a trailing comma).
fn starts_property(s: &str) -> bool {
    let s = s.trim_start();
    if s.is_empty() {
        return true;
    }
    let name_len = s.chars().take_while(|&c| property_name_char(c)).count();
    name_len > 0 && s[name_len..].starts_with('=')
}

/// Reads a property file: one `key=value` per line, blank lines and lines starting with `#` or
/// `!` skipped (the Java `.properties` basics, as Kafka's `client.properties`). Values are
/// taken after the first `=`, without blanks around them. Errors name the
/// file and line, never a value.
pub fn read_properties_file(path: &std::path::Path) -> Result<Vec<(String, String)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read property file {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
            continue;
        }
        let (k, v) =
            parse_property(line).map_err(|e| format!("{} line {}: {e}", path.display(), n + 1))?;
        out.push((k, v.trim().to_owned()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: a password never survives redaction, wherever the URL carries it.
    #[test]
    fn passwords_are_redacted_in_every_form_of_url() {
        let cases = [
            (
                "postgres://app:PLANTED@db:5432/app",
                "postgres://app:<redacted>@db:5432/app",
            ),
            (
                "postgres://app@db/app?sslmode=require&password=PLANTED",
                "postgres://app@db/app?sslmode=require&password=<redacted>",
            ),
            (
                "postgres://db/app?sslpassword=PLANTED&application_name=x",
                "postgres://db/app?sslpassword=<redacted>&application_name=x",
            ),
            (
                "postgres://app:PL@N/TED?x@db/app",
                "<URL not shown: an `@` after its `?` leaves unclear where a password ends>",
            ),
            (
                "postgres://app:PL@N/TED@db/app",
                "postgres://app:<redacted>@db/app",
            ),
            (
                "postgres://relay@db/app?password=PLA@NTED&sslmode=require",
                "<URL not shown: an `@` after its `?` leaves unclear where a password ends>",
            ),
            (
                "postgres://relay:PLA@NTED@db:5432/app?password=PLA@NTED",
                "<URL not shown: an `@` after its `?` leaves unclear where a password ends>",
            ),
            (
                "postgres://relay:PLA@NTED@db:5432/app?password=PLANTED",
                "postgres://relay:<redacted>@db:5432/app?password=<redacted>",
            ),
            (
                "postgres://u:PLA=NTED@db/app",
                "postgres://u:<redacted>@db/app",
            ),
            (
                "amqp://relay:PLANTED@mq:5672/%2f",
                "amqp://relay:<redacted>@mq:5672/%2f",
            ),
            (
                "host=db user=app password = 'PLAN TED'",
                "<not a URL; not shown, it may hold a password>",
            ),
            ("postgres://db:5432/app", "postgres://db:5432/app"),
            // Mistyped schemes: the user part is still hidden.
            (
                "postgres//app:PLANTED@db.internal:5432/shop",
                "<redacted>@db.internal:5432/shop",
            ),
            (
                "postgres:/app:PLANTED@db/shop?sslmode=require",
                "<redacted>@db/shop?sslmode=require",
            ),
            ("postgresql:db/shop", "postgresql:db/shop"),
            // Any query parameter not known to hold no secret is redacted, misspelt or not.
            (
                "postgres://app@db/app?pasword=PLANTED&sslmode=require",
                "postgres://app@db/app?pasword=<redacted>&sslmode=require",
            ),
            (
                "host=db user=app pass=PLANTED",
                "<not a URL; not shown, it may hold a password>",
            ),
        ];
        for (url, want) in cases {
            let got = redact_url(url);
            assert_eq!(got, want);
            assert!(!got.contains("PLANTED") && !got.contains("NTED"), "{got}");
        }
    }

    /// Guarantee: a planted password survives redaction in no shape of connection string —
    /// URLs with or without `//`, a mistyped scheme, passwords holding `@ / ? : = & %`,
    /// percent-encoded, in the user part or under any query parameter name (misspelt ones
    /// included), and libpq `key=value` strings with known or unknown keys, quoted or not.
    /// Every combination of those parts (an enumerated property test: 2,880 strings).
    #[test]
    fn a_planted_password_survives_no_shape_of_connection_string() {
        let passwords = [
            "Pw7secret",
            "Pw7s@cr/t",
            "Pw7s?c:r=t",
            "Pw7s%40cr&t",
            "Pw7 s'c",
        ];
        let schemes = [
            "postgres://",
            "postgresql://",
            "postgres//",
            "postgres:/",
            "postgres:",
            "",
            "amqp://",
        ];
        let hosts = ["db.internal:5432/shop", "db/shop", "[::1]:5432/shop"];
        let mut checked = 0;
        for pw in passwords {
            let needle = &pw[..7]; // "Pw7s…": any 7 characters of it shown is a leak
            let mut shapes: Vec<String> = Vec::new();
            for scheme in schemes {
                for host in hosts {
                    shapes.push(format!("{scheme}app:{pw}@{host}"));
                    shapes.push(format!("{scheme}:{pw}@{host}"));
                    for name in ["password", "pass", "pwd", "sslpassword", "PASSWORD", "x"] {
                        shapes.push(format!("{scheme}app@{host}?{name}={pw}"));
                        shapes.push(format!("{scheme}app@{host}?sslmode=require&{name}={pw}"));
                        shapes.push(format!("{scheme}app:{pw}@{host}?{name}={pw}&port=1"));
                        shapes.push(format!("{scheme}{host}?{name}={pw}"));
                    }
                }
            }
            for key in ["password", "pass", "pwd", "Password", "secret_thing"] {
                for quote in ["", "'"] {
                    shapes.push(format!("host=db user=app {key}={quote}{pw}{quote}"));
                    shapes.push(format!(
                        "host=db user=app {key} = {quote}{pw}{quote} port=5432"
                    ));
                    shapes.push(format!("{key}={quote}{pw}{quote} host=db"));
                }
            }
            for shape in &shapes {
                let shown = redact_url(shape);
                assert!(!shown.contains(needle), "{shape:?} shown as {shown:?}");
                checked += 1;
            }
        }
        assert!(checked > 2_800, "{checked} shapes");
    }

    /// Guarantee: a `://` inside a value does not make the string a URL, and a parameter whose
    /// value is shown does not show a secret run into it: a mistyped URL whose password holds
    /// `://`, a libpq `key=value` string with a value holding `://` after the password, and a
    /// query run together with `;` or `#` (JDBC's separator, a fragment) show no password.
    ///
    /// Broken: the first `://` anywhere was taken as the scheme's end and everything before it
    /// printed (`postgres//app:PLA://NTED@db` shown whole; `host=db password=PLANTED
    /// sslrootcert=file:///ca.pem` shown up to `file://`), and `sslmode=require;password=PLANTED`
    /// was printed as the value of `sslmode`.
    #[test]
    fn a_password_next_to_a_stray_scheme_separator_or_query_separator_is_hidden() {
        for shape in [
            "postgres//app:PLA://NTED@db.internal:5432/shop",
            "postgres:app:PLA://NTED@db/shop",
            "host=db user=app password=PLANTED sslrootcert=file:///etc/ca.pem",
            "password=PLANTED host=db application_name=svc://orders",
            "host=db password=PLA://NTED",
            "postgres://app@db/shop?sslmode=require;password=PLANTED",
            "postgres://app@db/shop?sslmode=require#password=PLANTED",
            "postgres://app@db/shop?application_name=x password=PLANTED",
            "amqp://mq/%2f?heartbeat=10;password=PLANTED",
        ] {
            let shown = redact_url(shape);
            assert!(
                !shown.contains("PLA") && !shown.contains("NTED"),
                "{shape:?} shown as {shown:?}"
            );
        }
        // Real URLs are shown as before.
        assert_eq!(
            redact_url("postgres://app:PLANTED@db/shop?sslmode=require&application_name=svc"),
            "postgres://app:<redacted>@db/shop?sslmode=require&application_name=svc"
        );
    }

    /// Guarantee: credential properties are secret, ordinary ones are shown.
    #[test]
    fn credential_properties_are_secret() {
        for name in [
            "sasl.password",
            "ssl.key.password",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.client.secret",
            "sasl.jaas.config",
            "ssl.keystore.password",
            "SASL.PASSWORD",
        ] {
            assert!(is_secret_name(name), "{name}");
        }
        for name in [
            "bootstrap.servers",
            "security.protocol",
            "linger.ms",
            "sasl.username",
        ] {
            assert!(!is_secret_name(name), "{name}");
        }
    }

    /// Guarantee: a comma inside a value stays in the value; a comma before `name=` starts a
    /// new property; errors never quote a value.
    #[test]
    fn property_lists_split_only_before_a_new_name() {
        let got = parse_properties("sasl.password=PL,ANT=ED,linger.ms=5, acks=all,").unwrap();
        assert_eq!(
            got,
            vec![
                ("sasl.password".into(), "PL".into()),
                ("ANT".into(), "ED".into()),
                ("linger.ms".into(), "5".into()),
                ("acks".into(), "all".into()),
            ]
        );
        let got = parse_properties("sasl.password=a,b c,d,security.protocol=SASL_SSL").unwrap();
        assert_eq!(got[0].1, "a,b c,d");
        assert_eq!(got[1].0, "security.protocol");
        let err = parse_properties("PLANTED,linger.ms=5").unwrap_err();
        assert!(!err.contains("PLANTED"), "{err}");
        let err = parse_properties("PLANTED").unwrap_err();
        assert!(!err.contains("PLANTED"), "{err}");
    }

    /// Guarantee: a property file's comments and blank lines are skipped, values are kept as
    /// written (commas and `=` included), and an error names the line, not the value.
    #[test]
    fn property_files_are_read_line_by_line() {
        let dir = std::env::temp_dir().join(format!("postal-props-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("client.properties");
        std::fs::write(
            &path,
            "# credentials\n\nsasl.password=a,b=c  \n! also a comment\nsecurity.protocol = SASL_SSL\n",
        )
        .unwrap();
        let got = read_properties_file(&path).unwrap();
        assert_eq!(got[0], ("sasl.password".into(), "a,b=c".into()));
        assert_eq!(got[1], ("security.protocol".into(), "SASL_SSL".into()));
        std::fs::write(&path, "ok=1\nPLANTED\n").unwrap();
        let err = read_properties_file(&path).unwrap_err();
        assert!(err.contains("line 2") && !err.contains("PLANTED"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Guarantee: an unknown secret parameter (which sqlx would log with its value) is
    /// refused naming only the parameter; a password parameter and an ordinary URL parse.
    #[test]
    fn database_urls_with_unusable_secrets_are_refused_without_the_value() {
        let err = database_url_options("postgres://db/app?sslpassword=PLANTED")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sslpassword") && !err.contains("PLANTED"),
            "{err}"
        );
        assert!(database_url_options("postgres://u@db/app?password=x&sslmode=prefer").is_ok());
        let err = database_url_options("postgres://u@db/app?sslpassword=PLA@NTED")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sslpassword") && !err.contains("NTED"),
            "{err}"
        );
        let err = database_url_options("postgres://u:PLANTED@db:notaport/app")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("PLANTED"), "{err}");
    }

    /// Guarantee: sqlx's own error about a URL's parameter never shows the parameter's value,
    /// which may hold a password run into it (JDBC's `;` separator, a percent-encoded `&`).
    ///
    /// Broken: `?sslmode=require;password=PLANTED` failed with sqlx's `unknown value
    /// "require;password=PLANTED" for ssl_mode`, printed as it is by `postal status` (and every
    /// command that connects), though the URL after it was redacted.
    #[test]
    fn sqlx_url_errors_never_show_a_value() {
        for url in [
            "postgres://app@db/shop?sslmode=require;password=PLANTED",
            "postgres://app@db/shop?sslmode=require%26password%3DPLANTED",
        ] {
            let err = database_url_options(url).unwrap_err().to_string();
            assert!(!err.contains("PLANTED"), "{url}: {err}");
            assert!(err.contains("ssl_mode"), "{url}: {err}");
        }
        assert_eq!(
            without_quoted(r#"unknown value "a" for x "b" and "c"#),
            r#"unknown value "<value not shown>" for x "<value not shown>" and "<value not shown>""#
        );
    }

    /// Guarantee: a Kafka configuration error names the property but never shows its value.
    #[test]
    fn kafka_configuration_errors_leave_the_value_out() {
        let e = rdkafka::ClientConfig::new()
            .set("sasl.pasword", "PLANTED")
            .set("sasl.jaas.config", "x password=\"PLANTED\";")
            .create::<rdkafka::producer::BaseProducer>()
            .map(|_| ())
            .unwrap_err();
        let shown = kafka_error_without_value(e).to_string();
        assert!(!shown.contains("PLANTED"), "{shown}");
        assert!(shown.contains("sasl."), "{shown}");
    }
}
