//! The Secrets and ConfigMaps a VM or snapshot of this node refers to, asked of the operator's
//! gateway ([`imp_api::inputs`]): the agent may read no Secret or ConfigMap itself. It calls
//! the gateway through the API server with its own token; the gateway answers only for
//! objects on this node, with only what they name.

use imp_api::inputs::{self, Inputs, References};
use imp_api::snapshot::ImpVMSnapshot;
use imp_api::vm::ImpVM;
use kube::ResourceExt as _;

/// Why the inputs could not be had.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The gateway answered with a refusal (its message says why: not this node's VM, not
    /// booked yet).
    #[error("the operator's gateway refused {path} ({code}): {message}")]
    Refused {
        /// The path asked.
        path: String,
        /// The HTTP status.
        code: u16,
        /// Its message.
        message: String,
    },
    /// The gateway or the API server could not be reached or answered no Status.
    #[error("asking the operator's gateway for {path}: {source}")]
    Unreachable {
        /// The path asked.
        path: String,
        /// What failed.
        #[source]
        source: kube::Error,
    },
}

/// The inputs of VM `vm` as it runs with `refs` (none are asked for when it names nothing).
pub async fn of_vm(
    client: &kube::Client,
    vm: &ImpVM,
    refs: &References,
) -> Result<Inputs, FetchError> {
    if refs.is_empty() {
        return Ok(Inputs::default());
    }
    let path = inputs::vm_path(&vm.namespace().unwrap_or_default(), &vm.name_any());
    fetch(client, path).await
}

/// The inputs of snapshot execution `exec` (none are asked for when it names nothing).
pub async fn of_snapshot(
    client: &kube::Client,
    exec: &ImpVMSnapshot,
) -> Result<Inputs, FetchError> {
    if inputs::of_snapshot(exec).is_empty() {
        return Ok(Inputs::default());
    }
    let path = inputs::snapshot_path(&exec.namespace().unwrap_or_default(), &exec.name_any());
    fetch(client, path).await
}

async fn fetch(client: &kube::Client, path: String) -> Result<Inputs, FetchError> {
    let req = match http::Request::get(&path).body(Vec::new()) {
        Ok(r) => r,
        Err(e) => {
            return Err(FetchError::Unreachable {
                path,
                source: kube::Error::HttpError(e),
            });
        }
    };
    match client.request::<Inputs>(req).await {
        Ok(i) => Ok(i),
        Err(kube::Error::Api(s)) => Err(FetchError::Refused {
            path,
            code: s.code,
            message: s.message,
        }),
        Err(source) => Err(FetchError::Unreachable { path, source }),
    }
}
