//! A minimal HTTP client for the dashboard tests and benchmark (one request per connection,
//! the whole answer read): [`request`] builds an HTTP/1.0 request, [`raw`] sends one written by
//! hand; and the forms of a page, read as a browser submits them.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One answer.
#[derive(Debug)]
pub struct Answer {
    /// Status code.
    pub status: u16,
    /// Header lines, lower-cased names (`name: value`).
    pub headers: Vec<String>,
    /// Body.
    pub body: String,
}

impl Answer {
    /// The value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find_map(|h| h.strip_prefix(name)?.strip_prefix(": "))
    }
}

/// Sends `method path` with `headers` and a form `body` (for POST) to `addr`.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    if method == "POST" {
        req.push_str(&form_headers(body));
    }
    req.push_str("\r\n");
    req.push_str(body);
    exchange(addr, &req).await
}

/// Sends the request `head` as written (its lines joined by CRLF, no `Host` added: a test of
/// malformed or hostile requests says exactly what it sends), closing the connection after one
/// answer, with a form `body` when not empty.
pub async fn raw(addr: SocketAddr, head: &str, body: &str) -> Answer {
    let mut req = head.trim_end().replace('\n', "\r\n");
    req.push_str("\r\nConnection: close\r\n");
    if !body.is_empty() {
        req.push_str(&form_headers(body));
    }
    req.push_str("\r\n");
    req.push_str(body);
    exchange(addr, &req).await
}

fn form_headers(body: &str) -> String {
    format!(
        "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
        body.len()
    )
}

/// Writes `req` on a new connection to `addr` and reads the answer to the end.
async fn exchange(addr: SocketAddr, req: &str) -> Answer {
    let mut s = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .expect("connect");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .map(|l| match l.split_once(": ") {
            Some((n, v)) => format!("{}: {v}", n.to_ascii_lowercase()),
            None => l.to_owned(),
        })
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// Percent-encodes a form value.
pub fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| {
            let enc: String = v
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("{k}={enc}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The value of the hidden `csrf` input in a page.
pub fn csrf(page: &str) -> Option<String> {
    let i = page.find("name=\"csrf\" value=\"")? + "name=\"csrf\" value=\"".len();
    Some(page[i..].split('"').next()?.to_owned())
}

/// The fields of the form whose button carries `data-test="{test}"` (the `occurrence`-th such
/// button), as a browser submits them (entities decoded). No such button: panics, showing the
/// page.
pub fn form_fields(page: &str, test: &str, occurrence: usize) -> Vec<(String, String)> {
    let marker = format!("data-test=\"{test}\"");
    let at = page
        .match_indices(&marker)
        .nth(occurrence)
        .unwrap_or_else(|| panic!("no button {test} #{occurrence} in:\n{page}"))
        .0;
    let start = page[..at].rfind("<form").expect("the button's form");
    let mut fields = Vec::new();
    for input in page[start..at].split("<input ").skip(1) {
        let attr = |name: &str| {
            let key = format!("{name}=\"");
            let i = input.find(&key)? + key.len();
            Some(unescape(&input[i..i + input[i..].find('"')?]))
        };
        if let (Some(n), Some(v)) = (attr("name"), attr("value")) {
            fields.push((n, v));
        }
    }
    fields
}

/// `fields` borrowed, as [`form`] and the posting helpers take them.
pub fn pairs(fields: &[(String, String)]) -> Vec<(&str, &str)> {
    fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}
