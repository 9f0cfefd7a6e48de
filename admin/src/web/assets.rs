//! The built-in assets: stylesheet, script and icon.

use axum::http::header;
use axum::response::{IntoResponse, Response};

pub(crate) async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../../assets/style.css"),
    )
        .into_response()
}

pub(crate) async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../../assets/app.js"),
    )
        .into_response()
}

pub(crate) async fn icon() -> Response {
    (
        [(header::CONTENT_TYPE, "image/svg+xml")],
        include_str!("../../assets/icon.svg"),
    )
        .into_response()
}
