//! The node side of ImpVMSnapshot: every execution (labelled `imp.dev/snapshot-parent`) whose
//! source VM runs on this node is taken here, by the VM's shim ([`crate::runtime::shim::snapshot`]),
//! into `storage.nodeLocal.path/<namespace>/<parent>/<execution>/`, and its status says how it
//! went (`phase`, `snapshotPath`, `completedAt`, `terminatedAt`, a `Ready` condition and an
//! Event). The execution carries the finalizer [`FINALIZER`] and the annotation
//! [`NODE_ANNOTATION`] from the moment its files may exist: deleting it removes them on this
//! node first. Parents and schedules are the operator's.
//!
//! The path is the tenant's choice, and the agent is root: it must be one of the node's allowed
//! snapshot roots, the directory is made without following links, and it is recorded in
//! `status.snapshotPath` before anything is written; deleting and restoring use that record
//! only ([`crate::snapshot::place`]). A path outside the roots fails the execution, naming the
//! field and the roots, with nothing made on the host.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::shared::LABEL_SNAPSHOT_PARENT;
use imp_api::snapshot::{ImpVMSnapshot, ImpVMSnapshotStatus, SnapshotPhase, StorageType};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Resource as _, ResourceExt as _};
use serde_json::json;

use crate::runtime::control::snapshot as take;
use crate::runtime::state::{StateDir, VmRecord};
use crate::snapshot::Source;
use crate::snapshot::oci;
use crate::snapshot::place::{self, Place, Refusal, Roots, TreeError};
use imp_api::chain::chain;
use imp_image::RegistryAuth;

/// The finalizer that holds an execution until its files are removed.
pub const FINALIZER: &str = "imp.dev/snapshot-files";
/// The node that holds an execution's node-local files.
pub const NODE_ANNOTATION: &str = imp_api::shared::ANNOTATION_SNAPSHOT_NODE;
/// The field manager of the agent's writes.
const FIELD_MANAGER: &str = "imp-agent";
/// How often an execution no VM of this node is the source of is looked at again (its VM
/// may come up here meanwhile; the operator fails it if the VM is gone or ended).
const NOT_HERE_RECHECK: Duration = Duration::from_secs(10);
/// How often the node's cache of pulled registry snapshots is swept of executions that are
/// gone (an execution being deleted drops its entry at once; the sweep catches deletions the
/// agent missed while it was down).
const CACHE_SWEEP: Duration = Duration::from_secs(600);
/// The directory, under the state directory, of registry snapshots pulled to this node.
const CACHE_DIR: &str = "snapshot-cache";
/// How long a shim may take to snapshot a VM (its memory and disk copied while it is paused).
const TAKE_TIMEOUT: Duration = Duration::from_secs(600);

/// What to do with an execution, decided from it and this node's VMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not this node's business (or nothing left to do).
    Nothing,
    /// Waiting to be taken, and its source VM has no record on this node (yet: it may be
    /// starting here): look again later.
    NotHere,
    /// Take it: the source VM (this record's name) runs here.
    Take(String),
    /// It is being deleted and its files are on this node: remove the directory recorded
    /// when it was taken (`status.snapshotPath`, if any), then the finalizer.
    Remove(Option<String>),
    /// Never taken: it names a VM of another namespace (the message names the field; the
    /// operator fails it).
    Refused(String),
}

/// Decides what this node does with execution `exec`; `local` finds a VM record of this node
/// by namespace and name.
pub fn decide<'a>(
    exec: &ImpVMSnapshot,
    node: &str,
    local: impl Fn(&str, &str) -> Option<&'a VmRecord>,
) -> Step {
    let ours = exec.annotations().get(NODE_ANNOTATION).map(String::as_str) == Some(node);
    if exec.meta().deletion_timestamp.is_some() {
        return match exec.finalizers().iter().any(|f| f == FINALIZER) && ours {
            true => Step::Remove(exec.status.as_ref().and_then(|s| s.snapshot_path.clone())),
            false => Step::Nothing,
        };
    }
    if !exec.labels().contains_key(LABEL_SNAPSHOT_PARENT) {
        return Step::Nothing;
    }
    let status = exec.status.clone().unwrap_or_default();
    if status.terminated_at.is_some() {
        return Step::Nothing;
    }
    // Only a VM of the execution's own namespace, whatever the admission webhook let in.
    let own = exec.namespace().unwrap_or_default();
    let ns = match imp_api::validation::source_vm_namespace(
        "snapshot",
        &exec.spec.source_vm_namespace,
        &own,
    ) {
        Ok(ns) => ns,
        Err(refused) => return Step::Refused(refused.to_string()),
    };
    match local(ns, &exec.spec.source_vm_name) {
        Some(r) => Step::Take(r.name.clone()),
        None => Step::NotHere,
    }
}

/// Where a VM boots from Succeeded execution `exec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// Its directory on this node.
    Here(PathBuf),
    /// Its registry artifact, by digest.
    Registry(String),
}

/// Where a VM on node `node` boots from Succeeded execution `exec`, or why it cannot there: a
/// node-local snapshot only from the directory recorded for it under one of `roots`.
pub fn source_on(exec: &ImpVMSnapshot, node: &str, roots: &Roots) -> Result<Stored, String> {
    let status = exec.status.clone().unwrap_or_default();
    if status.phase != Some(SnapshotPhase::Succeeded) {
        return Err("the snapshot has not succeeded".to_owned());
    }
    // One taken of another namespace's VM (before imp refused such snapshots) holds that VM's
    // memory, disk and Secrets: never restored.
    if let Err(refused) = imp_api::validation::source_vm_namespace(
        "snapshot",
        &exec.spec.source_vm_namespace,
        &exec.namespace().unwrap_or_default(),
    ) {
        return Err(format!(
            "it was not taken of a VM of its own namespace: {refused}"
        ));
    }
    if exec.spec.storage.type_ == StorageType::OciRegistry {
        let (Some(reference), Some(digest)) = (registry_reference(exec), status.digest) else {
            return Err("it names no registry artifact (status.digest)".to_owned());
        };
        let repo = reference
            .rsplit_once(':')
            .map_or(reference.as_str(), |(r, _)| r);
        return Ok(Stored::Registry(format!("{repo}@{digest}")));
    }
    match exec.annotations().get(NODE_ANNOTATION) {
        Some(n) if n == node => {}
        Some(n) => return Err(format!("its files are on node {n}, not on {node}")),
        None => return Err(format!("it names no node ({NODE_ANNOTATION})")),
    }
    let path = status
        .snapshot_path
        .ok_or_else(|| "it has no status.snapshotPath".to_owned())?;
    place::recorded(
        &path,
        &exec.namespace().unwrap_or_default(),
        &exec.name_any(),
        roots,
    )
    .map(|p| Stored::Here(p.dir()))
    .map_err(|e| e.to_string())
}

/// Where registry execution `uid` is pulled to on this node (complete once its manifest is
/// there: a pull writes it last).
pub fn cache_dir(state: &StateDir, uid: &str) -> PathBuf {
    state.root().join(CACHE_DIR).join(uid)
}

/// The cache entries (execution uids) of `cached` that no execution of `live` (uid, being
/// deleted) keeps: gone, or being deleted.
pub fn stale_cache_entries(cached: &[String], live: &[(String, bool)]) -> Vec<String> {
    cached
        .iter()
        .filter(|uid| !live.iter().any(|(u, deleting)| u == *uid && !deleting))
        .cloned()
        .collect()
}

/// Removes cache entries `uids` (blocking). A VM restored from one keeps what it mapped.
fn drop_cache_entries(state: &StateDir, uids: &[String]) {
    for uid in uids {
        let dir = cache_dir(state, uid);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), "pulled snapshot dropped from the node's cache")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %imp_api::chain::DisplayChain(&e), "dropping a pulled snapshot from the node's cache")
            }
        }
    }
}

/// The execution uids with an entry in this node's cache (blocking).
fn cached_entries(state: &StateDir) -> Vec<String> {
    std::fs::read_dir(state.root().join(CACHE_DIR))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every [`CACHE_SWEEP`], once the controller's view of the executions is complete: drops
/// the cache entries of executions that are gone.
async fn sweep_cache(store: kube::runtime::reflector::Store<ImpVMSnapshot>, state: StateDir) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    loop {
        let live: Vec<(String, bool)> = store
            .state()
            .iter()
            .filter_map(|e| Some((e.uid()?, e.meta().deletion_timestamp.is_some())))
            .collect();
        let state = state.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let stale = stale_cache_entries(&cached_entries(&state), &live);
            drop_cache_entries(&state, &stale);
        })
        .await;
        tokio::time::sleep(CACHE_SWEEP).await;
    }
}

/// The registry reference of execution `exec` (`repository:tag`), for oci-registry storage.
pub fn registry_reference(exec: &ImpVMSnapshot) -> Option<String> {
    let repo = exec.spec.storage.oci_registry.as_ref()?.repository.clone();
    let ns = exec.namespace().unwrap_or_default();
    Some(format!(
        "{repo}:{}",
        oci::tag_for(&format!("{ns}-{}", exec.name_any()))
    ))
}

/// The credentials for execution `exec`'s registry, from `storage.ociRegistry.pullSecretRef`
/// (handed out by the operator's gateway to the nodes that take, hold or restore it).
pub async fn registry_auth(
    client: &kube::Client,
    exec: &ImpVMSnapshot,
    reference: &str,
) -> Result<RegistryAuth, String> {
    let ns = exec.namespace().unwrap_or_default();
    let Some(name) = exec
        .spec
        .storage
        .oci_registry
        .as_ref()
        .and_then(|o| o.pull_secret_ref.as_ref())
        .map(|r| r.name.clone())
    else {
        return Ok(RegistryAuth::Anonymous);
    };
    let given = crate::node::inputs::of_snapshot(client, exec)
        .await
        .map_err(|e| {
            format!(
                "storage.ociRegistry.pullSecretRef {ns}/{name}: {}",
                chain(&e)
            )
        })?;
    let json = given
        .secrets
        .get(&name)
        .ok_or_else(|| {
            format!("storage.ociRegistry.pullSecretRef {ns}/{name}: Secret does not exist")
        })?
        .get(".dockerconfigjson")
        .ok_or_else(|| {
            format!("storage.ociRegistry.pullSecretRef {ns}/{name} has no .dockerconfigjson")
        })?;
    oci::auth_for(reference, Some(&json.0))
        .map_err(|e| format!("storage.ociRegistry.pullSecretRef {ns}/{name}: {e}"))
}

/// Where execution `exec`'s files go on this node, or why they may not: `None` for a
/// registry snapshot (written in the state directory, pushed, removed); for a node-local one
/// its place under one of `roots`. Pure.
pub fn destination(exec: &ImpVMSnapshot, roots: &Roots) -> Result<Option<Place>, Refusal> {
    if exec.spec.storage.type_ == StorageType::OciRegistry {
        return Ok(None);
    }
    let path = exec
        .spec
        .storage
        .node_local
        .as_ref()
        .map_or(place::DEFAULT_ROOT, |n| n.path.as_str());
    let parent = exec
        .labels()
        .get(LABEL_SNAPSHOT_PARENT)
        .map(String::as_str)
        .unwrap_or_default();
    place::place(
        path,
        &exec.namespace().unwrap_or_default(),
        parent,
        &exec.name_any(),
        roots,
    )
    .map(Some)
}

/// What the controller needs.
pub struct Context {
    client: kube::Client,
    node: String,
    state: StateDir,
    roots: Roots,
    recorder: Recorder,
}

impl Context {
    /// The controller's context on node `node` with VM records in `state`, putting node-local
    /// snapshots only under `roots`.
    pub fn new(client: kube::Client, node: String, state: StateDir, roots: Roots) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(node.clone()),
            },
        );
        Self {
            client,
            node,
            state,
            roots,
            recorder,
        }
    }
}

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("{action} ImpVMSnapshot {name}")]
    Kube {
        /// What was being done.
        action: &'static str,
        /// The execution.
        name: String,
        /// The API's error.
        #[source]
        source: kube::Error,
    },
    /// A snapshot directory could not be removed (and may be again).
    #[error("removing the snapshot directory")]
    Tree(#[source] TreeError),
}

fn kube_err(action: &'static str, exec: &ImpVMSnapshot) -> impl FnOnce(kube::Error) -> Error {
    let name = format!(
        "{}/{}",
        exec.namespace().unwrap_or_default(),
        exec.name_any()
    );
    move |source| Error::Kube {
        action,
        name,
        source,
    }
}

async fn reconcile(exec: Arc<ImpVMSnapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    let records = {
        let state = ctx.state.clone();
        tokio::task::spawn_blocking(move || state.list().map(|(r, _)| r))
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default()
    };
    let local = |ns: &str, name: &str| {
        records.iter().find(|r| {
            r.owner
                .as_ref()
                .is_some_and(|o| o.namespace == ns && o.name == name)
        })
    };
    if exec.meta().deletion_timestamp.is_some()
        && let Some(uid) = exec.uid()
    {
        let state = ctx.state.clone();
        let _ = tokio::task::spawn_blocking(move || drop_cache_entries(&state, &[uid])).await;
    }
    match decide(&exec, &ctx.node, local) {
        Step::Nothing => Ok(Action::await_change()),
        Step::NotHere => Ok(Action::requeue(NOT_HERE_RECHECK)),
        Step::Refused(why) => {
            tracing::warn!(snapshot = %exec.name_any(), namespace = ?exec.namespace(), node = %ctx.node, why, "not taking an execution that names a VM of another namespace");
            Ok(Action::await_change())
        }
        Step::Remove(dir) => remove(&exec, &ctx, dir).await,
        Step::Take(id) => {
            let record = records.iter().find(|r| r.name == id).cloned();
            match record {
                Some(r) => take_one(&exec, &ctx, &r).await,
                None => Ok(Action::await_change()),
            }
        }
    }
}

fn api(exec: &ImpVMSnapshot, ctx: &Context) -> Api<ImpVMSnapshot> {
    Api::namespaced(ctx.client.clone(), &exec.namespace().unwrap_or_default())
}

/// Removes the execution's files (the directory recorded in `recorded`, or its registry
/// manifest), then its finalizer.
async fn remove(
    exec: &ImpVMSnapshot,
    ctx: &Context,
    recorded: Option<String>,
) -> Result<Action, Error> {
    if let (Some(reference), Some(digest)) = (
        registry_reference(exec),
        exec.status.as_ref().and_then(|s| s.digest.clone()),
    ) {
        let by_digest = match reference.rsplit_once(':') {
            Some((repo, _tag)) => format!("{repo}@{digest}"),
            None => reference.clone(),
        };
        let deleted = match registry_auth(&ctx.client, exec, &reference).await {
            Ok(auth) => oci::delete(&by_digest, &auth).await.map_err(|e| chain(&e)),
            Err(e) => Err(e),
        };
        if let Err(why) = deleted {
            // The registry keeps it; the object goes anyway, and the Warning says what is left.
            let note = format!("{by_digest} was not deleted from the registry: {why}");
            tracing::warn!(snapshot = %exec.name_any(), node = %ctx.node, note, "registry deletion failed");
            let ev = Event {
                type_: EventType::Warning,
                reason: "RegistryDeleteFailed".to_owned(),
                note: Some(note),
                action: "Delete".to_owned(),
                secondary: None,
            };
            let _ = ctx.recorder.publish(&ev, &exec.object_ref(&())).await;
        }
    }
    let removed = match &recorded {
        Some(path) => remove_recorded(exec, ctx, path).await?,
        None => None,
    };
    let finalizers: Vec<&String> = exec
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .collect();
    let body = json!({"metadata": {
        "resourceVersion": exec.resource_version(),
        "finalizers": finalizers,
    }});
    api(exec, ctx)
        .patch(
            &exec.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
        .map_err(kube_err("removing the finalizer of", exec))?;
    if let Some(dir) = removed {
        tracing::info!(snapshot = %exec.name_any(), namespace = ?exec.namespace(), dir = %dir.display(), node = %ctx.node, "snapshot files removed");
    }
    Ok(Action::await_change())
}

/// Removes the directory recorded as `path` for `exec`, following no link; the directory
/// removed, or `None` when the record is not one the agent may remove (not this execution's
/// place under an allowed root, or a link or a directory others may write on the way): then
/// nothing is removed, a Warning says what is left, and the execution goes anyway. An error
/// that may pass is retried.
async fn remove_recorded(
    exec: &ImpVMSnapshot,
    ctx: &Context,
    path: &str,
) -> Result<Option<PathBuf>, Error> {
    let ns = exec.namespace().unwrap_or_default();
    let refused = match place::recorded(path, &ns, &exec.name_any(), &ctx.roots) {
        Err(why) => why.to_string(),
        Ok(p) => {
            let dir = p.dir();
            let removed = tokio::task::spawn_blocking(move || place::remove(&p))
                .await
                .unwrap_or_else(|e| {
                    Err(TreeError::Io {
                        action: "removing",
                        path: PathBuf::from(path),
                        source: std::io::Error::other(e),
                    })
                });
            match removed {
                Ok(()) => return Ok(Some(dir)),
                Err(e @ (TreeError::NotDirectory(_) | TreeError::Unsafe { .. })) => chain(&e),
                Err(e) => return Err(Error::Tree(e)),
            }
        }
    };
    let note = format!("the snapshot files were not removed: {refused}");
    tracing::warn!(snapshot = %exec.name_any(), namespace = %ns, node = %ctx.node, note, "snapshot files not removed");
    let ev = Event {
        type_: EventType::Warning,
        reason: "SnapshotFilesKept".to_owned(),
        note: Some(note),
        action: "Delete".to_owned(),
        secondary: None,
    };
    let _ = ctx.recorder.publish(&ev, &exec.object_ref(&())).await;
    Ok(None)
}

/// Takes execution `exec` of VM `record`, with its status and Event.
async fn take_one(exec: &ImpVMSnapshot, ctx: &Context, record: &VmRecord) -> Result<Action, Error> {
    let placed = destination(exec, &ctx.roots);
    let mut status = exec.status.clone().unwrap_or_default();
    // From here on its files may exist: the finalizer and the node come first (the node
    // alone for a path that is refused: it says why, and nothing is made).
    let mut finalizers: Vec<String> = exec.finalizers().to_vec();
    if placed.is_ok() && !finalizers.iter().any(|f| f == FINALIZER) {
        finalizers.push(FINALIZER.to_owned());
    }
    let body = json!({"metadata": {
        "resourceVersion": exec.resource_version(),
        "finalizers": finalizers,
        "annotations": {NODE_ANNOTATION: ctx.node},
    }});
    let exec_api = api(exec, ctx);
    let marked = exec_api
        .patch(
            &exec.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
        .map_err(kube_err("marking", exec))?;
    let place = match placed {
        Ok(p) => p,
        Err(why) => {
            return finish(&marked, ctx, status, Err(why.to_string()), Path::new("")).await;
        }
    };
    status.phase = Some(SnapshotPhase::Running);
    // The record a deletion and a restore go by, written before any file is.
    status.snapshot_path = place.as_ref().map(|p| p.dir().display().to_string());
    condition(
        &mut status,
        ConditionStatus::False,
        ConditionReason::Snapshotting,
        format!("node {} is taking it", ctx.node),
    );
    write_status(&marked, ctx, &status).await?;

    let dest = match prepare(exec, ctx, place).await {
        Ok(d) => d,
        Err(why) => return finish(&marked, ctx, status, Err(why), Path::new("")).await,
    };
    let source = Source {
        namespace: record
            .owner
            .as_ref()
            .map(|o| o.namespace.clone())
            .unwrap_or_default(),
        name: exec.spec.source_vm_name.clone(),
        image: String::new(),
    };
    let taken = take::take(&ctx.state, record, &dest, source, TAKE_TIMEOUT)
        .await
        .map_err(|e| imp_api::chain::chain(&e));
    let Some(reference) = registry_reference(exec) else {
        return finish(&marked, ctx, status, taken.map(|t| (t, None)), &dest).await;
    };
    let pushed = match taken {
        Ok(t) => push(exec, ctx, &dest, &reference)
            .await
            .map(|o| (t, Some(o))),
        Err(e) => Err(e),
    };
    let d = dest.clone();
    let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(d)).await;
    finish(&marked, ctx, status, pushed, &dest).await
}

/// Makes the empty directory execution `exec` is written into: its `place` (made without
/// following links, what an interrupted attempt left removed), or for a registry snapshot
/// one in the state directory, pushed and removed afterwards.
async fn prepare(
    exec: &ImpVMSnapshot,
    ctx: &Context,
    place: Option<Place>,
) -> Result<PathBuf, String> {
    let made = match place {
        Some(p) => {
            tokio::task::spawn_blocking(move || place::create_fresh(&p).map_err(|e| chain(&e)))
                .await
        }
        None => {
            let uid = exec
                .uid()
                .filter(|u| !u.is_empty())
                .ok_or("the execution has no uid")?;
            let dir = ctx.state.root().join("snapshot-push").join(uid);
            tokio::task::spawn_blocking(move || {
                let _ = std::fs::remove_dir_all(&dir);
                match dir.parent().map(std::fs::create_dir_all) {
                    Some(Err(e)) => Err(format!("making {}: {e}", dir.display())),
                    _ => Ok(dir),
                }
            })
            .await
        }
    };
    made.unwrap_or_else(|e| Err(e.to_string()))
        .map_err(|why| format!("making the snapshot directory: {why}"))
}

/// Pushes the snapshot in `dir` to `reference`.
async fn push(
    exec: &ImpVMSnapshot,
    ctx: &Context,
    dir: &std::path::Path,
    reference: &str,
) -> Result<oci::PushOutcome, String> {
    let auth = registry_auth(&ctx.client, exec, reference).await?;
    oci::push(dir, reference, &auth)
        .await
        .map_err(|e| format!("pushing to {reference}: {}", chain(&e)))
}

/// What a finished snapshot is: the manifest, bytes stored and, for a registry, the push.
type Taken = ((crate::snapshot::Manifest, u64), Option<oci::PushOutcome>);

async fn finish(
    exec: &ImpVMSnapshot,
    ctx: &Context,
    mut status: ImpVMSnapshotStatus,
    taken: Result<Taken, String>,
    dest: &std::path::Path,
) -> Result<Action, Error> {
    let now = Time(Timestamp::now());
    let (type_, reason, note) = match &taken {
        Ok(((m, bytes), pushed)) => {
            status.phase = Some(SnapshotPhase::Succeeded);
            status.completed_at = Some(now.clone());
            let place = match pushed {
                Some(p) => {
                    status.digest = Some(p.digest.clone());
                    format!("{} ({} MiB uploaded)", p.reference, p.bytes_uploaded >> 20)
                }
                None => {
                    status.snapshot_path = Some(dest.display().to_string());
                    format!("{} on node {}", dest.display(), ctx.node)
                }
            };
            let note = format!(
                "{place} ({} MiB stored; the VM was paused {} ms; {} {})",
                bytes >> 20,
                m.pause_ms,
                m.vmm,
                m.machine
            );
            condition(
                &mut status,
                ConditionStatus::True,
                ConditionReason::SnapshotSucceeded,
                note.clone(),
            );
            (EventType::Normal, ConditionReason::SnapshotSucceeded, note)
        }
        Err(why) => {
            status.phase = Some(SnapshotPhase::Failed);
            let note = format!("on node {}: {why}", ctx.node);
            condition(
                &mut status,
                ConditionStatus::False,
                ConditionReason::SnapshotFailed,
                note.clone(),
            );
            (EventType::Warning, ConditionReason::SnapshotFailed, note)
        }
    };
    status.terminated_at = Some(now);
    write_status(exec, ctx, &status).await?;
    match &taken {
        Ok(_) => {
            tracing::info!(snapshot = %exec.name_any(), namespace = ?exec.namespace(), node = %ctx.node, note, "snapshot taken")
        }
        Err(_) => {
            tracing::warn!(snapshot = %exec.name_any(), namespace = ?exec.namespace(), node = %ctx.node, note, "snapshot failed")
        }
    }
    let ev = Event {
        type_,
        reason: reason.as_str().to_owned(),
        note: Some(note),
        action: "Snapshot".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &exec.object_ref(&())).await {
        tracing::warn!(snapshot = %exec.name_any(), error = %imp_api::chain::DisplayChain(&e), "publishing an Event failed");
    }
    Ok(Action::await_change())
}

fn condition(
    status: &mut ImpVMSnapshotStatus,
    s: ConditionStatus,
    reason: ConditionReason,
    message: String,
) {
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        s,
        reason,
        message,
        None,
        Time(Timestamp::now()),
    );
}

async fn write_status(
    exec: &ImpVMSnapshot,
    ctx: &Context,
    status: &ImpVMSnapshotStatus,
) -> Result<(), Error> {
    let body = json!({"status": status});
    api(exec, ctx)
        .patch_status(
            &exec.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
        .map_err(kube_err("writing the status of", exec))?;
    Ok(())
}

fn error_policy(exec: Arc<ImpVMSnapshot>, error: &Error, _ctx: Arc<Context>) -> Action {
    let msg = chain(error);
    tracing::warn!(snapshot = %exec.name_any(), namespace = ?exec.namespace(), error = %msg, "snapshot reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the node's snapshot controller until `shutdown` completes.
pub async fn run(
    ctx: Arc<Context>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let api: Api<ImpVMSnapshot> = Api::all(ctx.client.clone());
    tracing::info!(node = %ctx.node, "taking the ImpVMSnapshot executions of this node's VMs");
    let controller = Controller::new(api, watcher::Config::default());
    let sweep = tokio::spawn(sweep_cache(controller.store(), ctx.state.clone()));
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
    sweep.abort();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn exec(labels: bool) -> ImpVMSnapshot {
        let mut e = ImpVMSnapshot::new("s-20261204-000000", Default::default());
        e.metadata.namespace = Some("ns".into());
        e.spec.source_vm_name = "vm".into();
        e.spec.source_vm_namespace = "ns".into();
        if labels {
            e.metadata.labels = Some([(LABEL_SNAPSHOT_PARENT.to_owned(), "s".to_owned())].into());
        }
        e
    }

    fn record() -> VmRecord {
        crate::node::decide::tests::record(crate::runtime::state::VmStatus::Running, 0)
    }

    #[test]
    fn an_execution_of_a_vm_here_is_taken_here_once() {
        let r = record();
        let find = |ns: &str, n: &str| (ns == "ns" && n == "vm").then_some(&r);
        assert_eq!(decide(&exec(true), "n1", find), Step::Take("uid-1".into()));
        assert_eq!(
            decide(&exec(true), "n1", |_, _| None),
            Step::NotHere,
            "not here"
        );
        assert_eq!(decide(&exec(false), "n1", find), Step::Nothing, "a parent");
        let mut done = exec(true);
        done.status = Some(ImpVMSnapshotStatus {
            terminated_at: Some(Time(Timestamp::now())),
            ..Default::default()
        });
        assert_eq!(decide(&done, "n1", find), Step::Nothing, "terminated");
    }

    #[test]
    fn an_execution_naming_another_namespaces_vm_is_never_taken_nor_restored() {
        let r = record();
        // A VM `victim/vm` runs here; the execution lives in `ns`.
        let find = |ns: &str, n: &str| (ns == "victim" && n == "vm").then_some(&r);
        let mut e = exec(true);
        e.spec.source_vm_namespace = "victim".into();
        let Step::Refused(why) = decide(&e, "n1", find) else {
            panic!("taken: {:?}", decide(&e, "n1", find));
        };
        assert_eq!(
            why,
            "spec.sourceVMNamespace: must be the snapshot's own namespace \"ns\" (or empty), got \"victim\""
        );
        // Empty means its own namespace's VM.
        e.spec.source_vm_namespace = String::new();
        let own = |ns: &str, n: &str| (ns == "ns" && n == "vm").then_some(&r);
        assert_eq!(decide(&e, "n1", own), Step::Take("uid-1".into()));
        // A snapshot of another namespace's VM taken before the check: never booted from.
        let mut done = exec(true);
        done.spec.source_vm_namespace = "victim".into();
        done.metadata.annotations = Some([(NODE_ANNOTATION.to_owned(), "n1".to_owned())].into());
        done.status = Some(ImpVMSnapshotStatus {
            phase: Some(SnapshotPhase::Succeeded),
            snapshot_path: Some("/var/lib/imp/snapshots/ns/s/s-20261204-000000".into()),
            ..Default::default()
        });
        let why = source_on(&done, "n1", &roots()).unwrap_err();
        assert!(why.contains("spec.sourceVMNamespace"), "{why}");
        done.spec.source_vm_namespace = "ns".into();
        assert!(source_on(&done, "n1", &roots()).is_ok());
    }

    #[test]
    fn a_pulled_snapshot_stays_cached_while_its_execution_lives() {
        let cached = ["a", "b", "c"].map(String::from).to_vec();
        let live = vec![("a".to_owned(), false), ("b".to_owned(), true)];
        assert_eq!(stale_cache_entries(&cached, &live), ["b", "c"]);
        assert!(stale_cache_entries(&[], &live).is_empty());
    }

    #[test]
    fn a_deleted_execution_frees_its_files_on_its_node_only() {
        let mut e = exec(true);
        e.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        e.metadata.finalizers = Some(vec![FINALIZER.into()]);
        e.metadata.annotations = Some([(NODE_ANNOTATION.to_owned(), "n1".to_owned())].into());
        // The directory recorded when it was taken, whatever the spec says now.
        let recorded = "/var/lib/imp/snapshots/ns/s/s-20261204-000000".to_owned();
        e.status = Some(ImpVMSnapshotStatus {
            snapshot_path: Some(recorded.clone()),
            ..Default::default()
        });
        e.spec.storage.node_local = Some(imp_api::snapshot::NodeLocalStorage {
            path: "/etc".into(),
        });
        assert_eq!(decide(&e, "n1", |_, _| None), Step::Remove(Some(recorded)));
        assert_eq!(decide(&e, "n2", |_, _| None), Step::Nothing);
        e.status = None;
        assert_eq!(
            decide(&e, "n1", |_, _| None),
            Step::Remove(None),
            "none recorded"
        );
    }

    fn roots() -> Roots {
        Roots::new(std::path::Path::new("/var/lib/imp/agent"), &[]).unwrap()
    }

    #[test]
    fn a_snapshot_goes_only_under_an_allowed_root() {
        let mut e = exec(true);
        let p = destination(&e, &roots()).unwrap().unwrap();
        assert_eq!(
            p.dir(),
            PathBuf::from("/var/lib/imp/snapshots/ns/s/s-20261204-000000")
        );
        for path in [
            "/etc",
            "/",
            "/var/lib/imp/snapshots/../../../root",
            "/var/lib/imp/agent",
        ] {
            e.spec.storage.node_local =
                Some(imp_api::snapshot::NodeLocalStorage { path: path.into() });
            let why = destination(&e, &roots()).unwrap_err().to_string();
            assert!(
                why.contains("spec.storage.nodeLocal.path")
                    && why.contains(&format!("{path:?}"))
                    && why.contains("/var/lib/imp/snapshots, /var/lib/imp/agent/snapshot-files"),
                "{why}"
            );
        }
        // The parent's name (a label the tenant sets) forms the path too.
        e.spec.storage.node_local = None;
        e.metadata.labels = Some([(LABEL_SNAPSHOT_PARENT.to_owned(), "..".to_owned())].into());
        let why = destination(&e, &roots()).unwrap_err().to_string();
        assert!(why.contains("parent") && why.contains("\"..\""), "{why}");
        e.spec.storage.type_ = StorageType::OciRegistry;
        assert_eq!(destination(&e, &roots()), Ok(None), "a registry's");
    }

    #[test]
    fn a_restore_reads_only_its_recorded_directory_under_an_allowed_root() {
        let mut e = exec(true);
        e.metadata.annotations = Some([(NODE_ANNOTATION.to_owned(), "n1".to_owned())].into());
        let dir = "/var/lib/imp/snapshots/ns/s/s-20261204-000000";
        for (path, ok) in [
            (dir, true),
            ("/etc", false),
            ("/var/lib/imp/snapshots/other/s/s-20261204-000000", false),
            ("/var/lib/imp/snapshots/ns/s/../../other/s/x", false),
        ] {
            e.status = Some(ImpVMSnapshotStatus {
                phase: Some(SnapshotPhase::Succeeded),
                snapshot_path: Some(path.into()),
                ..Default::default()
            });
            let got = source_on(&e, "n1", &roots());
            match ok {
                true => assert_eq!(got, Ok(Stored::Here(PathBuf::from(dir)))),
                false => assert!(
                    got.as_ref()
                        .is_err_and(|w| w.contains("status.snapshotPath")),
                    "{path}: {got:?}"
                ),
            }
        }
    }
}
