//! Fencing: a node cut off from the API server stops its own VMs before the operator runs
//! them elsewhere, so no VM ever runs twice.
//!
//! The agent renews a Lease of its own, `imp-agent-<node>` in its namespace (label
//! [`LABEL_AGENT_LEASE`], `leaseDurationSeconds` = its fence deadline), every
//! [`Settings::renew_every`]. A watchdog looks every second at the time since the last renewal
//! the API server accepted; once that reaches [`Settings::fence_after`], the agent **fences**:
//! it kills every VM of the node (everything in each VM's cgroup, else its shim and VMM) and
//! starts, resumes and cold-boots nothing until a renewal succeeds again. The VMs' records stay,
//! so once the node is back each VM is reported as ended (or, if it has moved meanwhile, removed
//! as any VM that left the node).
//!
//! The operator moves a VM off a node that is not Ready only after that node's Lease has not
//! changed for its `leaseDurationSeconds` plus a margin, measured on the operator's own clock
//! from when it saw the last change (see `imp_operator::vm`): by then the agent, if it
//! lives, has fenced. Timeline (defaults): renewals every 10 s; fenced at most 30 s + 1 s after
//! the last accepted renewal; moved no earlier than 30 s + 10 s after the operator saw it.
//!
//! What fencing cannot cover: an agent that is dead while its node is cut off (its VMs run on
//! under their shims); the Lease tells the operator only that someone renewed it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use imp_api::shared::LABEL_AGENT_LEASE;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::runtime::cgroup::VmCgroup;
use crate::runtime::control;
use crate::runtime::state::StateDir;

/// The name of node `node`'s agent Lease.
pub fn lease_name(node: &str) -> String {
    imp_api::shared::agent_lease_name(node)
}

/// How the agent renews and fences.
#[derive(Debug, Clone)]
pub struct Settings {
    /// This node.
    pub node: String,
    /// The Lease's namespace (the agent's own).
    pub namespace: String,
    /// How long without an accepted renewal before the VMs are fenced.
    pub fence_after: Duration,
    /// How often the Lease is renewed (a third of `fence_after` by default).
    pub renew_every: Duration,
}

/// The node's fencing state, shared by the renewer, the watchdog and the reconciler.
#[derive(Debug)]
pub struct Fence {
    inner: Mutex<State>,
}

#[derive(Debug, Clone, Copy)]
struct State {
    last_ok: Instant,
    fenced: bool,
}

impl Default for Fence {
    fn default() -> Self {
        Self {
            inner: Mutex::new(State {
                last_ok: Instant::now(),
                fenced: false,
            }),
        }
    }
}

impl Fence {
    /// Whether the node's VMs are fenced: nothing may start, resume or cold-boot.
    pub fn is_fenced(&self) -> bool {
        self.lock().fenced
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A renewal sent at `sent` was accepted: returns whether this lifts a fence. The clock
    /// restarts from when the request was sent, not answered: the API server wrote it (and
    /// the operator saw it) no earlier, so the agent fences no later than the operator expects
    /// however slow the answer was.
    fn renewed(&self, sent: Instant) -> bool {
        let mut s = self.lock();
        s.last_ok = s.last_ok.max(sent);
        std::mem::replace(&mut s.fenced, false)
    }

    /// Whether the watchdog must fence now (and marks the node fenced if so).
    fn fence_due(&self, fence_after: Duration) -> Option<Duration> {
        let mut s = self.lock();
        let silent = s.last_ok.elapsed();
        must_fence(silent, fence_after, s.fenced).then(|| {
            s.fenced = true;
            silent
        })
    }
}

/// Whether a node whose last accepted renewal was `silent` ago must fence now: once, when the
/// silence reaches the deadline.
pub fn must_fence(silent: Duration, fence_after: Duration, fenced: bool) -> bool {
    !fenced && silent >= fence_after
}

/// The Lease's spec after a renewal at `now`.
fn lease_body(s: &Settings, now: MicroTime) -> serde_json::Value {
    json!({
        "metadata": {"labels": {LABEL_AGENT_LEASE: "true"}},
        "spec": {
            "holderIdentity": s.node,
            "leaseDurationSeconds": s.fence_after.as_secs().max(1),
            "renewTime": now,
        }
    })
}

/// Renews the Lease once (creating it the first time), within `timeout`.
async fn renew(api: &Api<Lease>, s: &Settings, timeout: Duration) -> Result<(), String> {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let name = lease_name(&s.node);
    let body = lease_body(s, now);
    let attempt = async {
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 404 => {
                let mut lease: Lease =
                    serde_json::from_value(body.clone()).map_err(kube::Error::SerdeError)?;
                lease.metadata.name = Some(name.clone());
                api.create(&PostParams::default(), &lease).await.map(|_| ())
            }
            other => other.map(|_| ()),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(imp_api::chain::chain(&e)),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Renews the node's Lease until the process ends.
pub async fn keep_lease(client: kube::Client, s: Settings, fence: std::sync::Arc<Fence>) {
    let api: Api<Lease> = Api::namespaced(client, &s.namespace);
    let timeout = s.renew_every.max(Duration::from_secs(1));
    let mut failing = false;
    loop {
        let sent = Instant::now();
        match renew(&api, &s, timeout).await {
            Ok(()) => {
                if fence.renewed(sent) {
                    tracing::warn!(node = %s.node, "the API server accepts the agent's Lease again; the fence is lifted");
                } else if failing {
                    tracing::info!(node = %s.node, "renewing the agent's Lease works again");
                }
                failing = false;
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(node = %s.node, lease = %lease_name(&s.node), namespace = %s.namespace, error,
                        fence_after_secs = s.fence_after.as_secs(), "cannot renew the agent's Lease; the node's VMs are fenced if this lasts");
                }
                failing = true;
            }
        }
        tokio::time::sleep(s.renew_every).await;
    }
}

/// Fences the node's VMs when the Lease has not been renewed for `fence_after`; checks every
/// second (and exports the silence and the fence as metrics), until the process ends.
pub async fn watchdog(
    state: StateDir,
    s: Settings,
    fence: std::sync::Arc<Fence>,
    metrics: std::sync::Arc<super::metrics::Metrics>,
) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = *fence.lock();
        metrics.set_fencing(now.last_ok.elapsed(), now.fenced);
        if let Some(silent) = fence.fence_due(s.fence_after) {
            tracing::error!(node = %s.node, silent_secs = silent.as_secs(), fence_after_secs = s.fence_after.as_secs(),
                "the agent's Lease has not been renewed in time: fencing every VM of the node, so the operator can run them elsewhere");
            let state = state.clone();
            let killed = tokio::task::spawn_blocking(move || kill_all_vms(&state)).await;
            match killed {
                Ok(n) => {
                    tracing::error!(node = %s.node, vms = n, "fenced: the node's VMs are stopped")
                }
                Err(e) => {
                    tracing::error!(node = %s.node, error = %imp_api::chain::DisplayChain(&e), "fencing failed")
                }
            }
        }
    }
}

/// Kills every VM with a record under `state`: everything in its cgroup, else its shim and
/// VMM. Returns how many VMs had something to kill. Blocking.
fn kill_all_vms(state: &StateDir) -> usize {
    let Ok((records, _)) = state.list() else {
        return 0;
    };
    let mut killed = 0;
    for r in records {
        let cgroup = control::read_spec(state, &r.name)
            .ok()
            .and_then(|s| s.cgroup.map(|c| c.path));
        let by_cgroup = cgroup
            .as_deref()
            .and_then(|p| VmCgroup::at(p).ok())
            .filter(VmCgroup::exists)
            .map(|cg| {
                let had = !cg.pids().is_empty();
                if let Err(e) = cg.kill_all(Duration::from_secs(2)) {
                    tracing::error!(vm = %r.name, error = %imp_api::chain::DisplayChain(&e), "fencing: processes survive in the VM's cgroup");
                }
                had
            });
        let had = match by_cgroup {
            Some(had) => had,
            None => {
                let shim = r.supervisor_alive();
                let _ = control::signal(&r, nix::sys::signal::Signal::SIGKILL);
                shim | !control::kill_orphans(state, &r).is_empty()
            }
        };
        if had {
            tracing::error!(vm = %r.name, "fenced");
            killed += 1;
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_fences_once_when_the_silence_reaches_the_deadline() {
        let d = Duration::from_secs(30);
        assert!(!must_fence(Duration::from_secs(29), d, false));
        assert!(must_fence(Duration::from_secs(30), d, false));
        assert!(must_fence(Duration::from_secs(300), d, false));
        assert!(!must_fence(Duration::from_secs(300), d, true), "once");
    }

    #[test]
    fn a_renewal_lifts_the_fence_and_restarts_the_clock() {
        let f = Fence::default();
        assert_eq!(f.fence_due(Duration::from_secs(3600)), None);
        assert!(f.fence_due(Duration::ZERO).is_some());
        assert!(f.is_fenced());
        assert_eq!(f.fence_due(Duration::ZERO), None, "fenced already");
        let sent = Instant::now();
        assert!(f.renewed(sent), "lifted");
        assert!(!f.is_fenced());
        assert!(!f.renewed(sent), "nothing to lift");
        assert_eq!(f.fence_due(Duration::from_secs(3600)), None);
        // The clock counts from when the renewal was sent, and never goes back.
        let f = Fence::default();
        let before = f.lock().last_ok;
        f.renewed(before - Duration::from_secs(5));
        assert_eq!(f.lock().last_ok, before);
    }

    #[test]
    fn the_lease_names_its_holder_and_deadline() {
        let s = Settings {
            node: "n1".into(),
            namespace: "imp-system".into(),
            fence_after: Duration::from_secs(30),
            renew_every: Duration::from_secs(10),
        };
        let now = MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let b = lease_body(&s, now);
        assert_eq!(b["spec"]["holderIdentity"], "n1");
        assert_eq!(b["spec"]["leaseDurationSeconds"], 30);
        assert_eq!(b["metadata"]["labels"][LABEL_AGENT_LEASE], "true");
        assert_eq!(lease_name("n1"), "imp-agent-n1");
        // The API server takes a MicroTime with exactly six fractional digits.
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let t = lease_body(&s, now)["spec"]["renewTime"].clone();
        let t = t.as_str().unwrap();
        let frac = t.split('.').nth(1).unwrap();
        assert_eq!(frac.len(), "123456Z".len(), "{t}");
    }
}
