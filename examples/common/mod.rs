//! Pieces shared by the examples.

// Each example includes this module and uses a part of it.
#![allow(dead_code)]

use std::net::SocketAddr;

/// Serves `GET /metrics` (Prometheus text format) for `registry` on `addr`; returns
/// the bound address (pass port 0 for any free port).
pub(crate) async fn serve_metrics(
    registry: prometheus::Registry,
    addr: SocketAddr,
) -> std::io::Result<SocketAddr> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut body = Vec::new();
                let encoder = prometheus::TextEncoder::new();
                let _ = prometheus::Encoder::encode(&encoder, &registry.gather(), &mut body);
                (
                    [(axum::http::header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
                    body,
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(bound)
}

/// A minimal HTTP/1.1 GET or POST on loopback: the status code and the body.
pub(crate) async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The database the examples use: `DATABASE_URL` when set, else a throwaway local
/// PostgreSQL cluster from the server binaries (removed when the returned handle is
/// dropped). This is the examples' convenience, not part of chosen's API: in your
/// program, pass your own database URL to `ManagerOptions::from_url`.
pub(crate) fn database_url()
-> Result<(String, Option<chosen_tests::PgCluster>), Box<dyn std::error::Error>> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Ok((url, None)),
        _ => {
            eprintln!(
                "No DATABASE_URL: starting a throwaway PostgreSQL server (examples/common)..."
            );
            let cluster = chosen_tests::PgCluster::start_local()?;
            Ok((cluster.url(), Some(cluster)))
        }
    }
}
