//! The streaming body: worker events become `data:` lines as they arrive, with a keep-alive
//! comment whenever nothing was sent for a while (a request waiting in the queue).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::routes::Formatter;
use crate::worker::Event;

/// Sets the cancellation flag when dropped before `disarm`: hyper drops a response body (or the
/// handler's future) when its client has gone.
pub struct CancelGuard {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelGuard {
    pub fn new(flag: Arc<AtomicBool>) -> CancelGuard {
        CancelGuard { flag, armed: true }
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Relaxed);
        }
    }
}

pub struct SseBody {
    rx: UnboundedReceiver<Event>,
    fmt: Formatter,
    pending: VecDeque<Bytes>,
    keep_alive: Interval,
    guard: CancelGuard,
    done: bool,
}

impl SseBody {
    pub fn new(
        rx: UnboundedReceiver<Event>,
        fmt: Formatter,
        guard: CancelGuard,
        period: Duration,
    ) -> SseBody {
        let mut keep_alive = tokio::time::interval_at(Instant::now() + period, period);
        keep_alive.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let pending = VecDeque::from([Bytes::from(fmt.opening())]);
        SseBody {
            rx,
            fmt,
            pending,
            keep_alive,
            guard,
            done: false,
        }
    }
}

impl futures_core::Stream for SseBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(b)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(ev) => {
                    let (text, finished) = this.fmt.stream_event(ev);
                    if finished {
                        this.done = true;
                        this.guard.disarm();
                    }
                    this.keep_alive.reset();
                    if !text.is_empty() {
                        this.pending.push_back(Bytes::from(text));
                    }
                    continue;
                }
                Poll::Pending => {}
            }
            if this.keep_alive.poll_tick(cx).is_ready() {
                return Poll::Ready(Some(Ok(Bytes::from_static(b": keep-alive\n\n"))));
            }
            return Poll::Pending;
        }
    }
}
