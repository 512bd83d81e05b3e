//! The guests' latest CPU, memory and disk figures of a namespace's VMs, as JSON, for `imp top`.
//!
//! A node's agent answers `GET /v1/namespaces/{ns}/guest-metrics` with the VMs of that
//! namespace on its node ([`GuestReadingList`]), from what its poller last read: a request never
//! reaches a guest. The operator's gateway asks every node that runs one of the namespace's VMs
//! and answers the user with the lists merged, naming the nodes that did not answer
//! ([`GuestReadingList::failures`]). Who may read them is the API server's business: the gateway
//! is reached as `list guestmetrics` of `subresources.imp.dev` in the namespace.

use imp_proto::MetricsReport;
use serde::{Deserialize, Serialize};

/// The figures a guest last reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestReading {
    /// The ImpVM's name.
    pub name: String,
    /// The ImpVM's uid (a VM recreated under the same name has another).
    pub uid: String,
    /// When the guest answered, seconds since the Unix epoch.
    pub sampled_unix: u64,
    /// What it answered.
    pub report: MetricsReport,
    /// Bytes its network interface received and sent since its TAP was made, read from the
    /// node's counters of the TAP; `None` for a VM on no ImpNetwork (and from agents that
    /// did not report it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkBytes>,
}

/// A VM's network traffic as its guest sees it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkBytes {
    /// Received by the guest (what the node sent into its TAP).
    pub receive: u64,
    /// Sent by the guest (what the node read from its TAP).
    pub transmit: u64,
}

/// The answer of the route: the namespace's VMs on this node that have figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestReadingList {
    /// The namespace asked for.
    pub namespace: String,
    /// One per VM with figures, by name.
    pub items: Vec<GuestReading>,
    /// The nodes that were asked and did not answer (only in the gateway's merged answer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<NodeFailure>,
}

/// A node whose agent gave no figures, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeFailure {
    /// The node.
    pub node: String,
    /// Why (the error, with its causes).
    pub message: String,
}

/// The route's path for `namespace`.
pub fn path(namespace: &str) -> String {
    format!("/v1/namespaces/{namespace}/{ENDPOINT}")
}

/// The last path segment of the route.
pub const ENDPOINT: &str = "guest-metrics";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_answer_round_trips_as_json() {
        let list = GuestReadingList {
            namespace: "team".into(),
            items: vec![GuestReading {
                name: "web".into(),
                uid: "u1".into(),
                sampled_unix: 7,
                report: MetricsReport {
                    memory_used_bytes: 5,
                    ..MetricsReport::default()
                },
                network: Some(NetworkBytes {
                    receive: 9,
                    transmit: 3,
                }),
            }],
            failures: vec![],
        };
        let text = serde_json::to_string(&list).unwrap();
        assert!(text.contains("\"sampledUnix\":7"), "{text}");
        assert!(
            text.contains("\"network\":{\"receive\":9,\"transmit\":3}"),
            "{text}"
        );
        // An older agent's answer, without the network, still reads.
        let old = text.replace(",\"network\":{\"receive\":9,\"transmit\":3}", "");
        let back: GuestReadingList = serde_json::from_str(&old).unwrap();
        assert_eq!(back.items[0].network, None);
        assert!(text.contains("\"memory_used_bytes\":5"), "{text}");
        assert_eq!(
            serde_json::from_str::<GuestReadingList>(&text).unwrap(),
            list
        );
        assert_eq!(path("team"), "/v1/namespaces/team/guest-metrics");
    }
}
