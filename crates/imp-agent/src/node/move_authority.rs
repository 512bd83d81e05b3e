//! Who may send this node a moving VM's files ([`crate::api::moves::MoveAuthority`]): the agent
//! of the VM's source node, holding the certificate that node publishes (its SHA-256 copied by
//! the operator into the move, which no agent may change), with the token of the move the
//! operator wrote into the VM's status naming this node as the target.

use std::sync::Arc;

use imp_api::vm::{ImpVM, MovePhase};
use kube::Resource as _;
use kube::api::{Api, ListParams};

use crate::api::moves::{Admission, IncomingMove, MoveAuthority, MoveRefusal};

/// The authority of node `node`, reading VMs and Nodes with `client`.
pub struct FromApi {
    client: kube::Client,
    node: String,
}

impl FromApi {
    /// The authority of this node.
    pub fn new(client: kube::Client, node: String) -> Arc<Self> {
        Arc::new(Self { client, node })
    }
}

impl MoveAuthority for FromApi {
    fn admit<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        token: &'a str,
        peer_cert_sha256: &'a [u8; 32],
    ) -> Admission<'a> {
        Box::pin(async move {
            // A list by name: the agent's role lists VMs (its watch) and gets none.
            let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), namespace);
            let by_name = ListParams::default().fields(&format!("metadata.name={name}"));
            let vm = vms
                .list(&by_name)
                .await
                .map_err(|e| MoveRefusal::Unavailable(imp_api::chain::chain(&e)))?
                .items
                .into_iter()
                .next()
                .ok_or_else(|| MoveRefusal::UnknownVm(format!("{namespace}/{name}")))?;
            let source = moving_here(&vm, &self.node, token)?;
            let published = vm
                .status
                .as_ref()
                .and_then(|s| s.moving.as_ref())
                .and_then(|m| m.source_cert_sha256.clone());
            source_certificate(&source, published.as_deref(), peer_cert_sha256)?;
            Ok(IncomingMove {
                uid: vm.meta().uid.clone().unwrap_or_default(),
                source_node: source,
            })
        })
    }
}

/// The source node of the move of `vm` to `node` with `token`, if that is the move the VM's
/// status holds and it is still sending (`Transferring`); else why not.
pub fn moving_here(vm: &ImpVM, node: &str, token: &str) -> Result<String, MoveRefusal> {
    let Some(mv) = vm.status.as_ref().and_then(|s| s.moving.as_ref()) else {
        return Err(MoveRefusal::Forbidden("the VM is not moving".into()));
    };
    if mv.target != node {
        return Err(MoveRefusal::Forbidden(format!(
            "the VM moves to {}, not to {node}",
            mv.target
        )));
    }
    if mv.phase != MovePhase::Transferring {
        return Err(MoveRefusal::Forbidden(format!(
            "the move is {:?}, not sending",
            mv.phase
        )));
    }
    if vm.spec.node_name.as_deref() != Some(mv.source.as_str()) {
        return Err(MoveRefusal::Forbidden(
            "the VM is no longer on the move's source".into(),
        ));
    }
    if !same(mv.token.as_bytes(), token.as_bytes()) {
        return Err(MoveRefusal::Forbidden("the token is not the move's".into()));
    }
    Ok(mv.source.clone())
}

/// Whether `peer` is the certificate node `source` publishes (`published`, hex, as the move
/// holds it).
pub fn source_certificate(
    source: &str,
    published: Option<&str>,
    peer: &[u8; 32],
) -> Result<(), MoveRefusal> {
    let Some(p) = published else {
        return Err(MoveRefusal::Forbidden(format!(
            "node {source} publishes no agent certificate"
        )));
    };
    match imp_agent_api::tls::parse_fingerprint(p) {
        Ok(want) if same(&want, peer) => Ok(()),
        _ => Err(MoveRefusal::Forbidden(format!(
            "the caller's certificate is not the one node {source} publishes"
        ))),
    }
}

/// Compares in time independent of where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::vm::{ImpVMSpec, ImpVMStatus, VmMove};

    fn vm(phase: MovePhase, on: &str) -> ImpVM {
        let mut v = ImpVM::new(
            "web",
            ImpVMSpec {
                node_name: Some(on.into()),
                ..Default::default()
            },
        );
        v.status = Some(ImpVMStatus {
            moving: Some(VmMove {
                source: "a".into(),
                target: "b".into(),
                phase,
                token: "t1".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        v
    }

    #[test]
    fn only_the_sending_move_to_this_node_with_its_token_is_admitted() {
        assert_eq!(
            moving_here(&vm(MovePhase::Transferring, "a"), "b", "t1").unwrap(),
            "a"
        );
        let refused =
            |v: ImpVM, node: &str, token: &str, want: &str| match moving_here(&v, node, token) {
                Err(MoveRefusal::Forbidden(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{want}: {other:?}"),
            };
        refused(
            vm(MovePhase::Transferring, "a"),
            "c",
            "t1",
            "moves to b, not to c",
        );
        refused(vm(MovePhase::Transferring, "a"), "b", "t2", "token");
        refused(vm(MovePhase::Transferring, "a"), "b", "", "token");
        refused(vm(MovePhase::Sent, "a"), "b", "t1", "not sending");
        refused(vm(MovePhase::Transferring, "b"), "b", "t1", "no longer on");
        let mut still = vm(MovePhase::Transferring, "a");
        still.status.as_mut().unwrap().moving = None;
        refused(still, "b", "t1", "not moving");
    }

    #[test]
    fn the_caller_must_hold_the_certificate_its_node_publishes() {
        let peer = [7u8; 32];
        let hex: String = peer.iter().map(|b| format!("{b:02x}")).collect();
        assert!(source_certificate("a", Some(&hex), &peer).is_ok());
        assert!(source_certificate("a", Some(&hex), &[8u8; 32]).is_err());
        assert!(source_certificate("a", None, &peer).is_err());
        assert!(source_certificate("a", Some("not hex"), &peer).is_err());
    }
}
