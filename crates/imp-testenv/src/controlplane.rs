//! A real Kubernetes control plane for tests: etcd, kube-apiserver and kube-controller-manager
//! (and kube-scheduler when a test asks, [`Options::scheduler`]), built from pinned Go modules
//! by `scripts/kube/build`, started on free loopback ports (or on an address inside a test's
//! network namespaces) with the production semantics imp depends on: TLS with a CA of its own,
//! client-certificate users (an admin in `system:masters`), RBAC, ServiceAccount tokens from the
//! TokenRequest API, CRD schema and CEL checks, admission webhooks called by the server itself,
//! ResourceQuota admission, watch caches, and the namespace, garbage-collector, ServiceAccount
//! and ResourceQuota controllers.
//!
//! One control plane per test binary is the usual shape ([`ControlPlane::shared`]), with a
//! namespace per test; a test that needs the server on its own address (namespaces as nodes)
//! or a release other than the newest starts its own ([`ControlPlane::start`]).

use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams};

use crate::kubeconfig::{self, Credential};
use crate::pki::{self, Pki};
use crate::process::{self, Proc};

/// The pins `scripts/kube/build` builds from.
const PINS: &str = include_str!("../../../scripts/kube/pins");

/// How long a component may take to answer before the start fails (a cold start on a loaded
/// 2-core machine takes seconds; this bounds a hang).
const READY_WITHIN: Duration = Duration::from_secs(120);

/// Why a control plane could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A binary is not built.
    #[error("{path} is missing: build the test control plane with scripts/kube/build")]
    Missing {
        /// Where it should be.
        path: PathBuf,
    },
    /// The options cannot work together.
    #[error("control plane options: {0}")]
    Options(&'static str),
    /// A pin is missing from scripts/kube/pins.
    #[error("scripts/kube/pins has no {0}")]
    Pin(&'static str),
    /// A file could not be written or read.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// To what.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key could not be made.
    #[error("making the control plane's certificates")]
    Pki(#[from] rcgen::Error),
    /// A component ended before it was ready.
    #[error("{what} exited ({status}) before it was ready; the end of its log:\n{log}")]
    Exited {
        /// The component.
        what: &'static str,
        /// How it ended.
        status: std::process::ExitStatus,
        /// Its last log lines.
        log: String,
    },
    /// A component did not become ready in time.
    #[error("{what} not ready after {secs} s; the end of its log:\n{log}")]
    NotReady {
        /// The component.
        what: &'static str,
        /// How long we waited.
        secs: u64,
        /// Its last log lines.
        log: String,
    },
    /// A kubeconfig could not be loaded into a client.
    #[error("loading kubeconfig {0}")]
    Kubeconfig(PathBuf, #[source] kube::config::KubeconfigError),
    /// The route and tripwire that keep Service traffic on this machine could not be set up.
    #[error("keeping test traffic to the Service range on this machine: {0}")]
    Egress(String),
    /// A request to the API server failed.
    #[error("{what}")]
    Kube {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

/// Which Kubernetes release to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Release {
    /// The newest release imp is tested on (`KUBERNETES` in the pins): every suite.
    #[default]
    Newest,
    /// The oldest release imp supports (`KUBERNETES_OLDEST`): the CRD test. Only
    /// kube-apiserver is built for it (no controller-manager, no kubectl).
    Oldest,
}

impl Release {
    /// Its version, e.g. `v1.37.2`.
    pub fn version(self) -> Result<&'static str, Error> {
        match self {
            Release::Newest => pin("KUBERNETES"),
            Release::Oldest => pin("KUBERNETES_OLDEST"),
        }
    }
}

/// How to start a control plane; the default suits most tests.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where kube-apiserver listens: 127.0.0.1, or an address on a test's own veth when
    /// processes in network namespaces must reach it.
    pub host: IpAddr,
    /// The release.
    pub release: Release,
    /// Whether to run kube-controller-manager (namespace deletion, garbage collection, default
    /// ServiceAccounts, ResourceQuota `status.hard`/`used`). Ignored (off) for
    /// [`Release::Oldest`].
    pub controller_manager: bool,
    /// Whether to run kube-scheduler (default profile, no leader election, no serving port), so
    /// Pods without `spec.nodeName` are bound to Nodes with room for their requests, counting
    /// the Pods already bound there. Off by default: most tests have no use for it and it is
    /// built on its own (`kube-scheduler-<version>` in the cache). [`ControlPlane::start`]
    /// returns once it has marked a probe Pod unschedulable (it has synced and is scheduling).
    /// Ignored (off) for [`Release::Oldest`].
    pub scheduler: bool,
    /// Whether kube-apiserver writes an audit log of every request (see
    /// [`ControlPlane::audit_events`]).
    pub audit: bool,
    /// CRDs installed before kube-controller-manager starts, so that its garbage collector
    /// and ResourceQuota controller watch their kinds from the start (both look for new
    /// resources only every 30 s): an ownerReference to a custom object is honoured, and a
    /// quota's `count/<plural>.<group>` is counted, at once.
    pub crds: Vec<CustomResourceDefinition>,
    /// kube-apiserver's `--request-timeout` (its default, 60 s, when `None`): how long a
    /// request that is not long-running (not a watch, exec, attach, log, proxy or
    /// port-forward) may take. A short one shows what a stream would lose to it.
    pub request_timeout: Option<Duration>,
    /// Whether real kubelets join ([`crate::podnode`]): kube-controller-manager also runs the
    /// controllers that turn Deployments and DaemonSets into Pods, keep Services' endpoints,
    /// publish `kube-root-ca.crt` and watch Nodes' heartbeats; kube-apiserver publishes its own
    /// address as the endpoint of Service `kubernetes` (in-cluster clients reach it through
    /// kube-proxy), calls webhooks and aggregated APIs at their Pods' addresses (no kube-proxy
    /// runs beside it) and kubelets at their Nodes' InternalIP. [`Options::host`] must be an
    /// address the nodes' namespaces reach.
    pub kubelets: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            release: Release::Newest,
            controller_manager: true,
            scheduler: false,
            audit: false,
            crds: Vec::new(),
            request_timeout: None,
            kubelets: false,
        }
    }
}

/// A pinned value from scripts/kube/pins.
pub fn pin(name: &'static str) -> Result<&'static str, Error> {
    PINS.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == name)
        .map(|(_, v)| v.trim())
        .ok_or(Error::Pin(name))
}

/// Where `scripts/kube/build` puts `tool` at `version`.
pub fn bin_dir(tool: &str, version: &str) -> PathBuf {
    let root = std::env::var_os("IMP_KUBE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("imp/kube")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/imp/kube")))
        .unwrap_or_else(|| PathBuf::from("/root/.cache/imp/kube"));
    root.join(format!("{tool}-{version}"))
}

/// The path of a built binary, or [`Error::Missing`].
pub fn binary(tool: &str, version: &str, name: &str) -> Result<PathBuf, Error> {
    let p = bin_dir(tool, version).join(name);
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::Missing { path: p })
    }
}

/// kubectl from the newest release.
pub fn kubectl() -> Result<PathBuf, Error> {
    binary("kubernetes", pin("KUBERNETES")?, "kubectl")
}

/// Helm.
pub fn helm() -> Result<PathBuf, Error> {
    binary("helm", pin("HELM")?, "helm")
}

/// Whether the binaries for `release` are built (kube-controller-manager included, not
/// kube-scheduler); under `CI=true` a missing one fails the test (through
/// [`crate::guard::require`]), elsewhere the caller skips.
pub fn available(release: Release) -> bool {
    available_for(&Options {
        release,
        ..Options::default()
    })
}

/// Whether every binary `opts` needs is built (kube-scheduler only with
/// [`Options::scheduler`]); fails or skips as [`available`] does.
pub fn available_for(opts: &Options) -> bool {
    let missing = binaries(opts).err().map(|e| e.to_string());
    crate::guard::require(
        missing.is_none(),
        &missing.unwrap_or_else(|| "the test control plane".into()),
    )
}

/// The binaries a control plane started with some [`Options`] runs.
#[derive(Debug)]
struct Binaries {
    etcd: PathBuf,
    apiserver: PathBuf,
    kcm: Option<PathBuf>,
    scheduler: Option<PathBuf>,
}

/// Which optional components `opts` runs: (kube-controller-manager, kube-scheduler); neither
/// for [`Release::Oldest`], whose build has only kube-apiserver.
fn optional_components(opts: &Options) -> (bool, bool) {
    let newest = opts.release == Release::Newest;
    (opts.controller_manager && newest, opts.scheduler && newest)
}

/// The binaries `opts` asks for.
fn binaries(opts: &Options) -> Result<Binaries, Error> {
    let v = opts.release.version()?;
    let (kcm, scheduler) = optional_components(opts);
    let kcm = kcm
        .then(|| binary("kubernetes", v, "kube-controller-manager"))
        .transpose()?;
    let scheduler = scheduler
        .then(|| binary("kube-scheduler", v, "kube-scheduler"))
        .transpose()?;
    Ok(Binaries {
        etcd: binary("etcd", pin("ETCD")?, "etcd")?,
        apiserver: binary("kubernetes", v, "kube-apiserver")?,
        kcm,
        scheduler,
    })
}

/// A running control plane; its processes are killed and its directory removed when dropped
/// (and its processes die with the test process in any case).
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    url: String,
    host: IpAddr,
    version: &'static str,
    pki: Pki,
    admin: PathBuf,
    audit_log: Option<PathBuf>,
    started_in: Duration,
    // Dropped in this order: the scheduler, the controller-manager, the API server, etcd, the
    // directory.
    scheduler: Option<Proc>,
    kcm: Option<Proc>,
    apiserver: Proc,
    etcd: Proc,
    _dir: DirGuard,
}

/// Removes a control plane's directory when dropped (after its processes).
#[derive(Debug)]
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A directory of its own for each control plane of this process.
fn fresh_dir() -> Result<PathBuf, Error> {
    static N: AtomicU32 = AtomicU32::new(0);
    let base = std::env::temp_dir();
    remove_stale(&base);
    let d = base.join(format!(
        "imp-testenv-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).map_err(|source| Error::Io {
        op: "creating",
        path: d.clone(),
        source,
    })?;
    Ok(d)
}

/// Removes the directories of control planes whose test process is gone (a shared control
/// plane is never dropped; its directory goes the next time a test starts one).
fn remove_stale(base: &Path) {
    for e in std::fs::read_dir(base).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("imp-testenv-") else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if !pid.is_empty() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A loopback port nothing listens on now.
fn free_port(host: IpAddr) -> Result<u16, Error> {
    TcpListener::bind((host, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| Error::Io {
            op: "finding a free port on",
            path: PathBuf::from(host.to_string()),
            source,
        })
}

fn write(path: &Path, data: &str) -> Result<(), Error> {
    std::fs::write(path, data).map_err(|source| Error::Io {
        op: "writing",
        path: path.to_path_buf(),
        source,
    })
}

/// Puts [`crate::egress::guard`] in place before a control plane starts: under `CI=true` a
/// guard that cannot be set up fails the start; on a developer machine (no root) it is a
/// warning, and what dials a ClusterIP may leave through the default route.
fn keep_traffic_here() -> Result<(), Error> {
    match crate::egress::guard() {
        Ok(()) => Ok(()),
        Err(e) if crate::guard::in_ci() => Err(Error::Egress(e)),
        Err(e) => {
            eprintln!(
                "imp-testenv: WARNING: packets to the Service range {} are not kept on this \
                 machine: {e}",
                crate::egress::SERVICE_RANGE
            );
            Ok(())
        }
    }
}

/// How many times a start is tried when another process took a port between our choice and
/// the component's bind (free ports cannot be reserved for a child that binds by number).
const PORT_RACE_TRIES: u32 = 3;

impl ControlPlane {
    /// The control plane shared by the tests of this test binary (default options), started by
    /// the first caller; `None` when its binaries are not built and the test should skip (under
    /// `CI=true` that fails the test instead). Each test takes a namespace of its own
    /// ([`ControlPlane::namespace`]) and makes its own clients (clients are bound to a tokio
    /// runtime, and each test has its own).
    pub fn shared() -> Option<&'static ControlPlane> {
        static SHARED: OnceLock<ControlPlane> = OnceLock::new();
        if !available(Release::Newest) {
            return None;
        }
        Some(SHARED.get_or_init(|| {
            std::thread::spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())
                    .and_then(|rt| {
                        rt.block_on(ControlPlane::start(Options::default()))
                            .map_err(|e| e.to_string())
                    })
            })
            .join()
            .unwrap_or_else(|_| Err("the start thread panicked".into()))
            .unwrap_or_else(|e| panic!("starting the shared test control plane: {e}"))
        }))
    }

    /// Starts a control plane of its own with `opts`.
    pub async fn start(opts: Options) -> Result<ControlPlane, Error> {
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::start_once(&opts).await {
                Err(Error::Exited { log, .. })
                    if tries < PORT_RACE_TRIES && log.contains("address already in use") =>
                {
                    continue;
                }
                other => return other,
            }
        }
    }

    async fn start_once(opts: &Options) -> Result<ControlPlane, Error> {
        if opts.kubelets && (!opts.scheduler || opts.host.is_loopback()) {
            return Err(Error::Options(
                "kubelets need the scheduler (DaemonSets' Pods are placed by it) and a host \
                 address the nodes' namespaces reach (not loopback)",
            ));
        }
        let t0 = Instant::now();
        let bins = binaries(opts)?;
        keep_traffic_here()?;
        let version = opts.release.version()?;
        let dir = fresh_dir()?;
        let pki = Pki::new("imp-testenv-ca")?;
        let etcd = start_etcd(&bins.etcd, &dir).await?;
        let port = free_port(opts.host)?;
        let url = format!("https://{}", std::net::SocketAddr::new(opts.host, port));
        let admin = dir.join("admin.kubeconfig");
        let cred = pki.client("imp-test-admin", Some("system:masters"))?;
        write(
            &admin,
            &kubeconfig::render(
                &url,
                pki.ca_pem(),
                "imp-test-admin",
                &Credential::Certificate {
                    cert: cred.cert,
                    key: cred.key,
                },
                "default",
            ),
        )?;
        let audit_log = opts.audit.then(|| dir.join("audit.log"));
        let apiserver =
            start_apiserver(&bins.apiserver, &dir, &pki, opts, port, &etcd.1, &audit_log)?;
        let dir_path = dir.clone();
        let mut cp = ControlPlane {
            dir,
            url,
            host: opts.host,
            version,
            pki,
            admin,
            audit_log,
            started_in: Duration::ZERO,
            scheduler: None,
            kcm: None,
            apiserver,
            etcd: etcd.0,
            _dir: DirGuard(dir_path),
        };
        cp.wait_apiserver().await?;
        if !opts.crds.is_empty() {
            let admin = cp.admin().await?;
            cp.install_crds(&admin, &opts.crds).await?;
        }
        if let Some(bin) = &bins.kcm {
            cp.kcm = Some(cp.start_kcm(bin, opts.kubelets)?);
            cp.wait_kcm().await?;
        }
        if let Some(bin) = &bins.scheduler {
            cp.scheduler = Some(cp.start_scheduler(bin)?);
            cp.wait_scheduler().await?;
        }
        cp.started_in = t0.elapsed();
        eprintln!(
            "imp-testenv: Kubernetes {version} ready at {} in {:.1} s",
            cp.url,
            cp.started_in.as_secs_f64()
        );
        Ok(cp)
    }

    /// Waits for `/readyz` (every post-start hook done: RBAC bootstrap roles, CRD informers…).
    async fn wait_apiserver(&mut self) -> Result<(), Error> {
        let client = self.client_from(&self.admin.clone()).await?;
        let t0 = Instant::now();
        loop {
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Io {
                    op: "building a /readyz request for",
                    path: PathBuf::from(&self.url),
                    source: std::io::Error::other(e),
                })?;
            if let Ok(body) = client.request_text(req).await
                && body.trim() == "ok"
            {
                return Ok(());
            }
            self.check("kube-apiserver", t0).await?;
        }
    }

    /// Waits until the controller-manager's ServiceAccount controller has made `default` in
    /// namespace `default` (it is running and has synced).
    async fn wait_kcm(&mut self) -> Result<(), Error> {
        let client = self.client_from(&self.admin.clone()).await?;
        let sas: Api<ServiceAccount> = Api::namespaced(client, "default");
        let t0 = Instant::now();
        loop {
            if let Ok(Some(_)) = sas.get_opt("default").await {
                return Ok(());
            }
            self.check("kube-controller-manager", t0).await?;
        }
    }

    /// Waits until kube-scheduler has synced and schedules: it runs no server (a serving port
    /// could collide with parallel test processes) and holds no Lease, so the signal is its
    /// work. A probe Pod in `default` is created while there is no Node, and the scheduler's
    /// `PodScheduled=False` condition on it is awaited; then the probe is deleted.
    async fn wait_scheduler(&mut self) -> Result<(), Error> {
        let client = self.client_from(&self.admin.clone()).await?;
        // Pod admission needs the namespace's ServiceAccount (made by the controller-manager
        // when it runs; made here when it does not).
        let sa = ServiceAccount {
            metadata: ObjectMeta {
                name: Some("default".into()),
                ..ObjectMeta::default()
            },
            ..ServiceAccount::default()
        };
        let sas = Api::<ServiceAccount>::namespaced(client.clone(), "default");
        create_if_absent(&sas, &sa, "ServiceAccount default/default").await?;
        let pods: Api<Pod> = Api::namespaced(client, "default");
        create_if_absent(&pods, &probe_pod(), "the scheduler's probe Pod").await?;
        let t0 = Instant::now();
        loop {
            if let Ok(Some(p)) = pods.get_opt(PROBE_POD).await
                && scheduler_has_seen(&p)
            {
                break;
            }
            self.check("kube-scheduler", t0).await?;
        }
        // Unbound, so deleted at once (no kubelet has to confirm).
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        pods.delete(PROBE_POD, &now)
            .await
            .map_err(|source| Error::Kube {
                what: format!("deleting the scheduler's probe Pod default/{PROBE_POD}"),
                source,
            })?;
        Ok(())
    }

    /// Fails when a component has exited or `what` has taken too long; else waits a moment.
    async fn check(&mut self, what: &'static str, t0: Instant) -> Result<(), Error> {
        for p in [
            Some(&mut self.etcd),
            Some(&mut self.apiserver),
            self.kcm.as_mut(),
            self.scheduler.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            still_running(p)?;
        }
        if t0.elapsed() > READY_WITHIN {
            let log = match what {
                "kube-controller-manager" => self.kcm.as_ref().map(|p| p.log_tail(40)),
                "kube-scheduler" => self.scheduler.as_ref().map(|p| p.log_tail(40)),
                _ => Some(self.apiserver.log_tail(40)),
            };
            return Err(Error::NotReady {
                what,
                secs: READY_WITHIN.as_secs(),
                log: log.unwrap_or_default(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(())
    }

    fn start_kcm(&self, bin: &Path, kubelets: bool) -> Result<Proc, Error> {
        let ca = self.dir.join("ca.crt");
        let own = [
            format!("--controllers={}", controllers(kubelets).join(",")),
            format!("--root-ca-file={}", ca.display()),
            "--concurrent-gc-syncs=5".to_owned(),
        ];
        self.start_component(bin, "kube-controller-manager", "kcm.log", &own)
    }

    /// Starts kube-scheduler as the admin, logging to `scheduler.log`: no leader election (one
    /// scheduler, nothing to wait for) and no serving port (`--secure-port=0`).
    fn start_scheduler(&self, bin: &Path) -> Result<Proc, Error> {
        self.start_component(bin, "kube-scheduler", "scheduler.log", &[])
    }

    /// Starts a control-plane component as the admin (its client, authentication and
    /// authorization kubeconfigs), alone (no leader election), serving nothing (no secure
    /// port), with its `own` flags, logging to `log` in the control plane's directory.
    fn start_component(
        &self,
        bin: &Path,
        name: &'static str,
        log: &str,
        own: &[String],
    ) -> Result<Proc, Error> {
        let admin = self.admin.display();
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--kubeconfig={admin}"))
            .arg(format!("--authentication-kubeconfig={admin}"))
            .arg(format!("--authorization-kubeconfig={admin}"))
            .args(own)
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1")
            .arg("--secure-port=0")
            .arg("--v=1");
        process::start(name, cmd, &self.dir.join(log)).map_err(|source| Error::Io {
            op: "starting",
            path: bin.to_path_buf(),
            source,
        })
    }

    /// Waits until the ServiceAccount controller has made `default` in namespace `namespace`:
    /// Pod admission refuses a Pod whose ServiceAccount does not exist yet, and a fresh
    /// namespace has none for a moment.
    pub async fn default_service_account(
        &self,
        client: &kube::Client,
        namespace: &str,
    ) -> Result<(), Error> {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let t0 = Instant::now();
        loop {
            let got = sas.get_opt("default").await.map_err(|source| Error::Kube {
                what: format!("reading ServiceAccount {namespace}/default"),
                source,
            })?;
            if got.is_some() {
                return Ok(());
            }
            if t0.elapsed() > READY_WITHIN {
                return Err(Error::NotReady {
                    what: "the namespace's default ServiceAccount",
                    secs: READY_WITHIN.as_secs(),
                    log: self
                        .kcm
                        .as_ref()
                        .map(|p| p.log_tail(40))
                        .unwrap_or_else(|| "no kube-controller-manager runs".into()),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The API server's URL, e.g. `https://127.0.0.1:34567`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The address kube-apiserver listens on.
    pub fn host(&self) -> IpAddr {
        self.host
    }

    /// The Kubernetes version it runs, e.g. `v1.37.2`.
    pub fn version(&self) -> &'static str {
        self.version
    }

    /// How long it took to become ready.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// The CA (PEM) that signed the API server's certificate and every client certificate: a
    /// webhook's `caBundle` may use it through [`ControlPlane::serving_pair`].
    pub fn ca_pem(&self) -> &str {
        self.pki.ca_pem()
    }

    /// A serving certificate signed by the control plane's CA, for a webhook served at `names`.
    pub fn serving_pair(&self, names: &[String]) -> Result<pki::Pair, Error> {
        Ok(self.pki.serving(names)?)
    }

    /// The admin kubeconfig (a client certificate in `system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin
    }

    /// A kube-rs client as the admin.
    pub async fn admin(&self) -> Result<kube::Client, Error> {
        self.client_from(&self.admin).await
    }

    /// A kube-rs client from kubeconfig `path`.
    pub async fn client_from(&self, path: &Path) -> Result<kube::Client, Error> {
        let kc = kube::config::Kubeconfig::read_from(path)
            .map_err(|e| Error::Kubeconfig(path.to_path_buf(), e))?;
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kubeconfig(path.to_path_buf(), e))?;
        kube::Client::try_from(cfg).map_err(|source| Error::Kube {
            what: format!("building a client from {}", path.display()),
            source,
        })
    }

    /// A kubeconfig for a certificate user `user` in group `group`, written under the
    /// control plane's directory.
    pub fn user_kubeconfig(&self, user: &str, group: Option<&str>) -> Result<PathBuf, Error> {
        let pair = self.pki.client(user, group)?;
        let path = self.dir.join(format!("user-{user}.kubeconfig"));
        let cred = Credential::Certificate {
            cert: pair.cert,
            key: pair.key,
        };
        write(
            &path,
            &kubeconfig::render(&self.url, self.ca_pem(), user, &cred, "default"),
        )?;
        Ok(path)
    }

    /// A kubeconfig that presents bearer token `token` (as `name`), in namespace `namespace`.
    pub fn token_kubeconfig(
        &self,
        name: &str,
        token: &str,
        namespace: &str,
    ) -> Result<PathBuf, Error> {
        let path = self.dir.join(format!("token-{name}.kubeconfig"));
        let cred = Credential::Token(token.to_owned());
        write(
            &path,
            &kubeconfig::render(&self.url, self.ca_pem(), name, &cred, namespace),
        )?;
        Ok(path)
    }

    /// A kubeconfig for ServiceAccount `namespace/name` (created if missing), with a token from
    /// the TokenRequest API valid for six hours: the identity the operator and the agents run
    /// with in the tests, as their Pods would.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<PathBuf, Error> {
        let client = self.admin().await?;
        self.ensure_namespace(&client, namespace).await?;
        let sas: Api<ServiceAccount> = Api::namespaced(client, namespace);
        let kerr = |what: String| move |source| Error::Kube { what, source };
        let mut sa = ServiceAccount::default();
        sa.metadata.name = Some(name.to_owned());
        match sas.create(&PostParams::default(), &sa).await {
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            other => {
                other.map_err(kerr(format!("creating ServiceAccount {namespace}/{name}")))?;
            }
        }
        let mut req = TokenRequest::default();
        req.spec.expiration_seconds = Some(6 * 3600);
        let token = sas
            .create_token_request(name, &PostParams::default(), &req)
            .await
            .map_err(kerr(format!(
                "a token for ServiceAccount {namespace}/{name}"
            )))?
            .status
            .map(|s| s.token)
            .unwrap_or_default();
        self.token_kubeconfig(&format!("{namespace}-{name}"), &token, namespace)
    }

    /// Creates namespace `name` unless it exists.
    pub async fn ensure_namespace(&self, client: &kube::Client, name: &str) -> Result<(), Error> {
        let api: Api<Namespace> = Api::all(client.clone());
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.to_owned());
        match api.create(&PostParams::default(), &ns).await {
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            other => other.map(|_| ()).map_err(|source| Error::Kube {
                what: format!("creating namespace {name}"),
                source,
            }),
        }
    }

    /// A namespace of its own for one test: `prefix-N`, N unique in this test process.
    pub async fn namespace(&self, client: &kube::Client, prefix: &str) -> Result<String, Error> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed));
        self.ensure_namespace(client, &name).await?;
        Ok(name)
    }

    /// Creates `crds` (as the admin) and waits until the server serves each of them
    /// (`Established`): a custom object created before that gets 404.
    pub async fn install_crds(
        &self,
        client: &kube::Client,
        crds: &[CustomResourceDefinition],
    ) -> Result<(), Error> {
        let api: Api<CustomResourceDefinition> = Api::all(client.clone());
        for crd in crds {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let kerr = |source| Error::Kube {
                what: format!("creating CRD {name}"),
                source,
            };
            match api.create(&PostParams::default(), crd).await {
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                other => {
                    other.map_err(kerr)?;
                }
            }
        }
        for crd in crds {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let t0 = Instant::now();
            loop {
                let got = api.get(&name).await.map_err(|source| Error::Kube {
                    what: format!("reading CRD {name}"),
                    source,
                })?;
                if established(&got) {
                    break;
                }
                if t0.elapsed() > READY_WITHIN {
                    return Err(Error::NotReady {
                        what: "a CRD",
                        secs: READY_WITHIN.as_secs(),
                        log: format!("{name}: {:?}", got.status),
                    });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// A kubectl command (the same release's) pointed at this control plane as the admin.
    pub fn kubectl(&self) -> Result<Command, Error> {
        let mut c = Command::new(kubectl()?);
        c.env("KUBECONFIG", &self.admin);
        Ok(c)
    }

    /// Every request the API server has audited so far (one JSON object each, at level
    /// `Metadata`: user, userAgent, verb, objectRef), when started with [`Options::audit`].
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        let Some(p) = &self.audit_log else {
            return Vec::new();
        };
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Requests audited so far, by User-Agent (each request once, whatever stages it logged),
    /// so a benchmark can count a client's calls at the server.
    pub fn requests_by_user_agent(&self) -> std::collections::BTreeMap<String, u64> {
        let mut seen = std::collections::HashSet::new();
        let mut out = std::collections::BTreeMap::new();
        for e in self.audit_events() {
            let id = e["auditID"].as_str().unwrap_or_default().to_owned();
            if seen.insert(id) {
                let ua = e["userAgent"].as_str().unwrap_or_default().to_owned();
                *out.entry(ua).or_insert(0) += 1;
            }
        }
        out
    }

    /// The last `lines` lines of each component's log.
    pub fn logs(&self, lines: usize) -> String {
        let mut out = String::new();
        for p in [
            Some(&self.etcd),
            Some(&self.apiserver),
            self.kcm.as_ref(),
            self.scheduler.as_ref(),
        ]
        .into_iter()
        .flatten()
        {
            out.push_str(&format!(
                "---- {} (pid {}) ----\n{}\n",
                p.name,
                p.pid(),
                p.log_tail(lines)
            ));
        }
        out
    }

    /// The directory holding its certificates, kubeconfigs, data and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs(30));
        }
    }
}

/// The controllers kube-controller-manager runs: those the tests depend on, and none that
/// expects kubelets (the node lifecycle controller would mark every test Node unreachable).
const KCM_CONTROLLERS: &[&str] = &[
    "namespace-controller",
    "garbage-collector-controller",
    "serviceaccount-controller",
    "resourcequota-controller",
];

/// The controllers added when real kubelets join ([`Options::kubelets`]): Deployments and
/// DaemonSets become Pods, Services get endpoints, every namespace gets `kube-root-ca.crt`
/// (a Pod's token volume needs it), and Nodes whose kubelet stops are marked unreachable.
const KUBELET_CONTROLLERS: &[&str] = &[
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "endpointslice-controller",
    "endpoints-controller",
    "root-ca-certificate-publisher-controller",
    "node-lifecycle-controller",
];

/// The controllers kube-controller-manager runs: [`KCM_CONTROLLERS`], and
/// [`KUBELET_CONTROLLERS`] when kubelets join.
fn controllers(kubelets: bool) -> Vec<&'static str> {
    let extra: &[&str] = if kubelets { KUBELET_CONTROLLERS } else { &[] };
    KCM_CONTROLLERS.iter().chain(extra).copied().collect()
}

/// The name of the Pod [`ControlPlane::start`] has kube-scheduler look at.
const PROBE_POD: &str = "imp-scheduler-probe";

/// The probe Pod: unbound, no token mounted, never run (there is no kubelet).
fn probe_pod() -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(PROBE_POD.into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            automount_service_account_token: Some(false),
            containers: vec![Container {
                name: "probe".into(),
                image: Some("registry.invalid/probe".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// Whether kube-scheduler has decided about `pod`: bound it, or set its `PodScheduled`
/// condition (`False` with reason `Unschedulable` when no Node fits).
fn scheduler_has_seen(pod: &Pod) -> bool {
    let bound = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    let conditioned = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "PodScheduled"));
    bound || conditioned
}

/// Creates `obj` through `api`, an existing one (409) being as good.
async fn create_if_absent<K>(api: &Api<K>, obj: &K, what: &str) -> Result<(), Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        other => other.map(|_| ()).map_err(|source| Error::Kube {
            what: format!("creating {what}"),
            source,
        }),
    }
}

/// Whether the server serves `crd` (its `Established` condition is true).
fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// Starts etcd on free loopback ports and waits until it accepts connections; returns it and
/// its client URL.
async fn start_etcd(bin: &Path, dir: &Path) -> Result<(Proc, String), Error> {
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let (client, peer) = (free_port(lo)?, free_port(lo)?);
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--data-dir={}", dir.join("etcd").display()))
        .arg(format!("--listen-client-urls={client_url}"))
        .arg(format!("--advertise-client-urls={client_url}"))
        .arg(format!("--listen-peer-urls={peer_url}"))
        .arg(format!("--initial-advertise-peer-urls={peer_url}"))
        .arg(format!("--initial-cluster=default={peer_url}"))
        .arg("--unsafe-no-fsync")
        .arg("--log-level=warn");
    let mut p = process::start("etcd", cmd, &dir.join("etcd.log")).map_err(|source| Error::Io {
        op: "starting",
        path: bin.to_path_buf(),
        source,
    })?;
    let t0 = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", client)).is_ok() {
            return Ok((p, client_url));
        }
        if let Some(status) = p.exited() {
            return Err(Error::Exited {
                what: "etcd",
                status,
                log: p.log_tail(40),
            });
        }
        if t0.elapsed() > READY_WITHIN {
            return Err(Error::NotReady {
                what: "etcd",
                secs: READY_WITHIN.as_secs(),
                log: p.log_tail(40),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The audit policy: every request at level Metadata (who, from which client, what).
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n";

/// Writes the API server's certificates and starts it.
fn start_apiserver(
    bin: &Path,
    dir: &Path,
    pki: &Pki,
    opts: &Options,
    port: u16,
    etcd_url: &str,
    audit_log: &Option<PathBuf>,
) -> Result<Proc, Error> {
    let names: Vec<String> = [
        opts.host.to_string(),
        "127.0.0.1".into(),
        crate::egress::KUBERNETES_SERVICE_IP.into(),
        "localhost".into(),
        "kubernetes".into(),
        "kubernetes.default".into(),
        "kubernetes.default.svc".into(),
    ]
    .into_iter()
    .collect();
    let serving = pki.serving(&names)?;
    let (ca, crt, key, sa, sa_pub) = (
        dir.join("ca.crt"),
        dir.join("apiserver.crt"),
        dir.join("apiserver.key"),
        dir.join("sa.key"),
        dir.join("sa.pub"),
    );
    write(&ca, pki.ca_pem())?;
    write(&crt, &serving.cert)?;
    write(&key, &serving.key)?;
    let front_proxy = front_proxy_flags(dir)?;
    let (sa_key, sa_pub_pem) = pki::signing_key()?;
    write(&sa, &sa_key)?;
    write(&sa_pub, &sa_pub_pem)?;
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--etcd-servers={etcd_url}"))
        .arg(format!("--bind-address={}", opts.host))
        .arg(format!("--advertise-address={}", opts.host))
        .arg(format!("--secure-port={port}"))
        .arg(format!("--tls-cert-file={}", crt.display()))
        .arg(format!("--tls-private-key-file={}", key.display()))
        .arg(format!("--client-ca-file={}", ca.display()))
        .arg(format!("--cert-dir={}", dir.join("certs").display()))
        .arg("--authorization-mode=RBAC")
        .arg(format!(
            "--service-account-issuer=https://{}:{port}",
            opts.host
        ))
        .arg(format!("--service-account-key-file={}", sa_pub.display()))
        .arg(format!(
            "--service-account-signing-key-file={}",
            sa.display()
        ))
        .arg(format!(
            "--service-cluster-ip-range={}",
            crate::egress::SERVICE_RANGE
        ))
        .arg("--allow-privileged=true")
        .arg("--enable-priority-and-fairness=false")
        .arg("--profiling=false")
        .args(front_proxy)
        .arg("--v=0");
    cmd.args(kubelet_flags(opts.kubelets));
    if let Some(t) = opts.request_timeout {
        cmd.arg(format!("--request-timeout={}s", t.as_secs().max(1)));
    }
    if let Some(log) = audit_log {
        let policy = dir.join("audit-policy.yaml");
        write(&policy, AUDIT_POLICY)?;
        cmd.arg(format!("--audit-policy-file={}", policy.display()))
            .arg(format!("--audit-log-path={}", log.display()))
            .arg("--audit-log-mode=blocking")
            .arg("--audit-log-format=json");
    }
    process::start("kube-apiserver", cmd, &dir.join("apiserver.log")).map_err(|source| Error::Io {
        op: "starting",
        path: bin.to_path_buf(),
        source,
    })
}

/// Fails with the end of its log if process `p` has exited.
pub(crate) fn still_running(p: &mut Proc) -> Result<(), Error> {
    match p.exited() {
        Some(status) => Err(Error::Exited {
            what: p.name,
            status,
            log: p.log_tail(40),
        }),
        None => Ok(()),
    }
}

/// kube-apiserver's flags that depend on whether kubelets join ([`Options::kubelets`]).
fn kubelet_flags(kubelets: bool) -> &'static [&'static str] {
    if kubelets {
        &[
            "--enable-aggregator-routing=true",
            "--kubelet-preferred-address-types=InternalIP",
        ]
    } else {
        // Without kube-proxy nothing could use the endpoint of Service `kubernetes`.
        &["--endpoint-reconciler-type=none"]
    }
}

/// The common name of the front proxy's client certificate, the one allowed name.
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

/// The aggregation layer, as kubeadm sets it up: a CA of its own for the requests the API
/// server proxies to aggregated API servers, its client certificate and the request-header
/// settings, which the API server publishes in ConfigMap
/// `kube-system/extension-apiserver-authentication` for those servers to read.
fn front_proxy_flags(dir: &Path) -> Result<Vec<String>, Error> {
    let pki = Pki::new("imp-testenv-front-proxy-ca")?;
    let client = pki.client(FRONT_PROXY_CLIENT, None)?;
    let (ca, crt, key) = (
        dir.join("front-proxy-ca.crt"),
        dir.join("front-proxy-client.crt"),
        dir.join("front-proxy-client.key"),
    );
    write(&ca, pki.ca_pem())?;
    write(&crt, &client.cert)?;
    write(&key, &client.key)?;
    Ok(vec![
        format!("--requestheader-client-ca-file={}", ca.display()),
        format!("--requestheader-allowed-names={FRONT_PROXY_CLIENT}"),
        "--requestheader-username-headers=X-Remote-User".to_owned(),
        "--requestheader-group-headers=X-Remote-Group".to_owned(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".to_owned(),
        format!("--proxy-client-cert-file={}", crt.display()),
        format!("--proxy-client-key-file={}", key.display()),
    ])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn every_pin_the_harness_reads_is_in_the_pins_file() {
        for name in ["KUBERNETES", "KUBERNETES_OLDEST", "ETCD", "HELM"] {
            let v = pin(name).unwrap();
            assert!(v.starts_with('v'), "{name}={v}");
        }
        assert!(pin("NOPE").is_err());
    }

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_scheduler_has_seen_a_pod_it_bound_or_gave_a_scheduled_condition() {
        assert!(!scheduler_has_seen(&probe_pod()));
        let created = pod(json!({"metadata": {"name": "p"}, "status": {"phase": "Pending"}}));
        assert!(!scheduler_has_seen(&created));
        assert!(scheduler_has_seen(&pod(json!({
            "metadata": {"name": "p"},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                                       "reason": "Unschedulable"}]},
        }))));
        assert!(scheduler_has_seen(&pod(json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n1", "containers": []},
        }))));
    }

    #[test]
    fn the_controller_manager_runs_quota_and_no_controller_that_needs_kubelets() {
        assert!(KCM_CONTROLLERS.contains(&"resourcequota-controller"));
        assert!(!KCM_CONTROLLERS.iter().any(|c| c.contains("nodelifecycle")));
    }

    #[test]
    fn the_scheduler_runs_only_when_asked_for_and_never_on_the_oldest_release() {
        let default = Options::default();
        assert_eq!(optional_components(&default), (true, false));
        let scheduler = Options {
            scheduler: true,
            ..Options::default()
        };
        assert_eq!(optional_components(&scheduler), (true, true));
        let oldest = Options {
            release: Release::Oldest,
            ..scheduler
        };
        assert_eq!(optional_components(&oldest), (false, false));
    }

    #[test]
    fn binaries_are_looked_up_under_the_cache_keyed_by_tool_and_version() {
        let d = bin_dir("etcd", "v3.7.3");
        assert!(d.ends_with("imp/kube/etcd-v3.7.3") || d.ends_with("etcd-v3.7.3"));
    }
}
