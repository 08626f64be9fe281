//! The accept loop: HTTP/1.1 connections on hyper with a request-header timeout (which also
//! bounds how long an idle keep-alive connection waits for its next request), a cap on open
//! connections (beyond it a connection gets a JSON 503 with `Retry-After` and is closed), and a
//! graceful stop that lets open requests finish. `axum::serve` has neither knob.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::api::ApiError;

/// The limits a connection is held to (the `serve` flags of the same names).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// From a connection's opening (or the end of its last response) to the end of the next
    /// request's headers.
    pub header_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

/// Serves `router` on `listener` until `stop` resolves, then stops accepting and waits for the
/// open connections' requests to end (idle ones are closed at once).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: the others keep being served.
                    eprintln!("serve: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(router.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A client that resets or times out ends its own connection only.
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// A connection over the cap: a JSON 503 with `Retry-After`, then close (reading what the
/// client sent for a moment, so that the close is not a reset that loses the answer).
async fn refuse(mut stream: TcpStream, cap: usize) {
    let body = ApiError::too_many_connections(cap).json().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    if stream.write_all(head.as_bytes()).await.is_err()
        || stream.write_all(body.as_bytes()).await.is_err()
    {
        return;
    }
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}
