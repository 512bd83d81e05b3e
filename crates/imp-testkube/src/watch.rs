//! Watch streams: newline-delimited JSON events, bookmarks, resume and `410 Gone`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use crate::meta;
use crate::resource::ResourceType;
use crate::selector::Selectors;
use crate::store::{Event, EventType, Store};

/// What one watch request asked for.
#[derive(Debug, Clone, Default)]
pub struct WatchParams {
    /// `resourceVersion` to resume after (None or 0: start with the current state).
    pub rv: Option<u64>,
    /// `allowWatchBookmarks=true`.
    pub bookmarks: bool,
    /// `sendInitialEvents=true`: current state first, then a bookmark marking its end.
    pub initial: bool,
    /// `timeoutSeconds`.
    pub timeout: Option<Duration>,
    /// Namespace to watch; None watches all.
    pub namespace: Option<String>,
    /// Label and field selectors.
    pub selectors: Selectors,
    /// Send each object as a one-row Table (`kubectl get -w`).
    pub table: bool,
}

fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

fn error_event(status: Value) -> Bytes {
    line(&json!({"type": "ERROR", "object": status}))
}

fn gone(rv: u64) -> Bytes {
    error_event(crate::error::ApiError::gone(format!("too old resource version: {rv}")).to_status())
}

fn bookmark(rt: &ResourceType, rv: u64, initial_end: bool) -> Bytes {
    let mut md = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        md["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        &json!({"type": "BOOKMARK", "object": {"kind": rt.kind, "apiVersion": rt.api_version(), "metadata": md}}),
    )
}

/// Turns a stored event into what this watcher sees (None when it is filtered out).
fn project(rt: &ResourceType, p: &WatchParams, ev: &Event) -> Option<Bytes> {
    if ev.key != rt.store_key() {
        return None;
    }
    if let Some(ns) = &p.namespace
        && meta::namespace(&ev.object) != ns
    {
        return None;
    }
    let now = p.selectors.matches(&ev.object);
    let kind = match ev.kind {
        EventType::Added => now.then_some(EventType::Added),
        EventType::Deleted => {
            let was = ev.old.as_deref().is_none_or(|o| p.selectors.matches(o));
            (was || now).then_some(EventType::Deleted)
        }
        EventType::Modified => {
            let was = ev.old.as_deref().is_some_and(|o| p.selectors.matches(o));
            match (was, now) {
                (true, true) => Some(EventType::Modified),
                (false, true) => Some(EventType::Added),
                (true, false) => Some(EventType::Deleted),
                (false, false) => None,
            }
        }
    }?;
    let mut obj = crate::store::present(rt, &ev.object);
    if p.table {
        obj = crate::table::table(rt, &[obj], ev.rv, None);
    }
    Some(line(&json!({"type": kind.as_str(), "object": obj})))
}

/// Opens a watch and returns its streaming body; errors come as an ERROR event, like the real one.
pub fn open(
    store: &Arc<Store>,
    rt: Arc<ResourceType>,
    p: WatchParams,
    bookmark_every: Duration,
) -> Body {
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let start = store.watch(&rt, p.rv, p.initial);
    tokio::spawn(async move {
        let mut start = match start {
            Ok(s) => s,
            Err(e) => {
                let _ = tx.send(error_event(e.to_status())).await;
                return;
            }
        };
        let mut rv = start.rv;
        for ev in &start.backlog {
            if let Some(b) = project(&rt, &p, ev)
                && tx.send(b).await.is_err()
            {
                return;
            }
        }
        if p.initial && p.bookmarks && tx.send(bookmark(&rt, rv, true)).await.is_err() {
            return;
        }
        let deadline = tokio::time::sleep(p.timeout.unwrap_or(Duration::from_secs(1800)));
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(bookmark_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                ev = start.live.recv() => match ev {
                    Ok(ev) => {
                        if ev.rv <= rv {
                            continue;
                        }
                        rv = ev.rv;
                        if let Some(b) = project(&rt, &p, &ev)
                            && tx.send(b).await.is_err()
                        {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(gone(rv)).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick(), if p.bookmarks => {
                    if tx.send(bookmark(&rt, rv, false)).await.is_err() {
                        return;
                    }
                }
                _ = &mut deadline => return,
                _ = tx.closed() => return,
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    Body::from_stream(stream)
}
