//! A minimal HTTP/1.0 client for the dashboard tests and benchmark (one request per
//! connection, the whole answer read).

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
    let mut s = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .expect("connect");
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    if method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
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

/// The fields of the confirmation form in a page (the form with the `confirm` button), as a
/// browser would submit them.
pub fn confirm_form(page: &str) -> Vec<(String, String)> {
    let Some(button) = page.find("data-test=\"confirm\"") else {
        return Vec::new();
    };
    let start = page[..button].rfind("<form").unwrap_or(0);
    let mut out = Vec::new();
    for input in page[start..button].split("<input").skip(1) {
        let attr = |name: &str| {
            let i = input.find(&format!("{name}=\""))? + name.len() + 2;
            Some(unescape(input[i..].split('"').next()?))
        };
        if let (Some(n), Some(v)) = (attr("name"), attr("value")) {
            out.push((n, v));
        }
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}
