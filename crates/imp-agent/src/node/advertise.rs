//! What the agent tells the cluster about its node, for the scheduler and migrations: the
//! runtimes its capability probe found able to run VMs (the Node annotation
//! `imp.dev/runtimes`, written with the agent API's address by `imp agent`), and the CPU model
//! (`spec.cpuModel` of the node's ClusterImpNodeProfile, kept by [`keep_cpu_model`]).
//!
//! Capabilities are probed once per agent start, so the runtimes are published at each start:
//! an agent restarted after its configuration changed (a Firecracker binary installed, a kernel
//! fixed) publishes what it finds then. The agent never creates a ClusterImpNodeProfile (an
//! administrator's capacity settings live there); it fills `cpuModel` into the one named after
//! its node whenever that exists and says otherwise.

use futures::StreamExt as _;
use imp_api::cluster::ClusterImpNodeProfile;
use imp_api::shared::VmRuntime;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt as _, watcher};

use super::capabilities::Capabilities;

/// The runtimes that can run VMs on this node: those the probe found no problem with.
pub fn runtimes(caps: &Capabilities) -> Vec<VmRuntime> {
    VmRuntime::ALL
        .iter()
        .copied()
        .filter(|r| caps.problem(*r).is_none())
        .collect()
}

/// The value of the Node annotation `imp.dev/runtimes` for `caps` (empty: none can run).
pub fn runtimes_annotation(caps: &Capabilities) -> String {
    VmRuntime::list_annotation(&runtimes(caps))
}

/// The CPU model from the text of `/proc/cpuinfo`: the first `model name` line's value
/// (x86; arm64 kernels print none, and then there is no model).
pub fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        let value = value.trim();
        (key.trim() == "model name" && !value.is_empty()).then(|| value.to_owned())
    })
}

/// The merge patch that sets a profile's `cpuModel` to `ours`, when it says something else.
pub fn cpu_model_patch(profile: &ClusterImpNodeProfile, ours: &str) -> Option<serde_json::Value> {
    (profile.spec.cpu_model.as_deref() != Some(ours))
        .then(|| serde_json::json!({"spec": {"cpuModel": ours}}))
}

/// Reads this host's CPU model from `/proc/cpuinfo`; `None` (logged) when it names none.
pub fn host_cpu_model() -> Option<String> {
    match std::fs::read_to_string("/proc/cpuinfo") {
        Ok(text) => {
            let model = cpu_model(&text);
            if model.is_none() {
                tracing::info!(
                    "/proc/cpuinfo names no CPU model; the node profile's cpuModel is left alone"
                );
            }
            model
        }
        Err(e) => {
            tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "reading /proc/cpuinfo for the CPU model");
            None
        }
    }
}

/// Keeps `cpuModel` of the ClusterImpNodeProfile named `node` equal to `model`: watches that
/// one profile (field selector `metadata.name`) and patches it whenever it exists and says
/// something else, as field manager `manager`. Runs until the watch ends; errors are logged
/// and the watch retries with backoff.
pub async fn keep_cpu_model(client: kube::Client, node: String, model: String, manager: &str) {
    let api: Api<ClusterImpNodeProfile> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let mut events = watcher(api.clone(), config).default_backoff().boxed();
    let mut listed = false;
    while let Some(event) = events.next().await {
        let profile = match event {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => p,
            Ok(watcher::Event::Init) => {
                listed = false;
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                if !listed {
                    tracing::info!(
                        node,
                        "no ClusterImpNodeProfile named after this node: its cpuModel is written once one exists"
                    );
                }
                continue;
            }
            Ok(watcher::Event::Delete(_)) => continue,
            Err(e) => {
                tracing::warn!(node, error = %imp_api::chain::DisplayChain(&e), "watching this node's ClusterImpNodeProfile");
                continue;
            }
        };
        listed = true;
        let Some(patch) = cpu_model_patch(&profile, &model) else {
            continue;
        };
        match api
            .patch(&node, &PatchParams::apply(manager), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => tracing::info!(node, cpu_model = model, "wrote the node profile's cpuModel"),
            Err(e) => {
                tracing::warn!(node, error = %imp_api::chain::DisplayChain(&e), "writing the node profile's cpuModel")
            }
        }
    }
}

/// What the agent publishes on its Node's annotations.
#[derive(Debug, Clone)]
pub struct Published {
    /// `host:port` of the agent API.
    pub endpoint: String,
    /// SHA-256 of its certificate.
    pub fingerprint: String,
    /// The node's VXLAN address.
    pub vtep: Option<String>,
    /// The runtimes that can run VMs here (`imp.dev/runtimes`).
    pub runtimes: String,
}

/// Writes where the agent API is and its certificate's fingerprint on this node's Node object,
/// where `imp exec` and `imp console` read them, the node's VXLAN address, which the
/// operator copies into the VTEP tables, and the runtimes the node can run, which the
/// scheduler matches with classes' `runtime`; as field manager `manager`.
pub async fn publish(
    client: &kube::Client,
    node: &str,
    published: &Published,
    manager: &str,
) -> Result<(), kube::Error> {
    use imp_api::shared::{
        ANNOTATION_AGENT_CERT_SHA256, ANNOTATION_AGENT_ENDPOINT, ANNOTATION_RUNTIMES,
        ANNOTATION_VTEP_ADDRESS,
    };
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let patch = serde_json::json!({"metadata": {"annotations": {
        ANNOTATION_AGENT_ENDPOINT: published.endpoint,
        ANNOTATION_AGENT_CERT_SHA256: published.fingerprint,
        ANNOTATION_VTEP_ADDRESS: published.vtep,
        ANNOTATION_RUNTIMES: published.runtimes,
    }}});
    nodes
        .patch(node, &PatchParams::apply(manager), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Publishes `published` on Node `node`, retrying every 10 s until it works: a Node that is
/// not there yet (or a missing RBAC rule) must not keep the agent from running its VMs.
pub async fn keep_publishing(
    client: kube::Client,
    node: String,
    published: Published,
    manager: &'static str,
) {
    while let Err(e) = publish(&client, &node, &published, manager).await {
        tracing::warn!(node, error = %imp_api::chain::chain(&e), "cannot publish the agent API's address on the Node yet; retrying in 10 s");
        tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    }
    tracing::info!(
        node,
        endpoint = published.endpoint,
        runtimes = published.runtimes,
        "published the agent API's address and the node's runtimes on the Node"
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn caps(qemu: bool, firecracker: bool, files: bool) -> Capabilities {
        let why = |ok: bool, p: &str| {
            if ok {
                Ok(p.into())
            } else {
                Err(format!("{p} missing"))
            }
        };
        Capabilities {
            files: (!files).then(|| "guest kernel /k not found: set --kernel".to_owned()),
            qemu: why(qemu, "/usr/bin/qemu-system-x86_64"),
            firecracker: why(firecracker, "/usr/local/bin/firecracker"),
            default_runtime: VmRuntime::Qemu,
        }
    }

    #[test]
    fn the_node_advertises_the_runtimes_its_probe_found_usable() {
        assert_eq!(runtimes_annotation(&caps(true, false, true)), "qemu");
        assert_eq!(
            runtimes_annotation(&caps(true, true, true)),
            "firecracker,qemu"
        );
        assert_eq!(runtimes_annotation(&caps(false, true, true)), "firecracker");
        // Without a kernel or guest init no runtime can run anything.
        assert_eq!(runtimes_annotation(&caps(true, true, false)), "");
        assert_eq!(
            VmRuntime::parse_list(&runtimes_annotation(&caps(true, true, true))),
            vec![VmRuntime::Firecracker, VmRuntime::Qemu]
        );
    }

    #[test]
    fn cpu_model_is_the_first_model_name_line() {
        let x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 85\n\
                   model name\t: Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz\nstepping\t: 7\n\n\
                   processor\t: 1\nmodel name\t: Other\n";
        assert_eq!(
            cpu_model(x86).as_deref(),
            Some("Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz")
        );
        let arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n";
        assert_eq!(cpu_model(arm), None);
        assert_eq!(cpu_model("model name\t:   \n"), None);
        assert_eq!(cpu_model(""), None);
    }

    #[test]
    fn the_profile_is_patched_only_when_its_cpu_model_differs() {
        let mut p = ClusterImpNodeProfile::new("n1", Default::default());
        assert_eq!(
            cpu_model_patch(&p, "EPYC"),
            Some(serde_json::json!({"spec": {"cpuModel": "EPYC"}}))
        );
        p.spec.cpu_model = Some("Xeon".into());
        assert!(cpu_model_patch(&p, "EPYC").is_some());
        p.spec.cpu_model = Some("EPYC".into());
        assert_eq!(cpu_model_patch(&p, "EPYC"), None);
    }
}
