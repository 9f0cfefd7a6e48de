//! HTML output: escaping, the page frame, tables and bar charts. Every value from the
//! database goes through [`esc`] (or [`bytes`]) before it is written.

use std::fmt::Write as _;

/// Escapes text for HTML element content and attribute values (quoted with `"`).
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters and bidi overrides shown, not obeyed.
            c if c.is_control() && c != '\n' && c != '\t' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// Bytes as escaped text (lossy UTF-8), or their size when they are not text.
pub fn bytes(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(s) => esc(s),
        Err(_) => format!("({} bytes, not UTF-8)", b.len()),
    }
}

/// Percent-encodes a query value.
pub fn q(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A duration in seconds, short (`4.2 s`, `3 min`, `2.5 h`).
pub fn age(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// The whole page: `title`, the navigation (with `here` marked), and `body`. `live`: the page
/// refreshes its `#live` part every few seconds while the tab is visible.
pub fn page(base: &str, here: &str, title: &str, body: &str, live: bool, notice: &str) -> String {
    let mut nav = String::new();
    for (path, name) in [
        ("/", "Overview"),
        ("/parked", "Parked events"),
        ("/blocked", "Blocked keys"),
        ("/held", "Held keys"),
        ("/dead-letters", "Dead letters"),
        ("/lookup", "Dedup lookup"),
        ("/pauses", "Pauses"),
        ("/audit", "Audit"),
    ] {
        let current = if path == here {
            " aria-current=\"page\""
        } else {
            ""
        };
        let _ = write!(nav, "<a href=\"{base}{path}\"{current}>{name}</a>");
    }
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · Postal</title>\
         <link rel=\"stylesheet\" href=\"{base}/assets/style.css\">\
         <link rel=\"icon\" href=\"{base}/assets/icon.svg\" type=\"image/svg+xml\">\
         <script src=\"{base}/assets/app.js\" defer></script></head>\
         <body{refresh}><header><strong class=\"brand\">Postal</strong><nav>{nav}</nav>\
         <span id=\"refresh-state\" class=\"muted\"></span></header>\
         <main><h1>{title}</h1>{notice}<div id=\"live\">{body}</div></main></body></html>",
        title = esc(title),
        refresh = if live { " data-refresh=\"5\"" } else { "" },
    )
}

/// A table: `head` cells and pre-rendered (escaped) rows; `empty` when there are none.
pub fn table(id: &str, head: &[&str], rows: &[Vec<String>], empty: &str) -> String {
    if rows.is_empty() {
        return format!("<p class=\"empty\" id=\"{id}\">{}</p>", esc(empty));
    }
    let mut t = format!("<table id=\"{id}\"><thead><tr>");
    for h in head {
        let _ = write!(t, "<th>{}</th>", esc(h));
    }
    t.push_str("</tr></thead><tbody>");
    for r in rows {
        t.push_str("<tr>");
        for c in r {
            let _ = write!(t, "<td>{c}</td>");
        }
        t.push_str("</tr>");
    }
    t.push_str("</tbody></table>");
    t
}

/// A bar chart of one value per minute (oldest first; each point's label is its minute,
/// `HH:MM` in UTC), drawn as inline SVG (no script): a value axis from 0 to the largest value
/// with its unit, and a time axis labelled at its start, middle and end.
pub fn bars(id: &str, label: &str, unit: &str, points: &[(String, f64)]) -> String {
    let max = points.iter().map(|p| p.1).fold(0.0_f64, f64::max);
    let total: f64 = points.iter().map(|p| p.1).sum();
    let per = if unit == "ms" { "" } else { " per minute" };
    // Room on the left for the value axis's labels, below for the time axis's.
    let (left, w, h, below) = (112.0, 10.0, 80.0, 26.0);
    let width = left + w * points.len() as f64;
    let mut svg = format!(
        "<figure class=\"chart\" id=\"{id}\"><figcaption>{} <span class=\"muted\">({}{}; max {} {})</span></figcaption>\
         <svg viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"{}, {}{}, last 60 minutes\">",
        esc(label),
        esc(unit),
        per,
        fmt_num(max),
        esc(unit),
        width,
        h + 2.0 + below,
        esc(label),
        esc(unit),
        per,
    );
    // The value axis: 0 at the bottom, the largest value at the top.
    let _ = write!(
        svg,
        "<line class=\"axis\" x1=\"{left}\" y1=\"1\" x2=\"{left}\" y2=\"{}\"></line>\
         <text class=\"tick\" x=\"{}\" y=\"16\" text-anchor=\"end\">{} {}</text>\
         <text class=\"tick\" x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>",
        h + 1.0,
        left - 4.0,
        fmt_num(max),
        esc(unit),
        left - 4.0,
        h + 1.0,
    );
    for (i, (t, v)) in points.iter().enumerate() {
        let bh = if max > 0.0 { (v / max) * h } else { 0.0 };
        let _ = write!(
            svg,
            "<rect class=\"bar\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"><title>{} {} {}</title></rect>",
            left + i as f64 * w + 1.0,
            h - bh + 1.0,
            w - 2.0,
            bh.max(if *v > 0.0 { 1.0 } else { 0.0 }),
            esc(t),
            fmt_num(*v),
            esc(unit)
        );
    }
    // The time axis, labelled at its first, middle and last minute.
    let _ = write!(
        svg,
        "<line class=\"axis\" x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"></line>",
        h + 1.0,
        width,
        h + 1.0,
    );
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        let mid = &points[points.len() / 2];
        for (x, anchor, text) in [
            (left, "start", first.0.clone()),
            (
                left + w * (points.len() / 2) as f64,
                "middle",
                mid.0.clone(),
            ),
            (width, "end", format!("{} UTC", last.0)),
        ] {
            let _ = write!(
                svg,
                "<text class=\"tick\" x=\"{x}\" y=\"{}\" text-anchor=\"{anchor}\">{}</text>",
                h + below - 4.0,
                esc(&text)
            );
        }
    }
    let _ = write!(
        svg,
        "</svg><p class=\"muted\">last 60 minutes{}</p></figure>",
        if unit == "ms" {
            String::new()
        } else {
            format!("; {} in all", fmt_num(total))
        }
    );
    svg
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}
