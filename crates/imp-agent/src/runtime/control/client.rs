//! The front ends' side of the shim's typed API ([`crate::runtime::shim_api`]): watch a VM's
//! record as its shim changes it, ask a stop that answers when the shim has ended, a suspend
//! (its outcome is the record's), a snapshot that answers with its outcome, a warm pool's
//! claim that answers once the VM is its new owner's, and a member's pause. A VM
//! whose directory has no socket (its shim is of a release before the API, or has ended) gives
//! `None`, and the caller drives it by files and signals instead.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::runtime::contract::{SnapshotOutcome, SnapshotRequest};
use crate::runtime::shim_api::{
    self, ClaimOutcome, ClaimRequest, Envelope, Event, Reply, Request, SOCKET_FILE, WireError,
};

/// Connects to the shim of the VM in `dir`; `None` when nothing listens there.
async fn connect(dir: &Path) -> Result<Option<UnixStream>, WireError> {
    match UnixStream::connect(dir.join(SOCKET_FILE)).await {
        Ok(s) => Ok(Some(s)),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            Ok(None)
        }
        Err(source) => Err(WireError::Io {
            doing: "connecting to",
            source,
        }),
    }
}

/// Sends `request` on a new connection; `None` when nothing listens.
async fn ask(
    dir: &Path,
    request: Request,
) -> Result<Option<(BufReader<OwnedReadHalf>, OwnedWriteHalf)>, WireError> {
    let Some(stream) = connect(dir).await? else {
        return Ok(None);
    };
    let (r, mut w) = stream.into_split();
    shim_api::write(
        &mut w,
        &Envelope {
            v: shim_api::version_of(&request),
            request,
        },
    )
    .await?;
    Ok(Some((BufReader::new(r), w)))
}

/// The one reply to a request on `r`, read within `limit` (`doing` names the wait in a
/// timeout).
async fn reply_within(
    r: &mut BufReader<OwnedReadHalf>,
    limit: Duration,
    doing: &'static str,
) -> Result<Option<Reply>, WireError> {
    tokio::time::timeout(limit, shim_api::read::<_, Reply>(r))
        .await
        .map_err(|_| WireError::Io {
            doing,
            source: std::io::ErrorKind::TimedOut.into(),
        })?
}

/// A reply `request` does not expect: the shim's refusal, or an answer to something else.
fn not_expected(reply: Reply, request: &'static str) -> WireError {
    match reply {
        Reply::Refused { error } => WireError::Refused(error),
        other => WireError::Unexpected(format!("{other:?}"), request),
    }
}

/// The shim closed the connection before answering, while the caller was `doing` that.
fn ended_before(doing: &'static str) -> WireError {
    WireError::Io {
        doing,
        source: std::io::ErrorKind::UnexpectedEof.into(),
    }
}

/// The record of one VM, as its shim changes it.
pub struct Watch {
    r: BufReader<OwnedReadHalf>,
    _w: OwnedWriteHalf,
}

impl Watch {
    /// The next change; `None` once the shim has ended.
    pub async fn next(&mut self) -> Result<Option<Event>, WireError> {
        match shim_api::read::<_, Reply>(&mut self.r).await? {
            None => Ok(None),
            Some(Reply::Event(e)) => Ok(Some(*e)),
            Some(other) => Err(not_expected(other, "a watch")),
        }
    }
}

/// Watches the VM in `dir`: its record now, then at every change.
pub async fn watch(dir: &Path) -> Result<Option<Watch>, WireError> {
    Ok(ask(dir, Request::Watch)
        .await?
        .map(|(r, w)| Watch { r, _w: w }))
}

/// A stop the shim took: [`Self::ended`] returns once the shim has exited.
pub struct Stopping {
    r: BufReader<OwnedReadHalf>,
    _w: OwnedWriteHalf,
}

impl Stopping {
    /// Waits until the shim has written the VM's end and exited, up to `limit`; whether it did.
    pub async fn ended(mut self, limit: Duration) -> bool {
        let mut byte = [0u8; 1];
        tokio::time::timeout(limit, self.r.read(&mut byte))
            .await
            .is_ok()
    }
}

/// Asks the shim of the VM in `dir` to stop it (the workload gets `grace`; with `fail_reason`
/// its end is that failure); `None` when nothing listens.
pub async fn stop(
    dir: &Path,
    grace: Duration,
    fail_reason: Option<&str>,
) -> Result<Option<Stopping>, WireError> {
    let request = Request::Stop {
        grace_ms: super::grace_ms(grace),
        fail_reason: fail_reason.map(str::to_owned),
    };
    let Some((mut r, w)) = ask(dir, request).await? else {
        return Ok(None);
    };
    match shim_api::read::<_, Reply>(&mut r).await? {
        Some(Reply::Accepted) => Ok(Some(Stopping { r, _w: w })),
        // The shim ended between the connect and the request: it is stopped.
        None => Ok(Some(Stopping { r, _w: w })),
        Some(other) => Err(not_expected(other, "a stop")),
    }
}

/// Asks the shim of the VM in `dir` to snapshot it as `req` says and waits up to `limit` for
/// the outcome; `None` when nothing listens.
pub async fn snapshot(
    dir: &Path,
    req: SnapshotRequest,
    limit: Duration,
) -> Result<Option<SnapshotOutcome>, WireError> {
    let Some((mut r, _w)) = ask(dir, Request::Snapshot(req)).await? else {
        return Ok(None);
    };
    let reply = reply_within(&mut r, limit, "waiting for a snapshot's outcome on").await?;
    match reply {
        Some(Reply::Snapshot(o)) => Ok(Some(*o)),
        None => Err(ended_before("waiting for a snapshot's outcome on")),
        Some(other) => Err(not_expected(other, "a snapshot")),
    }
}

/// Asks the shim of the VM in `dir` to suspend it, the request named `token`; whether a shim
/// took it (`false`: nothing listens). The outcome is the record's.
pub async fn suspend(dir: &Path, token: &str) -> Result<bool, WireError> {
    let request = Request::Suspend {
        token: token.to_owned(),
    };
    let Some((mut r, _w)) = ask(dir, request).await? else {
        return Ok(false);
    };
    match shim_api::read::<_, Reply>(&mut r).await? {
        Some(Reply::Accepted) => Ok(true),
        None => Err(ended_before("waiting for a suspend's answer on")),
        Some(other) => Err(not_expected(other, "a suspend")),
    }
}

/// Asks the shim of the VM in `dir` to pause its running VM's vCPUs (a warm pool's member
/// waiting), waiting up to `limit`; `false` when nothing listens.
pub async fn pause(dir: &Path, limit: Duration) -> Result<bool, WireError> {
    let Some((mut r, _w)) = ask(dir, Request::Pause).await? else {
        return Ok(false);
    };
    let reply = reply_within(&mut r, limit, "waiting for a pause's answer on").await?;
    match reply {
        Some(Reply::Accepted) => Ok(true),
        None => Err(ended_before("waiting for a pause's answer on")),
        Some(other) => Err(not_expected(other, "a pause")),
    }
}

/// Asks the shim of the VM in `dir` to hand the running VM to another owner as `req` says, and
/// waits up to `limit` for the outcome; `None` when nothing listens.
pub async fn claim(
    dir: &Path,
    req: ClaimRequest,
    limit: Duration,
) -> Result<Option<ClaimOutcome>, WireError> {
    let Some((mut r, _w)) = ask(dir, Request::Claim(Box::new(req))).await? else {
        return Ok(None);
    };
    let reply = reply_within(&mut r, limit, "waiting for a claim's outcome on").await?;
    match reply {
        Some(Reply::Claimed(o)) => Ok(Some(*o)),
        None => Err(ended_before("waiting for a claim's outcome on")),
        Some(other) => Err(not_expected(other, "a claim")),
    }
}
