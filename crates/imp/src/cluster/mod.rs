//! The CLI against a cluster: `imp exec` and `imp console` ask the Kubernetes API server for
//! the `impvms/exec` and `impvms/console` subresources of imp's aggregated API
//! (`subresources.imp.dev`, [`gateway`]), with the kubeconfig's own credentials; the API
//! server authorizes them and proxies to the operator's gateway, which reaches the VM's node
//! agent over mutual TLS (`imp logs` reads the same console). No credential of the user
//! reaches a node. `imp suspend|resume` set the ImpVM's desired state; `imp ps` lists ImpVMs
//! ([`ps`]); `imp top` shows their guests' figures ([`top`]).
//!
//! Cluster mode is chosen when `-n/--namespace`, `--kubeconfig` or `--context` is given (or
//! `imp ps -A`), or when the binary runs as `kubectl-imp`, the kubectl plugin ([`plugin`]);
//! otherwise the commands act on the local VMs of `imp run`.
//!
//! The exec reuses the local exec's terminal, stdin and output handling unchanged: the
//! upgraded connection is spliced onto one end of a Unix socket pair, and the local code
//! speaks imp-proto on the other end as it does on a VM's vsock.

use std::ffi::OsStr;
use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use imp_api::shared::VmDesiredState;
use imp_api::vm::{ImpVM, VmPhase};
use imp_proto::message::Hello;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::args::{ClusterArgs, ConsoleArgs, ExecArgs, SuspendArgs, parse_env};
use crate::local::exec as local_exec;

pub mod gateway;
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
    let (kube, namespace) = rt.block_on(connect(&args.cluster, &args.vm, args.timeout))?;
    let namespace = &namespace;
    let upgraded = rt
        .block_on(gateway::exec(&kube, namespace, &args.vm))
        .with_context(|| format!("starting an exec in ImpVM {namespace}/{}", args.vm))?;
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
        let (kube, namespace) = connect(&args.cluster, &args.vm, Duration::from_secs(30)).await?;
        let console = gateway::console(&kube, &namespace, &args.vm, !args.no_follow)
            .await
            .with_context(|| format!("reading the console of ImpVM {namespace}/{}", args.vm))?;
        let mut out = std::io::stdout().lock();
        let mut write = |data: &[u8]| {
            out.write_all(data)
                .and_then(|()| out.flush())
                .context("writing to stdout")
        };
        match console {
            gateway::Console::Upgraded(mut stream) => {
                use tokio::io::AsyncReadExt;
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = stream
                        .read(&mut buf)
                        .await
                        .context("reading the console stream")?;
                    if n == 0 {
                        break;
                    }
                    write(&buf[..n])?;
                }
            }
            gateway::Console::Body(mut body) => {
                while let Some(frame) = body.frame().await {
                    let frame = frame.context("reading the console stream")?;
                    if let Some(data) = frame.data_ref() {
                        write(data)?;
                    }
                }
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

/// A Kubernetes client for the cluster flags, and the namespace they select; `vm` must be a
/// name that can stand in a path.
async fn connect(
    args: &ClusterArgs,
    vm: &str,
    timeout: Duration,
) -> anyhow::Result<(kube::Client, String)> {
    gateway::check_name("ImpVM", vm)?;
    let mut config = load_config(args).await?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    gateway::check_name("namespace", &namespace)?;
    config.connect_timeout = Some(timeout);
    let kube = kube::Client::try_from(config).context("building the Kubernetes client")?;
    Ok((kube, namespace))
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

pub(crate) use imp_operator::gateway::forward::node_of;

#[cfg(test)]
mod tests {
    use super::*;
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
}
