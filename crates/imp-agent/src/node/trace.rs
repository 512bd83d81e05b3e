//! The agent's spans of a VM's trace ([`imp_telemetry::trace`]): the VM's root span when it first
//! runs (`reconciler::status`), and `start`, one boot of one attempt until the guest agent
//! answered, under the root, with the boot's steps under it (`image`, `disk`, `boot`, `guest ready`, from the record's
//! timings). Exported when ClusterImpConfig `observability.tracing` is enabled with an
//! endpoint; the agent reads it (one GET) only when it has spans to send.

use std::time::{Duration, SystemTime};

use imp_api::cluster::{CLUSTER_CONFIG_NAME, ClusterImpConfig};
use imp_telemetry::trace::{Endpoint, Span, span_id, spawn_export, trace_id};
use kube::Api;

use crate::runtime::state::{Owner, Timings};

/// The `service.name` of the agent's spans.
pub const SERVICE: &str = "imp-agent";

/// The spans of VM `owner`'s boot on `node` that ended (the guest agent answered) at `end`,
/// its steps laid back from there by their durations.
pub fn start_spans(owner: &Owner, node: &str, timings: &Timings, end: SystemTime) -> Vec<Span> {
    let trace = trace_id(&owner.uid);
    let role = format!("start/{}/{}", owner.attempt, owner.revision);
    let start_id = span_id(&owner.uid, &role);
    let attributes = vec![
        ("k8s.namespace.name", owner.namespace.clone()),
        ("imp.vm", owner.name.clone()),
        ("k8s.node.name", node.to_owned()),
        ("imp.attempt", owner.attempt.to_string()),
        ("imp.revision", owner.revision.to_string()),
    ];
    let steps = [
        ("image", timings.image_ms),
        ("disk", timings.disk_ms),
        ("boot", timings.boot_ms),
        ("guest ready", timings.ready_ms),
    ];
    let total: u64 = steps.iter().map(|(_, ms)| ms).sum();
    let begin = end.checked_sub(Duration::from_millis(total)).unwrap_or(end);
    let mut spans = vec![Span {
        trace,
        id: start_id,
        parent: Some(span_id(&owner.uid, "vm")),
        name: "start".to_owned(),
        start: begin,
        end,
        attributes: attributes.clone(),
    }];
    let mut at = begin;
    for (name, ms) in steps {
        let until = at + Duration::from_millis(ms);
        spans.push(Span {
            trace,
            id: span_id(&owner.uid, &format!("{role}/{name}")),
            parent: Some(start_id),
            name: name.to_owned(),
            start: at,
            end: until,
            attributes: attributes.clone(),
        });
        at = until;
    }
    spans
}

/// Where spans go, from ClusterImpConfig `cluster` (`None`: tracing off, no config, or it
/// cannot be read, which is logged).
async fn endpoint(client: kube::Client) -> Option<Endpoint> {
    let config = Api::<ClusterImpConfig>::all(client)
        .get_opt(CLUSTER_CONFIG_NAME)
        .await
        .inspect_err(|e| tracing::warn!(error = %imp_api::chain::DisplayChain(e), "reading ClusterImpConfig for tracing"))
        .ok()??;
    let tracing = config.spec.observability?.tracing?;
    if !tracing.enabled {
        return None;
    }
    Endpoint::parse(&tracing.endpoint)
        .inspect_err(|e| tracing::warn!(error = %e, "ClusterImpConfig tracing endpoint"))
        .ok()
}

/// Exports `spans` in the background when tracing is on.
pub fn export(client: kube::Client, spans: Vec<Span>) {
    tokio::spawn(async move {
        if let Some(endpoint) = endpoint(client).await {
            spawn_export(endpoint, SERVICE, spans);
        }
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_boot_steps_lie_end_to_end_under_start_which_hangs_under_the_vm() {
        let owner = Owner {
            namespace: "ns".into(),
            name: "web".into(),
            uid: "06e03d12-0e36-47e2-b9a1-bbdf6e5f8898".into(),
            attempt: 1,
            revision: 2,
        };
        let timings = Timings {
            image_ms: 100,
            disk_ms: 200,
            boot_ms: 300,
            ready_ms: 400,
            ..Timings::default()
        };
        let end = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let spans = start_spans(&owner, "n1", &timings, end);
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["start", "image", "disk", "boot", "guest ready"]);
        let start = &spans[0];
        assert_eq!(start.parent, Some(span_id(&owner.uid, "vm")));
        assert_eq!(
            start.end.duration_since(start.start).unwrap(),
            Duration::from_secs(1)
        );
        assert!(spans[1..].iter().all(|s| s.parent == Some(start.id)));
        assert_eq!(spans[1].start, start.start);
        assert_eq!(spans[4].end, end);
        assert_eq!(spans[2].start, spans[1].end);
        // Another attempt is another span.
        let again = Owner {
            attempt: 2,
            ..owner
        };
        assert_ne!(start_spans(&again, "n1", &timings, end)[0].id, start.id);
    }
}
