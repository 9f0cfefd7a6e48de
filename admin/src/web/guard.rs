//! Every request passes here: authentication, the same-origin check on POSTs, and the
//! security headers on every response.

use axum::extract::{Request, State as Extract};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;

use super::html::{esc, page};
use super::{Auth, State};

/// Who is asking, as the audit trail records it.
#[derive(Clone, Debug)]
pub(crate) struct Actor(pub(crate) String);

const COOKIE: &str = "postal_dashboard_token";

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

fn same(a: &[u8], b: &[u8]) -> bool {
    // Length and every byte compared, without an early exit on the first difference.
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn presented_token(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        if let Some(t) = v.strip_prefix("Bearer ") {
            return Some(t.trim().to_owned());
        }
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            c.trim()
                .strip_prefix(COOKIE)?
                .strip_prefix('=')
                .map(str::to_owned)
        })
}

/// The host a request names: its `Host` header, or the URI's authority (HTTP/2).
fn host_of(headers: &HeaderMap, uri: &axum::http::Uri) -> Option<String> {
    headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| uri.authority().map(|a| a.as_str().to_owned()))
}

/// Whether the request names a loopback host (`localhost`, `127.x.x.x`, `[::1]`, any port), or
/// none (a client that is not a browser).
fn loopback_host(req: &Request) -> bool {
    let Some(host) = host_of(req.headers(), req.uri()) else {
        return true;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host.as_str(), |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A POST must come from a page of this dashboard: its `Origin` (or, without one, a
/// `Sec-Fetch-Site: same-origin`) must name the host it was sent to.
fn same_origin(headers: &HeaderMap, uri: &axum::http::Uri) -> bool {
    let host = host_of(headers, uri);
    match (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        host.as_deref(),
    ) {
        (Some(origin), Some(host)) => {
            let rest = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"));
            rest == Some(host)
        }
        (Some(_), None) => false,
        (None, _) => {
            headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) == Some("same-origin")
        }
    }
}

fn refused(status: StatusCode, why: &str) -> Response {
    (
        status,
        Html(format!(
            "<!doctype html><title>Refused</title><p>{}</p>",
            esc(why)
        )),
    )
        .into_response()
}

pub(crate) async fn guard(
    Extract(state): Extract<State>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_owned();
    // Inside the router the path is relative to where it is mounted (axum strips the prefix).
    let open_path = path == "/login" || path.starts_with("/assets/");
    let actor = match &state.auth {
        Auth::Open | Auth::Unset => Some("local".to_owned()),
        Auth::Loopback => loopback_host(&req).then(|| "local".to_owned()),
        Auth::Token(t) => presented_token(req.headers())
            .filter(|p| same(p.as_bytes(), t.as_bytes()))
            .map(|_| "token".to_owned()),
        Auth::Hook(hook) => {
            let (parts, body) = req.into_parts();
            let who = hook(&parts);
            req = Request::from_parts(parts, body);
            who
        }
    };
    let mut response = match actor {
        None if !open_path => {
            if matches!(state.auth, Auth::Token(_)) && req.method() == Method::GET {
                Redirect::to(&format!("{}/login", state.base)).into_response()
            } else {
                refused(StatusCode::UNAUTHORIZED, "not authorised")
            }
        }
        _ if req.method() == Method::POST && !same_origin(req.headers(), req.uri()) => {
            tracing::warn!(path = %postal_shared::text::field(&path), "dashboard refused a cross-origin POST");
            refused(
                StatusCode::FORBIDDEN,
                "refused: this request did not come from a page of this dashboard (Origin check)",
            )
        }
        actor => {
            if let Some(a) = actor {
                req.extensions_mut().insert(Actor(a));
            }
            next.run(req).await
        }
    };
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if !path.starts_with("/assets/") {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

pub(crate) async fn login_form(Extract(state): Extract<State>) -> Html<String> {
    Html(page(
        &state.base,
        "",
        "Sign in",
        &format!(
            "<form method=\"post\" action=\"{}/login\" class=\"filters\">\
             <label>Dashboard token<input type=\"password\" name=\"token\" autocomplete=\"current-password\" required></label>\
             <button type=\"submit\">Sign in</button></form>",
            state.base
        ),
        false,
        "",
    ))
}

#[derive(serde::Deserialize)]
pub(crate) struct Login {
    token: String,
}

pub(crate) async fn login(Extract(state): Extract<State>, Form(form): Form<Login>) -> Response {
    let Auth::Token(t) = &state.auth else {
        return Redirect::to(&format!("{}/", state.base)).into_response();
    };
    if !same(form.token.as_bytes(), t.as_bytes()) {
        tracing::warn!("dashboard sign-in with a wrong token");
        return refused(StatusCode::UNAUTHORIZED, "wrong token");
    }
    let path = if state.base.is_empty() {
        "/"
    } else {
        state.base.as_str()
    };
    let cookie = format!(
        "{COOKIE}={}; HttpOnly; SameSite=Strict; Path={path}",
        form.token
    );
    let mut r = Redirect::to(&format!("{}/", state.base)).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}
