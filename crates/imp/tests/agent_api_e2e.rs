//! End-to-end: the real `imp exec` / `imp console` binary (also as `kubectl imp exec|logs`)
//! through the Kubernetes API server, imp's gateway and the node agent's API.
//!
//! A real kube-apiserver with its aggregation layer authenticates alice and bob
//! (ServiceAccount token users with imp's user roles) and authorizes `impvms/exec` and
//! `impvms/console` of `subresources.imp.dev`, then proxies to the operator's gateway, served
//! in-process as `imp operator` serves it (with the operator's ServiceAccount). The gateway
//! finds the VM's node and calls the agent API, served in-process (TLS, self-signed, reading
//! the gateway's certificate with the agent's ServiceAccount) with a `VmLookup` whose VM is a
//! real `imp-guest` in dev mode behind a small `CONNECT <port>` shim, as a VMM's vsock socket
//! would be. The Node carries the agent's endpoint and certificate fingerprint; the ImpVM names
//! the Node in `status.nodeName`. Nothing of alice's or bob's reaches the agent: a token
//! presented to it directly is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imp_agent::api::auth::{Gateway, follow_pins};
use imp_agent::api::{AgentApi, ApiConfig, GuestEndpoint, Identity, VmLookup};
use imp_agent_api::tls::ClientIdentity;
use imp_api::shared::{ANNOTATION_AGENT_CERT_SHA256, ANNOTATION_AGENT_ENDPOINT};
use imp_api::vm::ImpVM;
use imp_proto::config::{GuestConfig, ImageConfig};
use imp_proto::message::{ExecRequest, Hello, Message};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::process::Command;

const NS: &str = "team";
const NODE: &str = "node-a";
const PORT: u32 = imp_proto::DEFAULT_API_PORT;
/// The test API server's `--request-timeout`.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// The guest binary: the static build of scripts/build-guest.sh, else a plain debug build.
fn guest_binary() -> Option<PathBuf> {
    let root = common::workspace_root();
    let found = [
        root.join("target/imp-guest/imp-guest"),
        root.join("target/debug/imp-guest"),
    ]
    .into_iter()
    .find(|p| p.is_file());
    if !imp_testenv::guard::require(
        found.is_some(),
        "target/imp-guest/imp-guest (scripts/build-guest.sh) or `cargo build -p imp-guest`",
    ) {
        return None;
    }
    found
}

/// The VMs of this "node", as the agent's runtime would report them.
#[derive(Default)]
struct Vms(Mutex<HashMap<(String, String), GuestEndpoint>>);

impl Vms {
    fn put(&self, name: &str, endpoint: GuestEndpoint) {
        self.0
            .lock()
            .unwrap()
            .insert((NS.to_owned(), name.to_owned()), endpoint);
    }

    fn set_running(&self, name: &str, running: bool) {
        if let Some(e) = self
            .0
            .lock()
            .unwrap()
            .get_mut(&(NS.to_owned(), name.to_owned()))
        {
            e.running = running;
        }
    }
}

impl VmLookup for Vms {
    fn find(&self, namespace: &str, name: &str) -> Option<GuestEndpoint> {
        self.0
            .lock()
            .unwrap()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }
}

/// A real imp-guest in dev mode, reachable through a `CONNECT <port>` shim like a VMM's vsock.
struct Guest {
    dir: PathBuf,
    child: tokio::process::Child,
}

impl Guest {
    async fn start(binary: &Path, dir: &Path) -> Guest {
        std::fs::create_dir_all(dir).unwrap();
        let config = GuestConfig {
            image: ImageConfig {
                cmd: vec!["sleep".into(), "600".into()],
                ..Default::default()
            },
            ..Default::default()
        };
        std::fs::write(dir.join("config.json"), config.to_json().unwrap()).unwrap();
        // The guest reports its workload's end here; this one never ends during the test.
        let report = std::os::unix::net::UnixListener::bind(dir.join("report.sock")).unwrap();
        std::mem::forget(report);
        // Its own words (a failed exec is only logged there) go to a file the test prints
        // when it fails.
        let log = std::fs::File::create(dir.join("guest.log")).unwrap();
        let child = Command::new(binary)
            .arg("--no-pid1")
            .arg("--config")
            .arg(dir.join("config.json"))
            .arg("--listen-unix")
            .arg(dir.join("api.sock"))
            .arg("--report-unix")
            .arg(dir.join("report.sock"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let shim = UnixListener::bind(dir.join("vsock.sock")).unwrap();
        let api = dir.join("api.sock");
        tokio::spawn(async move {
            loop {
                let (stream, _) = shim.accept().await.unwrap();
                tokio::spawn(connect_shim(stream, api.clone()));
            }
        });
        Guest {
            dir: dir.to_owned(),
            child,
        }
    }

    fn endpoint(&self, running: bool) -> GuestEndpoint {
        GuestEndpoint {
            vsock: self.dir.join("vsock.sock"),
            agent_port: PORT,
            serial_log: self.dir.join("serial.log"),
            running,
            guest_agent: true,
        }
    }
}

/// One `CONNECT <port>` connection: to the guest's API socket when the port is the agent's
/// and the guest listens, else closed without an answer (as the VMM does).
async fn connect_shim(stream: UnixStream, api: PathBuf) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).await.is_err() || line != format!("CONNECT {PORT}\n") {
        return;
    }
    let Ok(guest) = UnixStream::connect(&api).await else {
        return;
    };
    let mut host = reader.into_inner();
    if host.write_all(b"OK 1073741824\n").await.is_err() {
        return;
    }
    // Each direction on its own, as a VMM's vsock carries them: a write the guest no longer
    // takes (it closed after the exit) must not cut the other direction, whose last bytes (the
    // exit) may still be on their way. copy_bidirectional gave up on both at the first error,
    // dropping the exit about one run in ten.
    let (mut host_rx, mut host_tx) = tokio::io::split(host);
    let (mut guest_rx, mut guest_tx) = tokio::io::split(guest);
    let up = async {
        let _ = tokio::io::copy(&mut host_rx, &mut guest_tx).await;
        let _ = guest_tx.shutdown().await;
    };
    let down = async {
        let _ = tokio::io::copy(&mut guest_rx, &mut host_tx).await;
        let _ = host_tx.shutdown().await;
    };
    tokio::join!(up, down);
}

struct Env {
    kube: common::Cluster,
    _gateway: tokio::sync::watch::Sender<bool>,
    /// The agent's view of the gateway's certificates.
    pins: Arc<Gateway>,
    client: Client,
    /// kubeconfig and token of "alice-token" and "bob-token".
    users: HashMap<&'static str, (PathBuf, String)>,
    dir: PathBuf,
    vms: Arc<Vms>,
    guest: Guest,
    endpoint: String,
    fingerprint: String,
}

impl Env {
    async fn start(binary: &Path, tag: &str) -> Env {
        let dir =
            std::env::temp_dir().join(format!("imp-agent-api-e2e-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A short request timeout: a followed console must outlive it (it would be cut at
        // the API server's 60 s otherwise).
        let opts = imp_testenv::Options {
            request_timeout: Some(REQUEST_TIMEOUT),
            ..Default::default()
        };
        let kube = common::cluster_with(opts, &[NS]).await;
        let client = kube.client.clone();
        let (alice, bob) = common::exec_users(&kube, NS).await;
        let users = HashMap::from([("alice-token", alice), ("bob-token", bob)].map(|(k, p)| {
            let token = imp_testenv::kubeconfig::token_of(&p).expect("a token kubeconfig");
            (k, (p, token))
        }));
        imp_testenv::aggregation::register_gateway(&client, "imp-system", kube.gateway_port)
            .await
            .unwrap();
        let gateway =
            common::serve_gateway(&kube.cp, kube.operator_kubeconfig(), kube.gateway_port).await;
        // The agent reads the gateway's certificate with its own ServiceAccount, as in a
        // cluster.
        let agent_client = kube
            .cp
            .client_from(&kube.agent_kubeconfig_for(NODE).await)
            .await
            .unwrap();
        let pins = Gateway::reading(agent_client, "imp-system/imp-gateway-client");
        tokio::spawn(follow_pins(pins.clone(), std::future::pending()));

        let guest = Guest::start(binary, &dir.join("vm1")).await;
        let vms = Arc::new(Vms::default());
        vms.put("vm1", guest.endpoint(true));
        vms.put("stopped", guest.endpoint(false));

        let identity = Identity::self_signed(&["127.0.0.1".into()]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        let api = AgentApi::new(
            vms.clone(),
            pins.clone(),
            ApiConfig {
                console_poll: Duration::from_millis(50),
                ..Default::default()
            },
        );
        tokio::spawn(api.serve(
            listener,
            identity.server_config().unwrap(),
            std::future::pending(),
        ));

        common::wait_gateway(&client).await;
        let env = Env {
            kube,
            _gateway: gateway,
            pins,
            client,
            users,
            dir,
            vms,
            guest,
            endpoint,
            fingerprint: identity.fingerprint().to_owned(),
        };
        env.node(&env.fingerprint.clone()).await;
        for name in ["vm1", "stopped", "ghost"] {
            env.vm(name).await;
        }
        env
    }

    /// Creates or updates the Node with the agent's annotations.
    async fn node(&self, fingerprint: &str) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let annotations = BTreeMap::from([
            (ANNOTATION_AGENT_ENDPOINT.to_owned(), self.endpoint.clone()),
            (
                ANNOTATION_AGENT_CERT_SHA256.to_owned(),
                fingerprint.to_owned(),
            ),
        ]);
        let patch = json!({"metadata": {"annotations": annotations}});
        if nodes.get_opt(NODE).await.unwrap().is_none() {
            let n: Node = serde_json::from_value(json!({"metadata": {"name": NODE}})).unwrap();
            nodes.create(&PostParams::default(), &n).await.unwrap();
        }
        nodes
            .patch(NODE, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// An ImpVM placed on the node (status.nodeName, as the operator writes it).
    async fn vm(&self, name: &str) {
        let api: Api<ImpVM> = Api::namespaced(self.client.clone(), NS);
        let vm: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"image": "busybox:latest", "classRef": {"name": "small"}}
        }))
        .unwrap();
        api.create(&PostParams::default(), &vm).await.unwrap();
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"nodeName": NODE}})),
        )
        .await
        .unwrap();
    }

    /// The kubeconfig of user `name` ("alice-token", "bob-token").
    fn kubeconfig(&self, name: &str) -> PathBuf {
        self.users[name].0.clone()
    }

    /// The bearer token of user `name`, or `name` itself when it is no user's (a bad token).
    fn token(&self, name: &str) -> String {
        self.users
            .get(name)
            .map_or_else(|| name.to_owned(), |u| u.1.clone())
    }

    /// Runs the real `imp` with a kubeconfig for `token`.
    async fn imp(&self, token: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp"));
        cmd.args(args)
            .env("KUBECONFIG", self.kubeconfig(token))
            .env_remove("IMP_STATE_DIR")
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap();
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().unwrap();
            pipe.write_all(input).await.unwrap();
            drop(pipe);
        }
        tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("imp did not finish within 60 s")
            .unwrap()
    }

    fn marker(&self, name: &str) -> PathBuf {
        self.dir.join(format!("ran-{name}"))
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = self.guest.child.start_kill();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.guest.dir.join("guest.log"));
            eprintln!("--- the guest's log ---\n{}", log.unwrap_or_default());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Follows vm1's console through the API server as a plain streamed answer and asserts the
/// API server ends it soon after its request timeout, while the VM still runs.
async fn cut_by_the_request_timeout(env: &Env) {
    use http_body_util::BodyExt;
    let req = http::Request::get(format!(
        "/apis/subresources.imp.dev/v1alpha1/namespaces/{NS}/impvms/vm1/console?follow=true"
    ))
    .body(kube::client::Body::empty())
    .unwrap();
    let t0 = std::time::Instant::now();
    let resp = env.client.send(req).await.unwrap();
    assert_eq!(resp.status(), http::StatusCode::OK);
    let mut body = resp.into_body();
    let ended = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(10), async {
        while let Some(Ok(_)) = body.frame().await {}
    })
    .await;
    assert!(
        ended.is_ok() && t0.elapsed() >= REQUEST_TIMEOUT,
        "a plain followed console was not cut at the request timeout (after {:?})",
        t0.elapsed()
    );
}

/// Who a hand-made request to the agent comes as.
enum As<'a> {
    /// A gateway: a client certificate published in the gateway's ConfigMap (as an operator
    /// replica publishes its own, whose key never leaves it), and a user header.
    Gateway(&'a ClientIdentity),
    /// A user presenting their bearer token to the agent directly.
    UserToken(&'a str),
    /// Nobody: no certificate, no token.
    Nobody,
}

/// A client certificate of the test's, published in the gateway's ConfigMap as a replica
/// publishes its own, once the agent pins it.
async fn published_identity(env: &Env) -> ClientIdentity {
    use imp_operator::gateway::identity;
    let (id, cert) = identity::generate().unwrap();
    let key = identity::entry_key("test-control", 1);
    identity::publish(&env.client, "imp-system", &key, &cert)
        .await
        .unwrap();
    let digest = imp_agent_api::tls::parse_fingerprint(&id.fingerprint()).unwrap();
    let pins = env.pins.clone();
    common::wait_for(
        "the agent to pin the published certificate",
        Duration::from_secs(30),
        || {
            let pins = pins.clone();
            async move {
                pins.read().await;
                pins.knows(&digest).then_some(())
            }
        },
    )
    .await;
    id
}

/// Sends an exec request to the agent by hand, with a hello and an exec that would create
/// `marker` pipelined behind it, so an upgrade that should not happen would run it. Returns the
/// status line and the answer's text.
///
/// The control (as the gateway) proves the pipelined exec really runs when allowed.
async fn raw_exec(env: &Env, who: As<'_>, marker: &Path) -> (String, String) {
    let tcp = TcpStream::connect(&env.endpoint).await.unwrap();
    let config = match who {
        As::Gateway(id) => id.pinned_config(&env.fingerprint).unwrap(),
        // A caller with no certificate of its own, pinning the agent's as the CLI once did.
        As::UserToken(_) | As::Nobody => {
            Arc::new(no_client_auth(Server(Some(env.fingerprint.clone()))))
        }
    };
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let (rx, mut tx) = tokio::io::split(tls);
    let who = match who {
        As::Gateway(_) => "imp-remote-user: alice\r\n".to_owned(),
        As::UserToken(t) => format!("Authorization: Bearer {}\r\n", env.token(t)),
        As::Nobody => String::new(),
    };
    let head = format!(
        "POST /v1/namespaces/{NS}/impvms/vm1/exec HTTP/1.1\r\nHost: {}\r\n\
         Connection: Upgrade\r\nUpgrade: imp-exec/1\r\n{who}\r\n",
        env.endpoint
    );
    tx.write_all(&pipelined_exec(head, marker)).await.unwrap();
    answer_of(rx).await
}

/// An exec sent to the gateway's listener directly, as the API server's front proxy would send
/// it but without its client certificate, claiming to be alice of system:masters, with a
/// command that would create `marker` pipelined behind it. Returns the status line and the
/// answer.
async fn forged_front_proxy(
    env: &Env,
    marker: &Path,
    client_cert: Option<(String, String)>,
) -> (String, String) {
    use rustls::pki_types::pem::PemObject;
    let tcp = TcpStream::connect(("127.0.0.1", env.kube.gateway_port))
        .await
        .unwrap();
    let config = match client_cert {
        None => no_client_auth(Server(None)),
        Some((cert, key)) => {
            let mut c = rustls::ClientConfig::builder()
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Server(None)))
                .with_client_auth_cert(
                    vec![
                        rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes()).unwrap(),
                    ],
                    rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap();
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            c
        }
    };
    let Ok(tls) = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
    else {
        return ("the handshake was refused".to_owned(), String::new());
    };
    let (rx, mut tx) = tokio::io::split(tls);
    let head = format!(
        "POST /apis/subresources.imp.dev/v1alpha1/namespaces/{NS}/impvms/vm1/exec HTTP/1.1\r\n\
         Host: imp-webhook.imp-system.svc\r\nConnection: Upgrade\r\nUpgrade: imp-exec/1\r\n\
         X-Remote-User: alice\r\nX-Remote-Group: system:masters\r\n\r\n"
    );
    // A refused client certificate may end the connection at the first write.
    let _ = tx.write_all(&pipelined_exec(head, marker)).await;
    answer_of(rx).await
}

/// The admin's client certificate and key (PEM), signed by the cluster's CA: a certificate the
/// API server trusts from its clients, but not the front proxy's.
fn admin_certificate(env: &Env) -> (String, String) {
    let text = std::fs::read_to_string(env.kube.admin_kubeconfig()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let pem = |field: &str| {
        let b64 = v["users"][0]["user"][field].clone();
        let bytes: k8s_openapi::ByteString = serde_json::from_value(b64).unwrap();
        String::from_utf8(bytes.0).unwrap()
    };
    (pem("client-certificate-data"), pem("client-key-data"))
}

/// A test caller's check of the server: the certificate with this fingerprint (the agent's),
/// or any (the forged caller does not care whom it talks to).
#[derive(Debug)]
struct Server(Option<String>);

impl rustls::client::danger::ServerCertVerifier for Server {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if let Some(pin) = &self.0 {
            assert_eq!(&imp_agent_api::tls::fingerprint(end_entity), pin);
        }
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        imp_agent_api::tls::Signatures::default().schemes()
    }
}

/// A TLS client configuration that checks the server with `server` and presents none.
fn no_client_auth(server: Server) -> rustls::ClientConfig {
    let mut c = rustls::ClientConfig::builder()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(server))
        .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    c
}

/// An exec request's head (`head`, ending in its blank line) with a hello and an exec that
/// would create `marker` pipelined behind it, so an upgrade that should not happen would run
/// it.
fn pipelined_exec(head: String, marker: &Path) -> Vec<u8> {
    let mut request = head.into_bytes();
    request.extend(imp_proto::frame::encode(&Message::Hello(Hello::new("raw"))).unwrap());
    let exec = ExecRequest {
        argv: vec![
            "sh".into(),
            "-c".into(),
            format!("touch {}", marker.display()),
        ],
        ..Default::default()
    };
    request.extend(imp_proto::frame::encode(&Message::Exec(exec)).unwrap());
    request
}

/// What the server answers within two seconds (the connection is kept open meanwhile: a
/// hang-up would kill an exec that wrongly started): the status line and the whole text.
async fn answer_of(mut rx: impl tokio::io::AsyncRead + Unpin) -> (String, String) {
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), rx.read_to_end(&mut answer)).await;
    let answer = text(&answer);
    (answer.lines().next().unwrap_or("").to_owned(), answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_exec_and_console_through_the_api_server_and_the_gateway() {
    let Some(binary) = guest_binary() else {
        return;
    };
    if common::control_plane_ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = Env::start(&binary, "stream").await;

    // exec: output, exit code.
    let out = env
        .imp(
            "alice-token",
            &[
                "exec",
                "-n",
                NS,
                "vm1",
                "--",
                "sh",
                "-c",
                "echo hi; echo oops >&2; exit 3",
            ],
            None,
        )
        .await;
    assert_eq!(out.status.code(), Some(3), "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hi\n");
    assert!(text(&out.stderr).contains("oops"), "{}", text(&out.stderr));

    // A figure, not a limit: the whole `imp exec -- true` (process start, kubeconfig, TLS to the
    // API server, its proxy to the gateway, the gateway's mutual TLS to the agent, the guest).
    let mut took = Vec::new();
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        let out = env
            .imp(
                "alice-token",
                &["exec", "-n", NS, "vm1", "--", "true"],
                None,
            )
            .await;
        assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
        took.push(t0.elapsed());
    }
    took.sort();
    eprintln!(
        "imp exec -- true through the API server and the gateway: median {:?} (min {:?}, max {:?})",
        took[2], took[0], took[4]
    );

    // exec -i: stdin reaches the command and its end closes the command's stdin.
    let out = env
        .imp(
            "alice-token",
            &[
                "exec",
                "-i",
                "-n",
                NS,
                "vm1",
                "--",
                "sh",
                "-c",
                "tr a-z A-Z; echo done",
            ],
            Some(b"hello\nworld\n"),
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "HELLO\nWORLD\ndone\n");

    // exec -t: the command gets a terminal (whose line discipline turns \n into \r\n).
    let out = env
        .imp(
            "alice-token",
            &[
                "exec",
                "-t",
                "-n",
                NS,
                "vm1",
                "--",
                "sh",
                "-c",
                "test -t 1 && echo tty",
            ],
            None,
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "tty\r\n");

    // console without follow: what the log has.
    let log = env.guest.endpoint(true).serial_log;
    std::fs::write(&log, "[    0.1] Linux booting\nworkload says hi\n").unwrap();
    let out = env
        .imp(
            "alice-token",
            &["console", "-n", NS, "vm1", "--no-follow"],
            None,
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "[    0.1] Linux booting\nworkload says hi\n"
    );

    // The same through kubectl, with imp linked as its plugin: `--` and the command's exit
    // code pass through kubectl; logs is the console without following.
    if let Some(plugin) = common::plugin::Plugin::install("agent-api") {
        let kubectl_imp = |args: &[&str]| {
            let mut cmd = plugin.kubectl(&[&["imp"], args].concat());
            cmd.env("KUBECONFIG", env.kubeconfig("alice-token"));
            common::output_within(cmd.into(), Duration::from_secs(60), "kubectl imp")
        };
        let out = kubectl_imp(&[
            "exec",
            "vm1",
            "-n",
            NS,
            "--",
            "sh",
            "-c",
            "echo via kubectl; exit 4",
        ])
        .await;
        assert_eq!(out.status.code(), Some(4), "stderr: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), "via kubectl\n");
        let out = kubectl_imp(&["logs", "vm1", "-n", NS]).await;
        assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
        assert_eq!(
            text(&out.stdout),
            "[    0.1] Linux booting\nworkload says hi\n"
        );
    }

    // console following: appended bytes arrive, also after the API server's request timeout
    // (the stream is an upgraded connection, which the timeout does not cut), and the stream
    // ends when the VM stops.
    let follower = {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp"));
        cmd.args(["console", "-n", NS, "vm1"])
            .env("KUBECONFIG", env.kubeconfig("alice-token"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd.spawn().unwrap()
    };
    tokio::time::sleep(REQUEST_TIMEOUT + Duration::from_secs(2)).await;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(b"appended later\n").unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.vms.set_running("vm1", false);
    let out = tokio::time::timeout(Duration::from_secs(20), follower.wait_with_output())
        .await
        .expect("a followed console did not end when the VM stopped")
        .unwrap();
    env.vms.set_running("vm1", true);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).ends_with("workload says hi\nappended later\n"),
        "{}",
        text(&out.stdout)
    );
    // The control: the same followed console as a plain streamed answer (no upgrade) is cut
    // by the request timeout although the VM runs on.
    cut_by_the_request_timeout(&env).await;

    // A VM that does not run: exec is refused with 409, console still works.
    let out = env
        .imp(
            "alice-token",
            &["exec", "-n", NS, "stopped", "--", "true"],
            None,
        )
        .await;
    assert_ne!(out.status.code(), Some(0));
    let err = text(&out.stderr);
    assert!(err.contains("409") && err.contains("not running"), "{err}");
    let out = env
        .imp(
            "alice-token",
            &["console", "-n", NS, "stopped", "--no-follow"],
            None,
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains("workload says hi"));

    // An ImpVM the agent does not have: 404 naming it.
    let out = env
        .imp(
            "alice-token",
            &["exec", "-n", NS, "ghost", "--", "true"],
            None,
        )
        .await;
    let err = text(&out.stderr);
    assert!(
        out.status.code() != Some(0) && err.contains("404") && err.contains("team/ghost"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_user_a_token_presented_to_the_agent_or_a_wrong_certificate_run_nothing() {
    let Some(binary) = guest_binary() else {
        return;
    };
    if common::control_plane_ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = Env::start(&binary, "refuse").await;

    // The control: the same raw request with a published certificate does run (so the markers
    // below would appear if the checks let the requests through).
    let control = env.marker("control");
    let published = published_identity(&env).await;
    let (status, _) = raw_exec(&env, As::Gateway(&published), &control).await;
    assert!(status.contains(" 101 "), "{status}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !control.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the control exec never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A user's token presented to the agent directly, even alice's (who may exec through the
    // API server), is refused: no user credential is accepted on a node.
    let token = env.marker("user-token");
    let (status, answer) = raw_exec(&env, As::UserToken("alice-token"), &token).await;
    assert!(status.contains(" 401 "), "{status}");
    assert!(answer.contains("accepts no user credentials"), "{answer}");
    let nobody = env.marker("nobody");
    let (status, answer) = raw_exec(&env, As::Nobody, &nobody).await;
    assert!(status.contains(" 401 "), "{status}");
    assert!(answer.contains("only imp's gateway"), "{answer}");

    // The gateway serves the API server's front proxy only: a caller without its client
    // certificate, naming any user it likes, is refused before anything is looked up.
    let forged = env.marker("forged-front-proxy");
    let (status, answer) = forged_front_proxy(&env, &forged, None).await;
    assert!(status.contains(" 401 "), "{status}");
    assert!(answer.contains("front proxy only"), "{answer}");
    // With a certificate of the cluster's own CA (the admin's), which is not the front
    // proxy's: the handshake or the request is refused.
    let other_ca = env.marker("other-ca");
    let (status, _) = forged_front_proxy(&env, &other_ca, Some(admin_certificate(&env))).await;
    assert!(
        !status.contains(" 101 ") && !status.contains(" 200 "),
        "{status}"
    );

    // bob is a valid user without the rule: the API server refuses him with 403.
    let denied = env.marker("denied-cli");
    let touch = format!("touch {}", denied.display());
    let out = env
        .imp(
            "bob-token",
            &["exec", "-n", NS, "vm1", "--", "sh", "-c", &touch],
            None,
        )
        .await;
    assert_ne!(out.status.code(), Some(0));
    let err = text(&out.stderr);
    assert!(
        err.contains("403") && err.contains("bob") && err.contains("impvms/exec"),
        "{err}"
    );
    let out = env
        .imp(
            "bob-token",
            &["console", "-n", NS, "vm1", "--no-follow"],
            None,
        )
        .await;
    assert_ne!(out.status.code(), Some(0));
    let err = text(&out.stderr);
    assert!(
        err.contains("403") && err.contains("impvms/console"),
        "{err}"
    );

    // A Node that pins another certificate: the gateway refuses the agent's.
    let other = Identity::self_signed(&["elsewhere".into()]).unwrap();
    env.node(other.fingerprint()).await;
    let pinned = env.marker("wrong-cert");
    let touch = format!("touch {}", pinned.display());
    let out = env
        .imp(
            "alice-token",
            &["exec", "-n", NS, "vm1", "--", "sh", "-c", &touch],
            None,
        )
        .await;
    assert_ne!(out.status.code(), Some(0));
    let err = text(&out.stderr);
    assert!(
        err.contains("another certificate") && err.contains(other.fingerprint()),
        "{err}"
    );

    // Give anything wrongly started time to show, then prove nothing ran.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for m in [&token, &nobody, &forged, &other_ca, &denied, &pinned] {
        assert!(!m.exists(), "{} exists: a refused request ran", m.display());
    }
}
