//! The CLI against a cluster: `imp exec` and `imp console` find the ImpVM's node and reach that
//! node's agent over TLS pinned to the certificate the Node publishes, as the kubeconfig's
//! user (`imp logs` reads the same console); `imp suspend|resume` set the ImpVM's desired
//! state; `imp ps` lists ImpVMs ([`ps`]); `imp top` shows their guests' figures ([`top`]).
//!
//! Cluster mode is chosen when `-n/--namespace`, `--kubeconfig` or `--context` is given (or
//! `imp ps -A`), or when the binary runs as `kubectl-imp`, the kubectl plugin ([`plugin`]);
//! otherwise the commands act on the local VMs of `imp run`. The ImpVM's `status.nodeName`
//! (or `spec.nodeName`) names the node; its annotations `imp.dev/agent-endpoint` and
//! `imp.dev/agent-cert-sha256` say where the agent listens and which certificate it has. The
//! API server vouches for both, so no certificate authority is involved and nothing is
//! trusted that the API server did not publish.
//!
//! The exec reuses the local exec's terminal, stdin and output handling unchanged: the
//! upgraded TLS connection is spliced onto one end of a Unix socket pair, and the local code
//! speaks imp-proto on the other end as it does on a VM's vsock.

use std::ffi::OsStr;
use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use imp_agent::api::client::{self, Target};
use imp_api::shared::VmDesiredState;
use imp_api::shared::{ANNOTATION_AGENT_CERT_SHA256, ANNOTATION_AGENT_ENDPOINT};
use imp_api::vm::{ImpVM, VmPhase};
use imp_proto::message::Hello;
use k8s_openapi::api::core::v1::{Event, Node};
use k8s_openapi::jiff::Timestamp;
use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};
use secrecy::ExposeSecret;

use crate::args::{ClusterArgs, ConsoleArgs, ExecArgs, SuspendArgs, parse_env};
use crate::local::exec as local_exec;

pub mod plugin;
pub mod ps;
pub mod top;

/// Whether a command acts on the cluster rather than on a local VM.
pub fn wanted(args: &ClusterArgs) -> bool {
    let argv0 = std::env::args_os().next();
    selects_cluster(args, argv0.as_deref())
}

/// Cluster mode: any cluster flag, or the binary invoked as `kubectl-imp`.
fn selects_cluster(args: &ClusterArgs, argv0: Option<&OsStr>) -> bool {
    args.namespace.is_some()
        || args.kubeconfig.is_some()
        || args.context.is_some()
        || plugin::invoked(argv0)
}

/// `imp exec -n NS VM -- CMD…` against the cluster: the remote command's exit code.
pub fn exec(args: ExecArgs) -> anyhow::Result<i32> {
    let opts = local_exec::ExecOptions {
        argv: args.command,
        env: parse_env(&args.env)?,
        cwd: args.workdir,
        user: args.user,
        tty: args.tty,
        stdin: args.interactive || args.tty,
    };
    let rt = runtime()?;
    let agent = rt.block_on(resolve(&args.cluster, &args.vm, args.timeout))?;
    let namespace = &agent.namespace;
    let upgraded = rt
        .block_on(client::exec(&agent.target, namespace, &args.vm))
        .with_context(|| {
            format!(
                "starting an exec in ImpVM {namespace}/{} on node {}",
                args.vm, agent.node
            )
        })?;
    // The local exec speaks imp-proto on a blocking Unix socket; give it one whose other end
    // is spliced onto the upgraded connection.
    let (ours, theirs) =
        std::os::unix::net::UnixStream::pair().context("creating a socket pair")?;
    theirs
        .set_nonblocking(true)
        .context("making the socket pair non-blocking")?;
    let theirs = {
        let _guard = rt.enter();
        tokio::net::UnixStream::from_std(theirs).context("registering the socket pair")?
    };
    rt.spawn(carry(theirs, upgraded));
    ours.set_read_timeout(Some(args.timeout))
        .context("setting the handshake timeout")?;
    let handle = ours.try_clone().context("cloning the socket")?;
    let hello = Hello::new(concat!("imp/", env!("CARGO_PKG_VERSION")));
    let client = imp_proto::Client::handshake(ours, &hello).with_context(|| {
        format!(
            "the guest agent of ImpVM {namespace}/{} did not answer",
            args.vm
        )
    })?;
    // Execs may be silent for long: no timeout from here on.
    handle
        .set_read_timeout(None)
        .context("clearing the handshake timeout")?;
    let status = local_exec::exec(local_exec::Connection { client, handle }, &opts)?;
    Ok(status.code())
}

/// Carries an exec between the local end of the socket pair and the agent's connection. The
/// agent's side is read to its end whatever happens to ours: a failed write of our stdin's end
/// (the agent may have closed first) must not drop the output and exit still on their way.
async fn carry<L, R>(local: L, remote: R)
where
    L: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    R: tokio::io::AsyncRead + tokio::io::AsyncWrite,
{
    use tokio::io::AsyncWriteExt;
    let (mut local_rx, mut local_tx) = tokio::io::split(local);
    let (mut remote_rx, mut remote_tx) = tokio::io::split(remote);
    let up = async {
        let _ = tokio::io::copy(&mut local_rx, &mut remote_tx).await;
        let _ = remote_tx.shutdown().await;
    };
    let down = async {
        let _ = tokio::io::copy(&mut remote_rx, &mut local_tx).await;
        let _ = local_tx.shutdown().await;
    };
    tokio::join!(up, down);
}

/// `imp console -n NS VM` (and `imp logs`) against the cluster: the serial log to stdout,
/// following it unless `--no-follow` (`logs`: only with `-f`).
pub fn console(args: ConsoleArgs) -> anyhow::Result<()> {
    use http_body_util::BodyExt;
    let rt = runtime()?;
    rt.block_on(async {
        let agent = resolve(&args.cluster, &args.vm, Duration::from_secs(30)).await?;
        let namespace = &agent.namespace;
        let mut body = client::console(&agent.target, namespace, &args.vm, !args.no_follow)
            .await
            .with_context(|| {
                format!(
                    "reading the console of ImpVM {namespace}/{} on node {}",
                    args.vm, agent.node
                )
            })?;
        let mut out = std::io::stdout().lock();
        while let Some(frame) = body.frame().await {
            let frame = frame.context("reading the console stream")?;
            if let Some(data) = frame.data_ref() {
                out.write_all(data)
                    .and_then(|()| out.flush())
                    .context("writing to stdout")?;
            }
        }
        Ok(())
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The node agent that runs an ImpVM, and where the VM is.
struct Agent {
    /// How to reach the agent, as whom.
    target: Target,
    /// The VM's namespace.
    namespace: String,
    /// The node the VM runs on.
    node: String,
}

/// Finds the agent of the node that runs `vm`.
async fn resolve(args: &ClusterArgs, vm: &str, timeout: Duration) -> anyhow::Result<Agent> {
    let config = load_config(args).await?;
    let token = bearer_token(&config.auth_info)?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let mut config = config;
    config.connect_timeout = Some(timeout);
    let kube = kube::Client::try_from(config).context("building the Kubernetes client")?;
    let found = kube::Api::<ImpVM>::namespaced(kube.clone(), &namespace)
        .get_opt(vm)
        .await
        .with_context(|| format!("reading ImpVM {namespace}/{vm}"))?
        .with_context(|| format!("ImpVM {namespace}/{vm} not found"))?;
    let node_name = node_of(&found)
        .with_context(|| format!("ImpVM {namespace}/{vm} is not placed on a node yet"))?;
    let node = kube::Api::<Node>::all(kube)
        .get(&node_name)
        .await
        .with_context(|| format!("reading Node {node_name}, where ImpVM {namespace}/{vm} runs"))?;
    let (endpoint, fingerprint) = agent_of(&node)?;
    Ok(Agent {
        target: Target {
            endpoint,
            fingerprint,
            token,
        },
        namespace,
        node: node_name,
    })
}

/// The kubeconfig the cluster flags select.
async fn load_config(args: &ClusterArgs) -> anyhow::Result<kube::Config> {
    let kubeconfig = match &args.kubeconfig {
        Some(path) => Kubeconfig::read_from(path)
            .with_context(|| format!("reading the kubeconfig {}", path.display()))?,
        None => {
            Kubeconfig::read().context("reading the kubeconfig (KUBECONFIG or ~/.kube/config)")?
        }
    };
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .context("loading the kubeconfig")
}

/// The phase an ImpVM reaches when `desired` is done, or why it never will.
fn desired_reached(desired: VmDesiredState, phase: VmPhase) -> Option<Result<(), String>> {
    let want = match desired {
        VmDesiredState::Suspended => VmPhase::Suspended,
        _ => VmPhase::Running,
    };
    if phase == want {
        return Some(Ok(()));
    }
    phase
        .is_terminal()
        .then(|| Err(format!("the VM is {phase}")))
}

/// The newest time an Event says it happened (a repeated Event keeps its first creation).
fn event_seen(e: &Event) -> Option<Timestamp> {
    let times = [
        e.series
            .as_ref()
            .and_then(|s| s.last_observed_time.as_ref())
            .map(|t| t.0),
        e.event_time.as_ref().map(|t| t.0),
        e.last_timestamp.as_ref().map(|t| t.0),
        e.metadata.creation_timestamp.as_ref().map(|t| t.0),
    ];
    times.into_iter().flatten().max()
}

/// The message of a `SuspendFailed` Event about the VM with `uid` seen at `since` or later:
/// the node's agent tried and the VM runs on, so waiting longer is pointless.
fn fresh_suspend_failure(events: &[Event], uid: &str, since: Timestamp) -> Option<String> {
    events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("SuspendFailed"))
        .filter(|e| e.involved_object.uid.as_deref() == Some(uid))
        .filter(|e| event_seen(e).is_some_and(|t| t >= since))
        .filter_map(|e| e.message.clone())
        .next()
}

/// `imp suspend|resume -n NS VM` against the cluster: sets `spec.desiredState` on the ImpVM
/// and waits until its node's agent reports the phase (`Suspended`, or `Running`).
pub fn set_desired_state(args: SuspendArgs, desired: VmDesiredState) -> anyhow::Result<()> {
    let rt = runtime()?;
    rt.block_on(async {
        let config = load_config(&args.cluster).await?;
        let namespace = args
            .cluster
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let kube = kube::Client::try_from(config).context("building the Kubernetes client")?;
        let api = kube::Api::<ImpVM>::namespaced(kube, &namespace);
        let vm = &args.vm;
        let current = api
            .get_opt(vm)
            .await
            .with_context(|| format!("reading ImpVM {namespace}/{vm}"))?
            .with_context(|| format!("ImpVM {namespace}/{vm} not found"))?;
        let uid = current.metadata.uid.clone().unwrap_or_default();
        let events = kube::Api::<Event>::namespaced(api.clone().into_client(), &namespace);
        let phase = current.status.and_then(|s| s.phase).unwrap_or_default();
        if phase.is_terminal() {
            bail!("ImpVM {namespace}/{vm} is {phase}: only a live VM can be suspended or resumed");
        }
        let body = serde_json::json!({"spec": {"desiredState": desired}});
        api.patch(
            vm,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&body),
        )
        .await
        .with_context(|| format!("setting spec.desiredState of ImpVM {namespace}/{vm}"))?;
        let started = std::time::Instant::now();
        // Only failures after this request count (one of an earlier request, or of a retry
        // while the node was short of disk, is old news; a failure in this very second may
        // then be missed until the agent's next try reports it again).
        let since = Timestamp::now();
        loop {
            let now = api
                .get(vm)
                .await
                .with_context(|| format!("reading ImpVM {namespace}/{vm}"))?;
            let phase = now.status.and_then(|s| s.phase).unwrap_or_default();
            match desired_reached(desired, phase) {
                Some(Ok(())) => break,
                Some(Err(why)) => bail!("ImpVM {namespace}/{vm}: {why}"),
                None if desired == VmDesiredState::Suspended => {
                    let listed = events
                        .list(&kube::api::ListParams::default())
                        .await
                        .with_context(|| format!("listing the Events of namespace {namespace}"))?;
                    if let Some(why) = fresh_suspend_failure(&listed.items, &uid, since) {
                        bail!("ImpVM {namespace}/{vm} could not be suspended: {why}");
                    }
                }
                None => {}
            }
            if started.elapsed() > args.timeout {
                bail!(
                    "ImpVM {namespace}/{vm} is still {phase} after {:?}",
                    args.timeout
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "imp: ImpVM {namespace}/{vm} is {desired:?} after {:.2}s",
            started.elapsed().as_secs_f64()
        );
        println!("{vm}");
        Ok(())
    })
}

/// The node an ImpVM runs on: `status.nodeName`, else `spec.nodeName`.
fn node_of(vm: &ImpVM) -> Option<String> {
    vm.status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .or_else(|| vm.spec.node_name.clone())
        .filter(|n| !n.is_empty())
}

/// The agent endpoint and certificate fingerprint a Node publishes.
fn agent_of(node: &Node) -> anyhow::Result<(String, String)> {
    let name = node.metadata.name.as_deref().unwrap_or("");
    let annotations = node.metadata.annotations.as_ref();
    let get = |key: &str| {
        annotations
            .and_then(|a| a.get(key))
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .with_context(|| {
                format!("Node {name} has no annotation {key}: is the imp agent running there?")
            })
    };
    Ok((
        get(ANNOTATION_AGENT_ENDPOINT)?,
        get(ANNOTATION_AGENT_CERT_SHA256)?,
    ))
}

/// The bearer token of the kubeconfig's user (`token`, or the file `tokenFile` names).
fn bearer_token(auth: &AuthInfo) -> anyhow::Result<String> {
    if let Some(token) = auth.token.as_ref() {
        return Ok(token.expose_secret().trim().to_owned());
    }
    if let Some(file) = auth.token_file.as_deref() {
        let token = std::fs::read_to_string(file)
            .with_context(|| format!("reading the kubeconfig user's tokenFile {file}"))?;
        let token = token.trim();
        if token.is_empty() {
            bail!("the kubeconfig user's tokenFile {file} is empty");
        }
        return Ok(token.to_owned());
    }
    let method = if auth.client_certificate.is_some() || auth.client_certificate_data.is_some() {
        "client certificates"
    } else if auth.exec.is_some() {
        "an exec credential plugin"
    } else if auth.auth_provider.is_some() {
        "an auth provider"
    } else if auth.username.is_some() {
        "a username and password"
    } else {
        "no credentials"
    };
    bail!(
        "the kubeconfig user authenticates with {method}; imp exec and imp console need a bearer \
         token (users[].user.token or tokenFile) to present to the node agent"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_agents_output_reaches_us_even_when_our_last_write_fails() {
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        let (mut agent, remote_rx) = tokio::io::duplex(1 << 16);
        // An agent connection that takes no more bytes (its reader is gone: writes fail) but
        // still has the output and the exit on their way to us.
        let (closed_for_writes, _) = tokio::io::duplex(1 << 16);
        let task = tokio::spawn(carry(theirs, tokio::io::join(remote_rx, closed_for_writes)));
        // Our stdin's end goes out first and fails at the closed connection...
        ours.write_all(b"stdin eof").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // ...while the output and the exit are still on their way.
        agent.write_all(b"output and exit").await.unwrap();
        drop(agent);
        let mut got = Vec::new();
        ours.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"output and exit");
        drop(ours);
        task.await.unwrap();
    }

    /// The agent half-closes (the guest ended its side): we see the end of the stream, what
    /// we send still reaches the agent, and our end ends the carrying.
    #[tokio::test]
    async fn the_agents_half_close_is_ours_and_our_side_stays_open() {
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        let (agent, remote) = tokio::io::duplex(1 << 16);
        let task = tokio::spawn(carry(theirs, remote));
        let (mut agent_rx, mut agent_tx) = tokio::io::split(agent);
        agent_tx.write_all(b"last output").await.unwrap();
        agent_tx.shutdown().await.unwrap();
        let mut got = Vec::new();
        ours.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last output");
        ours.write_all(b"still sending").await.unwrap();
        let mut heard = [0u8; 13];
        agent_rx.read_exact(&mut heard).await.unwrap();
        assert_eq!(&heard, b"still sending");
        assert!(!task.is_finished());
        ours.shutdown().await.unwrap();
        assert_eq!(
            agent_rx.read(&mut [0u8; 4]).await.unwrap(),
            0,
            "our end reached the agent"
        );
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("carrying outlived both sides")
            .unwrap();
    }

    #[test]
    fn cluster_mode_needs_a_cluster_flag_or_the_plugin_name() {
        let none = ClusterArgs::default();
        assert!(!selects_cluster(&none, Some(OsStr::new("/usr/bin/imp"))));
        assert!(!selects_cluster(&none, None));
        assert!(selects_cluster(
            &none,
            Some(OsStr::new("/usr/local/bin/kubectl-imp"))
        ));
        assert!(selects_cluster(&none, Some(OsStr::new("kubectl-imp"))));
        assert!(!selects_cluster(&none, Some(OsStr::new("kubectl-impx"))));
        for args in [
            ClusterArgs {
                namespace: Some("d".into()),
                ..Default::default()
            },
            ClusterArgs {
                kubeconfig: Some("k".into()),
                ..Default::default()
            },
            ClusterArgs {
                context: Some("c".into()),
                ..Default::default()
            },
        ] {
            assert!(selects_cluster(&args, Some(OsStr::new("imp"))), "{args:?}");
        }
    }

    #[test]
    fn suspend_waits_for_suspended_and_resume_for_running() {
        let s = VmDesiredState::Suspended;
        assert_eq!(desired_reached(s, VmPhase::Suspended), Some(Ok(())));
        assert_eq!(desired_reached(s, VmPhase::Suspending), None);
        assert_eq!(desired_reached(s, VmPhase::Running), None);
        let r = VmDesiredState::Running;
        assert_eq!(desired_reached(r, VmPhase::Resuming), None);
        assert_eq!(desired_reached(r, VmPhase::Running), Some(Ok(())));
        let failed = desired_reached(r, VmPhase::Failed).unwrap().unwrap_err();
        assert!(failed.contains("Failed"), "{failed}");
    }

    #[test]
    fn only_a_suspend_failure_of_this_vm_since_the_request_ends_the_wait() {
        let now = Timestamp::now();
        let event = |reason: &str, uid: &str, at: Timestamp| -> Event {
            let mut e = Event {
                reason: Some(reason.into()),
                message: Some(format!("{reason} of {uid}")),
                ..Event::default()
            };
            e.involved_object.uid = Some(uid.into());
            e.metadata.creation_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at));
            e
        };
        let old = now - std::time::Duration::from_secs(30);
        let events = vec![
            event("SuspendFailed", "u1", old),
            event("SuspendFailed", "u2", now),
            event("Suspending", "u1", now),
        ];
        assert_eq!(fresh_suspend_failure(&events, "u1", now), None);
        let mut again = events.clone();
        again.push(event("SuspendFailed", "u1", now));
        assert_eq!(
            fresh_suspend_failure(&again, "u1", now).as_deref(),
            Some("SuspendFailed of u1")
        );
        // A repeated Event keeps its creation time; its series says when it was seen last.
        let mut repeated = event("SuspendFailed", "u1", old);
        repeated.series = Some(k8s_openapi::api::core::v1::EventSeries {
            count: Some(2),
            last_observed_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                now,
            )),
        });
        assert!(fresh_suspend_failure(&[repeated], "u1", now).is_some());
    }

    #[test]
    fn the_node_comes_from_status_then_spec() {
        let vm = |spec: Option<&str>, status: Option<&str>| -> ImpVM {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                "metadata": {"name": "v", "namespace": "d"},
                "spec": {"image": "x", "nodeName": spec},
                "status": {"nodeName": status},
            }))
            .unwrap()
        };
        assert_eq!(node_of(&vm(Some("a"), Some("b"))).as_deref(), Some("b"));
        assert_eq!(node_of(&vm(Some("a"), None)).as_deref(), Some("a"));
        assert_eq!(node_of(&vm(None, None)), None);
        assert_eq!(node_of(&vm(Some(""), None)), None);
    }

    #[test]
    fn the_agent_is_read_from_the_node_annotations_or_named_missing() {
        let node = |annotations: BTreeMap<String, String>| -> Node {
            let mut n = Node::default();
            n.metadata.name = Some("n1".into());
            n.metadata.annotations = Some(annotations);
            n
        };
        let both = BTreeMap::from([
            (
                ANNOTATION_AGENT_ENDPOINT.to_owned(),
                "10.0.0.1:10251".into(),
            ),
            (ANNOTATION_AGENT_CERT_SHA256.to_owned(), "ab".repeat(32)),
        ]);
        assert_eq!(
            agent_of(&node(both.clone())).unwrap(),
            ("10.0.0.1:10251".into(), "ab".repeat(32))
        );
        let mut no_fp = both;
        no_fp.remove(ANNOTATION_AGENT_CERT_SHA256);
        let err = agent_of(&node(no_fp)).unwrap_err().to_string();
        assert!(
            err.contains("n1") && err.contains(ANNOTATION_AGENT_CERT_SHA256),
            "{err}"
        );
    }

    #[test]
    fn only_token_users_are_accepted_and_others_are_told_why() {
        let mut auth = AuthInfo {
            token: Some(" abc \n".to_owned().into()),
            ..Default::default()
        };
        assert_eq!(bearer_token(&auth).unwrap(), "abc");
        let dir = std::env::temp_dir().join(format!("imp-cluster-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        auth.token = None;
        auth.token_file = Some(file.display().to_string());
        assert_eq!(bearer_token(&auth).unwrap(), "from-file");
        auth.token_file = Some(dir.join("missing").display().to_string());
        let err = format!("{:#}", bearer_token(&auth).unwrap_err());
        assert!(
            err.contains("tokenFile") && err.contains("missing"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let certs = AuthInfo {
            client_certificate: Some("c.pem".into()),
            ..Default::default()
        };
        let err = bearer_token(&certs).unwrap_err().to_string();
        assert!(
            err.contains("client certificates") && err.contains("bearer token"),
            "{err}"
        );
    }
}
