//! A thin typed client for Firecracker's HTTP API on its Unix socket.
//!
//! The body types follow the definitions of Firecracker's published OpenAPI spec
//! (`firecracker.yaml`) field for field, and only carry the fields imp sets. Every call goes
//! through a [`Request`] value (method, path, spec definition, JSON body) so the exact bodies the
//! driver sends can be checked against the spec in tests. One HTTP/1 connection per request:
//! Firecracker's API server is local and cheap to reach, and a fresh connection never inherits a
//! half-read response.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

/// Why a Firecracker API call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API socket could not be reached.
    #[error("Failed to connect to Firecracker API socket {socket}")]
    Connect {
        /// The API socket.
        socket: PathBuf,
        /// What the connect saw.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange broke down.
    #[error("HTTP exchange with Firecracker failed on {method} {path}")]
    Http {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// What hyper saw.
        #[source]
        source: hyper::Error,
    },
    /// Firecracker answered with an error status; `fault_message` is its explanation.
    #[error("Firecracker rejected {method} {path} ({status}): {fault_message}")]
    Rejected {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// The HTTP status.
        status: u16,
        /// Firecracker's `fault_message` (or the raw body if it had none).
        fault_message: String,
    },
    /// Firecracker did not answer in time.
    #[error("Firecracker did not answer {method} {path} within {timeout:?}")]
    Timeout {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// How long we waited.
        timeout: Duration,
    },
    /// A body could not be turned into JSON.
    #[error("Failed to encode the {definition} body")]
    Encode {
        /// The spec definition of the body.
        definition: &'static str,
        /// What serde saw.
        #[source]
        source: serde_json::Error,
    },
    /// A response body was not what the spec promises.
    #[error("Failed to decode Firecracker's answer to {method} {path}")]
    Decode {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// What serde saw.
        #[source]
        source: serde_json::Error,
    },
    /// The HTTP request could not be assembled (a path that is not a valid URI).
    #[error("Failed to build the HTTP request {method} {path}")]
    Build {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// What the http crate saw.
        #[source]
        source: hyper::http::Error,
    },
}

/// Result of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The HTTP methods Firecracker's API uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Read state.
    Get,
    /// Create or replace a resource.
    Put,
    /// Change part of a resource.
    Patch,
}

impl Method {
    /// The name as the OpenAPI spec writes it (lower case), for looking paths up in the spec.
    pub fn spec_name(self) -> &'static str {
        match self {
            Method::Get => "get",
            Method::Put => "put",
            Method::Patch => "patch",
        }
    }

    fn to_hyper(self) -> hyper::Method {
        match self {
            Method::Get => hyper::Method::GET,
            Method::Put => hyper::Method::PUT,
            Method::Patch => hyper::Method::PATCH,
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Method::Get => "GET",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
        })
    }
}

/// One API call: what the driver sends, kept as data so tests can check it against the spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// HTTP method.
    pub method: Method,
    /// Concrete path, e.g. `/drives/rootfs`.
    pub path: String,
    /// The spec's path template, e.g. `/drives/{drive_id}`.
    pub template: &'static str,
    /// The spec definition the body follows, if the request has a body.
    pub definition: Option<&'static str>,
    /// The JSON body.
    pub body: Option<serde_json::Value>,
}

impl Request {
    fn with_body<T: Serialize>(
        method: Method,
        path: String,
        template: &'static str,
        definition: &'static str,
        body: &T,
    ) -> Result<Self> {
        let body =
            serde_json::to_value(body).map_err(|source| Error::Encode { definition, source })?;
        Ok(Request {
            method,
            path,
            template,
            definition: Some(definition),
            body: Some(body),
        })
    }

    /// `PUT /logger`: where Firecracker writes its own log.
    pub fn put_logger(body: &Logger) -> Result<Self> {
        Self::with_body(Method::Put, "/logger".into(), "/logger", "Logger", body)
    }

    /// `PUT /boot-source`: the kernel, initrd and command line.
    pub fn put_boot_source(body: &BootSource) -> Result<Self> {
        Self::with_body(
            Method::Put,
            "/boot-source".into(),
            "/boot-source",
            "BootSource",
            body,
        )
    }

    /// `PUT /machine-config`: vCPUs and memory.
    pub fn put_machine_config(body: &MachineConfiguration) -> Result<Self> {
        Self::with_body(
            Method::Put,
            "/machine-config".into(),
            "/machine-config",
            "MachineConfiguration",
            body,
        )
    }

    /// `PUT /drives/{drive_id}`: one block device.
    pub fn put_drive(body: &Drive) -> Result<Self> {
        Self::with_body(
            Method::Put,
            format!("/drives/{}", body.drive_id),
            "/drives/{drive_id}",
            "Drive",
            body,
        )
    }

    /// `PUT /network-interfaces/{iface_id}`: one TAP-backed NIC.
    pub fn put_network_interface(body: &NetworkInterface) -> Result<Self> {
        Self::with_body(
            Method::Put,
            format!("/network-interfaces/{}", body.iface_id),
            "/network-interfaces/{iface_id}",
            "NetworkInterface",
            body,
        )
    }

    /// `PUT /vsock`: the hybrid vsock device.
    pub fn put_vsock(body: &Vsock) -> Result<Self> {
        Self::with_body(Method::Put, "/vsock".into(), "/vsock", "Vsock", body)
    }

    /// `PUT /actions`: start the instance, flush metrics or send Ctrl+Alt+Del.
    pub fn put_action(action_type: ActionType) -> Result<Self> {
        Self::with_body(
            Method::Put,
            "/actions".into(),
            "/actions",
            "InstanceActionInfo",
            &InstanceActionInfo { action_type },
        )
    }

    /// `PATCH /vm`: pause or resume the vCPUs.
    pub fn patch_vm(state: VmStateRequest) -> Result<Self> {
        Self::with_body(Method::Patch, "/vm".into(), "/vm", "Vm", &Vm { state })
    }

    /// `PUT /snapshot/create`: write a snapshot of a paused VM.
    pub fn put_snapshot_create(body: &SnapshotCreateParams) -> Result<Self> {
        Self::with_body(
            Method::Put,
            "/snapshot/create".into(),
            "/snapshot/create",
            "SnapshotCreateParams",
            body,
        )
    }

    /// `PUT /snapshot/load`: load a snapshot into a fresh Firecracker process.
    pub fn put_snapshot_load(body: &SnapshotLoadParams) -> Result<Self> {
        Self::with_body(
            Method::Put,
            "/snapshot/load".into(),
            "/snapshot/load",
            "SnapshotLoadParams",
            body,
        )
    }

    /// `GET /`: the instance's id, state and Firecracker version.
    pub fn get_instance_info() -> Self {
        Request {
            method: Method::Get,
            path: "/".into(),
            template: "/",
            definition: None,
            body: None,
        }
    }
}

/// `Logger`: Firecracker's own (not the guest's) log.
#[derive(Debug, Clone, Serialize)]
pub struct Logger {
    /// File (must exist) or named pipe for the log.
    pub log_path: String,
    /// `Error`, `Warning`, `Info`, `Debug`, `Trace` or `Off`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub level: Option<String>,
    /// Whether each line carries its level.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show_level: Option<bool>,
    /// Whether each line carries its source file and line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show_log_origin: Option<bool>,
}

/// `BootSource`: what to boot.
#[derive(Debug, Clone, Serialize)]
pub struct BootSource {
    /// Kernel image path as Firecracker sees it.
    pub kernel_image_path: String,
    /// Kernel command line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
    /// Initrd path as Firecracker sees it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
}

/// `MachineConfiguration`: the VM's size.
#[derive(Debug, Clone, Serialize)]
pub struct MachineConfiguration {
    /// Number of vCPUs.
    pub vcpu_count: u8,
    /// Memory in MiB.
    pub mem_size_mib: u32,
}

/// `Drive`: one block device.
#[derive(Debug, Clone, Serialize)]
pub struct Drive {
    /// Drive name.
    pub drive_id: String,
    /// Backing file as Firecracker sees it.
    pub path_on_host: String,
    /// Whether it is the root device.
    pub is_root_device: bool,
    /// Whether the guest may only read it.
    pub is_read_only: bool,
}

/// `NetworkInterface`: one virtio-net device on a TAP.
#[derive(Debug, Clone, Serialize)]
pub struct NetworkInterface {
    /// Interface name.
    pub iface_id: String,
    /// TAP device name in Firecracker's network namespace.
    pub host_dev_name: String,
    /// Guest MAC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
}

/// `Vsock`: the hybrid vsock device.
#[derive(Debug, Clone, Serialize)]
pub struct Vsock {
    /// Guest context id.
    pub guest_cid: u32,
    /// Host Unix socket path as Firecracker sees it.
    pub uds_path: String,
}

/// `InstanceActionInfo.action_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ActionType {
    /// Boot the configured VM.
    InstanceStart,
    /// Ask the guest to reboot (Firecracker exits when the guest resets).
    SendCtrlAltDel,
    /// Write metrics now.
    FlushMetrics,
}

/// `InstanceActionInfo`.
#[derive(Debug, Clone, Serialize)]
struct InstanceActionInfo {
    action_type: ActionType,
}

/// `Vm.state`: the states `PATCH /vm` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum VmStateRequest {
    /// Stop the vCPUs.
    Paused,
    /// Run the vCPUs.
    Resumed,
}

/// `Vm`.
#[derive(Debug, Clone, Serialize)]
struct Vm {
    state: VmStateRequest,
}

/// `SnapshotCreateParams.snapshot_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SnapshotType {
    /// All of guest memory.
    Full,
    /// Only pages dirtied since the last snapshot.
    Diff,
}

/// `SnapshotCreateParams`.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotCreateParams {
    /// Full or diff.
    pub snapshot_type: SnapshotType,
    /// Device state file as Firecracker sees it.
    pub snapshot_path: String,
    /// Memory file as Firecracker sees it.
    pub mem_file_path: String,
}

/// `MemoryBackend.backend_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MemoryBackendType {
    /// Map the memory file.
    File,
    /// Serve page faults from a userfaultfd handler.
    Uffd,
}

/// `MemoryBackend`: where restored guest memory comes from.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryBackend {
    /// File or Uffd.
    pub backend_type: MemoryBackendType,
    /// Memory file (File) or handler socket (Uffd) as Firecracker sees it.
    pub backend_path: String,
}

/// `SnapshotLoadParams`.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotLoadParams {
    /// Device state file as Firecracker sees it.
    pub snapshot_path: String,
    /// Where guest memory comes from.
    pub mem_backend: MemoryBackend,
    /// Whether to resume the vCPUs right after loading.
    pub resume_vm: bool,
    /// TAPs other than the ones the snapshot was taken with (a new VM restored from another
    /// VM's snapshot).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub network_overrides: Vec<NetworkOverride>,
}

/// `NetworkOverride`: the host TAP an interface of a loaded snapshot uses instead.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NetworkOverride {
    /// The interface's id.
    pub iface_id: String,
    /// Its new TAP.
    pub host_dev_name: String,
}

/// `InstanceInfo`: the answer to `GET /`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct InstanceInfo {
    /// Instance id (the jailer id, or `anonymous-instance`).
    pub id: String,
    /// `Not started`, `Running` or `Paused`.
    pub state: String,
    /// Firecracker's version.
    pub vmm_version: String,
    /// `Firecracker`.
    pub app_name: String,
}

/// `Error`: the body of every failed call.
#[derive(Debug, Deserialize)]
struct ApiError {
    fault_message: Option<String>,
}

/// A client bound to one Firecracker API socket.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
    timeout: Duration,
}

impl Client {
    /// A client for the API socket at `socket` whose calls each give up after `timeout`.
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> Self {
        Client {
            socket: socket.into(),
            timeout,
        }
    }

    /// The API socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends `req` and returns the response body (empty for 204).
    pub async fn send(&self, req: &Request) -> Result<Bytes> {
        let timeout_err = || Error::Timeout {
            method: req.method,
            path: req.path.clone(),
            timeout: self.timeout,
        };
        let started = std::time::Instant::now();
        let out = tokio::time::timeout(self.timeout, self.exchange(req))
            .await
            .map_err(|_| timeout_err())?;
        tracing::debug!(
            method = %req.method,
            path = %req.path,
            elapsed_ms = started.elapsed().as_millis() as u64,
            ok = out.is_ok(),
            "firecracker api call"
        );
        out
    }

    /// Sends `GET /` and decodes the answer.
    pub async fn instance_info(&self) -> Result<InstanceInfo> {
        let req = Request::get_instance_info();
        let body = self.send(&req).await?;
        serde_json::from_slice(&body).map_err(|source| Error::Decode {
            method: req.method,
            path: req.path,
            source,
        })
    }

    async fn exchange(&self, req: &Request) -> Result<Bytes> {
        let http_err = |source| Error::Http {
            method: req.method,
            path: req.path.clone(),
            source,
        };
        // Firecracker's socket is in a directory it may write (its jail): never follow what
        // it put there in place of its socket.
        let stream = crate::uds::connect(&self.socket)
            .await
            .map_err(|source| Error::Connect {
                socket: self.socket.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(http_err)?;
        let conn = tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::trace!(%error, "firecracker api connection ended");
            }
        });
        let body = match &req.body {
            Some(v) => Bytes::from(v.to_string()),
            None => Bytes::new(),
        };
        let mut builder = hyper::Request::builder()
            .method(req.method.to_hyper())
            .uri(req.path.as_str())
            .header(header::HOST, "localhost")
            .header(header::ACCEPT, "application/json");
        if req.body.is_some() {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(body))
            .map_err(|source| Error::Build {
                method: req.method,
                path: req.path.clone(),
                source,
            })?;
        let response = sender.send_request(request).await.map_err(http_err)?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(http_err)?
            .to_bytes();
        drop(sender);
        conn.abort();
        if status.is_success() {
            return Ok(bytes);
        }
        let fault_message = serde_json::from_slice::<ApiError>(&bytes)
            .ok()
            .and_then(|e| e.fault_message)
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        Err(Error::Rejected {
            method: req.method,
            path: req.path.clone(),
            status: status.as_u16(),
            fault_message,
        })
    }
}
