//! The agent API served for real (mutual TLS on loopback) with a scripted guest agent behind a
//! `CONNECT <port>` socket, called as the gateway (whose certificate it pins) or as a stranger:
//! what the protocol relay, the sessions and the console follower do over the wire, and every
//! refusal's status.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, StatusCode};
use http_body_util::BodyExt;
use imp_agent::api::auth::Gateway;
use imp_agent::api::sessions::SessionLimits;
use imp_agent::api::top::GuestReading;
use imp_agent::api::{AgentApi, ApiConfig, GuestEndpoint, Identity, VmLookup, Waking};
use imp_agent_api::client::{self, Caller, ClientError, Target};
use imp_agent_api::tls::{ClientIdentity, parse_fingerprint};
use imp_proto::frame::{check_len, decode, encode};
use imp_proto::message::{ExecRequest, ExitStatus, Hello, Message, WindowSize};
use imp_proto::{handshake, read_frame, write_frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PORT: u32 = 10000;

/// A fresh self-signed client certificate: the gateway's, or a stranger's.
fn client_identity() -> ClientIdentity {
    let certified = rcgen::generate_simple_self_signed(vec!["imp-gateway".to_owned()]).unwrap();
    ClientIdentity::from_der(
        certified.cert.der().to_vec(),
        certified.signing_key.serialize_der(),
    )
}

/// VMs by name in namespace "ns", how often each was asked to wake, and its open execs:
/// "sleeping" runs after its third wake, "stuck" never does, any other VM that does not run
/// never wakes; "suspending" runs but admits no exec until it was asked to wake twice.
#[derive(Default)]
struct Vms {
    endpoints: Mutex<HashMap<String, GuestEndpoint>>,
    knocks: Mutex<HashMap<String, u32>>,
    uses: Mutex<HashMap<String, i32>>,
}

impl Vms {
    fn add(&self, name: &str, endpoint: GuestEndpoint) {
        self.endpoints.lock().unwrap().insert(name.into(), endpoint);
    }

    fn knocks(&self, name: &str) -> u32 {
        self.knocks.lock().unwrap().get(name).copied().unwrap_or(0)
    }

    fn in_use(&self, name: &str) -> i32 {
        self.uses.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

impl VmLookup for Vms {
    fn find(&self, namespace: &str, name: &str) -> Option<GuestEndpoint> {
        (namespace == "ns")
            .then(|| self.endpoints.lock().unwrap().get(name).cloned())
            .flatten()
    }

    fn wake(&self, _namespace: &str, name: &str) -> Waking {
        let mut knocks = self.knocks.lock().unwrap();
        let n = knocks.entry(name.to_owned()).or_default();
        *n += 1;
        match name {
            "sleeping" => {
                if *n == 3
                    && let Some(vm) = self.endpoints.lock().unwrap().get_mut(name)
                {
                    vm.running = true;
                }
                Waking::Soon
            }
            "stuck" | "suspending" => Waking::Soon,
            _ => Waking::No,
        }
    }

    fn exec_begin(&self, _namespace: &str, name: &str) -> bool {
        if name == "suspending" && self.knocks(name) < 2 {
            return false;
        }
        *self
            .uses
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_default() += 1;
        true
    }

    fn exec_end(&self, _namespace: &str, name: &str) {
        *self
            .uses
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_default() -= 1;
    }

    fn guest_readings(&self, namespace: &str) -> Vec<GuestReading> {
        let vm = GuestReading {
            name: "vm".into(),
            uid: "uid-vm".into(),
            sampled_unix: 1,
            report: imp_proto::MetricsReport {
                memory_used_bytes: 42,
                ..Default::default()
            },
            network: None,
        };
        if namespace == "ns" {
            vec![vm]
        } else {
            Vec::new()
        }
    }
}

/// A scripted guest agent behind a `CONNECT` socket: handshake, then records every message;
/// answers an exec with `Started`, echoes stdin to stdout, and on `StdinEof` exits with 7. An
/// exec of `half-close` gets `Started` and `bye` on stdout, then the guest shuts its sending
/// side and goes on reading (and recording) until the host's side ends.
fn scripted_guest(vsock: PathBuf) -> Arc<Mutex<Vec<Message>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = UnixListener::bind(&vsock).unwrap();
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let mut stream = stream.unwrap();
            let record = record.clone();
            std::thread::spawn(move || {
                let mut line = String::new();
                BufReader::new(&mut stream).read_line(&mut line).unwrap();
                assert_eq!(line, format!("CONNECT {PORT}\n"));
                stream.write_all(b"OK 1\n").unwrap();
                handshake(&mut stream, &Hello::new("scripted-guest")).unwrap();
                let mut sending = true;
                while let Ok(Some(m)) = read_frame(&mut stream) {
                    record.lock().unwrap().push(m.clone());
                    let reply = match m {
                        Message::Exec(r) if r.argv == ["half-close"] => {
                            write_frame(&mut stream, &Message::Started { pid: 2 }).unwrap();
                            write_frame(&mut stream, &Message::Stdout(b"bye".to_vec())).unwrap();
                            stream.shutdown(std::net::Shutdown::Write).unwrap();
                            sending = false;
                            continue;
                        }
                        Message::Exec(_) => vec![Message::Started { pid: 1 }],
                        Message::Stdin(d) => vec![Message::Stdout(d)],
                        Message::StdinEof => vec![Message::Exit {
                            status: ExitStatus::Code(7),
                        }],
                        _ => vec![],
                    };
                    for r in reply.into_iter().filter(|_| sending) {
                        write_frame(&mut stream, &r).unwrap();
                    }
                }
            });
        }
    });
    seen
}

struct Env {
    api: Arc<AgentApi>,
    vms: Arc<Vms>,
    target: Target,
    /// The gateway's certificate, which the agent pins.
    gateway: ClientIdentity,
    /// Another certificate.
    stranger: ClientIdentity,
    dir: PathBuf,
    seen: Arc<Mutex<Vec<Message>>>,
}

impl Env {
    /// The gateway, calling for alice.
    fn alice(&self) -> Caller<'_> {
        Caller {
            identity: &self.gateway,
            user: "alice",
            groups: &[],
        }
    }

    /// Someone with a certificate the agent does not pin.
    fn stranger(&self) -> Caller<'_> {
        Caller {
            identity: &self.stranger,
            user: "alice",
            groups: &[],
        }
    }

    /// The SHA-256 of the gateway's certificate.
    fn gateway_digest(&self) -> [u8; 32] {
        parse_fingerprint(&self.gateway.fingerprint()).unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn env(tag: &str) -> Env {
    env_with(tag, SessionLimits::default()).await
}

async fn env_with(tag: &str, sessions: SessionLimits) -> Env {
    let dir = std::env::temp_dir().join(format!("imp-agent-api-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let seen = scripted_guest(dir.join("vsock.sock"));
    let vms = Arc::new(Vms::default());
    let endpoint = |running| GuestEndpoint {
        vsock: dir.join("vsock.sock"),
        agent_port: PORT,
        serial_log: dir.join("serial.log"),
        running,
        guest_agent: true,
    };
    vms.add("vm", endpoint(true));
    vms.add("vm2", endpoint(true));
    vms.add("suspending", endpoint(true));
    for asleep in ["sleeping", "stuck", "stopped"] {
        vms.add(asleep, endpoint(false));
    }
    let mut gone = endpoint(true);
    gone.vsock = dir.join("nothing-here.sock");
    vms.add("unreachable", gone);
    let mut agentless = endpoint(true);
    agentless.guest_agent = false;
    vms.add("agentless", agentless);
    let gateway = client_identity();
    let pins = Gateway::fixed(
        "imp-system/imp-gateway-client",
        vec![parse_fingerprint(&gateway.fingerprint()).unwrap()],
    );
    let api = AgentApi::new(
        vms.clone(),
        pins,
        ApiConfig {
            guest_connect_timeout: Duration::from_millis(300),
            console_poll: Duration::from_millis(20),
            wake_timeout: Duration::from_millis(500),
            sessions,
            ..Default::default()
        },
    );
    let identity = Identity::self_signed(&["localhost".into()]).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = Target {
        endpoint: listener.local_addr().unwrap().to_string(),
        fingerprint: identity.fingerprint().to_owned(),
    };
    tokio::spawn(api.clone().serve(
        listener,
        identity.server_config().unwrap(),
        std::future::pending(),
    ));
    Env {
        api,
        vms,
        target,
        gateway,
        stranger: client_identity(),
        dir,
        seen,
    }
}

async fn send(s: &mut client::ExecStream, m: &Message) {
    s.write_all(&encode(m).unwrap()).await.unwrap();
}

async fn recv(s: &mut client::ExecStream) -> Option<Message> {
    let mut len = [0u8; 4];
    if s.read_exact(&mut len).await.is_err() {
        return None;
    }
    let n = check_len(u32::from_be_bytes(len)).unwrap();
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).await.unwrap();
    Some(decode(&body).unwrap())
}

/// An exec stream to VM `name` whose guest agent has said hello.
async fn greeted(env: &Env, name: &str) -> client::ExecStream {
    let mut s = client::exec(&env.target, &env.alice(), "ns", name)
        .await
        .unwrap();
    send(&mut s, &Message::Hello(Hello::new("test"))).await;
    assert!(matches!(recv(&mut s).await, Some(Message::Hello(_))));
    s
}

/// The status and message of a refused exec.
fn refused(r: Result<client::ExecStream, ClientError>) -> (StatusCode, String) {
    match r {
        Err(ClientError::Refused { status, message }) => (status, message),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("the request was accepted"),
    }
}

/// Asserts a refusal's status and that its message holds every one of `words`.
fn says((status, message): (StatusCode, String), want: StatusCode, words: &[&str]) {
    assert_eq!(status, want, "{message}");
    for w in words {
        assert!(message.contains(w), "{w:?} in {message}");
    }
}

async fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_tty_exec_relays_window_stdin_resize_and_exit_and_ends_its_session() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("tty").await;
    let mut s = client::exec(&env.target, &env.alice(), "ns", "vm")
        .await
        .unwrap();
    send(&mut s, &Message::Hello(Hello::new("test"))).await;
    assert!(
        matches!(recv(&mut s).await, Some(Message::Hello(h)) if h.software == "scripted-guest")
    );
    let request = ExecRequest {
        argv: vec!["sh".into()],
        tty: true,
        window: Some(WindowSize {
            rows: 33,
            cols: 101,
        }),
        stdin: true,
        ..Default::default()
    };
    send(&mut s, &Message::Exec(request.clone())).await;
    assert_eq!(recv(&mut s).await, Some(Message::Started { pid: 1 }));
    assert_eq!(env.api.exec_sessions(), 1);
    send(
        &mut s,
        &Message::Resize(WindowSize {
            rows: 50,
            cols: 132,
        }),
    )
    .await;
    send(&mut s, &Message::Stdin(b"echo hi\n".to_vec())).await;
    assert_eq!(
        recv(&mut s).await,
        Some(Message::Stdout(b"echo hi\n".to_vec()))
    );
    send(&mut s, &Message::StdinEof).await;
    assert_eq!(
        recv(&mut s).await,
        Some(Message::Exit {
            status: ExitStatus::Code(7)
        })
    );
    drop(s);
    let seen = env.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            Message::Exec(request),
            Message::Resize(WindowSize {
                rows: 50,
                cols: 132
            }),
            Message::Stdin(b"echo hi\n".to_vec()),
            Message::StdinEof,
        ]
    );
    wait_until("the exec session is released", || {
        env.api.exec_sessions() == 0
    })
    .await;
}

#[tokio::test]
async fn a_request_other_than_exec_gets_an_error_frame_and_never_reaches_the_guest() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("notexec").await;
    let mut s = greeted(&env, "vm").await;
    send(&mut s, &Message::Shutdown { grace_ms: 0 }).await;
    match recv(&mut s).await {
        Some(Message::Error(e)) => assert!(e.message.contains("Only exec"), "{}", e.message),
        other => panic!("expected an error frame, got {other:?}"),
    }
    assert_eq!(recv(&mut s).await, None, "the connection is closed");
    assert!(
        env.seen.lock().unwrap().is_empty(),
        "the guest saw a request"
    );
}

#[tokio::test]
async fn a_followed_console_ends_when_the_caller_goes_away() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("console").await;
    std::fs::write(env.dir.join("serial.log"), b"line one\n").unwrap();
    let mut body = client::console(&env.target, &env.alice(), "ns", "vm", true)
        .await
        .unwrap();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"line one\n");
    assert_eq!(env.api.console_streams(), 1);
    {
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .open(env.dir.join("serial.log"))
            .unwrap();
        log.write_all(b"line two\n").unwrap();
    }
    let second = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&second[..], b"line two\n");
    drop(body);
    // The VM still runs and the log is quiet: only the caller's leaving ends the stream.
    wait_until("the console stream is released", || {
        env.api.console_streams() == 0
    })
    .await;
    assert!(env.vms.find("ns", "vm").unwrap().running);
}

#[tokio::test]
async fn exec_wakes_a_sleeping_vm_and_waits_for_it_or_says_why_it_cannot() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("wake").await;
    let s = greeted(&env, "sleeping").await;
    assert_eq!(env.vms.knocks("sleeping"), 3, "asked until it ran");
    assert_eq!(env.vms.in_use("sleeping"), 1, "the exec holds it awake");
    drop(s);
    wait_until("the exec's use ended", || env.vms.in_use("sleeping") == 0).await;
    // A VM whose suspend has begun: the exec waits for it, wakes it, then runs.
    let s = greeted(&env, "suspending").await;
    assert_eq!(env.vms.knocks("suspending"), 2);
    assert_eq!(env.vms.in_use("suspending"), 1);
    drop(s);
    let stuck = refused(client::exec(&env.target, &env.alice(), "ns", "stuck").await);
    says(
        stuck,
        StatusCode::GATEWAY_TIMEOUT,
        &["ns/stuck", "did not wake within 500ms"],
    );
    let stopped = refused(client::exec(&env.target, &env.alice(), "ns", "stopped").await);
    says(
        stopped,
        StatusCode::CONFLICT,
        &["ns/stopped is not running", "imp resume"],
    );
    assert_eq!(env.vms.knocks("stopped"), 1);
    assert_eq!(env.vms.in_use("stuck") + env.vms.in_use("stopped"), 0);
    // A VM without its guest agent: refused at once, naming the field, and nothing dialled.
    let agentless = refused(client::exec(&env.target, &env.alice(), "ns", "agentless").await);
    says(
        agentless,
        StatusCode::CONFLICT,
        &[
            "ns/agentless runs without its guest agent",
            "spec.guestAgent.enabled: false",
        ],
    );
    assert_eq!(env.vms.knocks("agentless"), 0);
    assert_eq!(env.vms.in_use("agentless"), 0);
    wait_until("the woken VMs' sessions ended", || {
        env.api.exec_sessions() == 0 && env.vms.in_use("suspending") == 0
    })
    .await;
}

#[tokio::test]
async fn refusals_have_their_status_and_a_message_naming_the_vm() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("refusals").await;
    let stranger = refused(client::exec(&env.target, &env.stranger(), "ns", "vm").await);
    says(stranger, StatusCode::UNAUTHORIZED, &["only imp's gateway"]);
    let missing = refused(client::exec(&env.target, &env.alice(), "ns", "missing").await);
    says(missing, StatusCode::NOT_FOUND, &["ns/missing"]);
    let unreachable = refused(client::exec(&env.target, &env.alice(), "ns", "unreachable").await);
    says(unreachable, StatusCode::BAD_GATEWAY, &["ns/unreachable"]);
    assert_eq!(
        env.vms.in_use("unreachable"),
        0,
        "a failed exec holds nothing"
    );
    assert_eq!(env.api.exec_sessions(), 0);

    // Straight into the handler: no upgrade asked, wrong method, unknown path; a bearer
    // token is refused whoever presents it.
    let gateway = env.gateway_digest();
    let call = |method: &str, path: &str, peer: Option<[u8; 32]>, token: Option<&str>| {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("imp-remote-user", "alice");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let api = env.api.clone();
        async move { api.handle(req.body(()).unwrap(), peer.as_ref()).await }
    };
    let exec = "/v1/namespaces/ns/impvms/vm/exec";
    let resp = call("POST", exec, Some(gateway), None).await;
    assert_eq!(resp.status(), StatusCode::UPGRADE_REQUIRED);
    let resp = call("POST", exec, None, None).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let resp = call("POST", exec, None, Some("a-user-token")).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("accepts no user credentials"), "{body}");
    let resp = call("POST", exec, Some(gateway), Some("a-user-token")).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let resp = call("GET", exec, Some(gateway), None).await;
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    let resp = call("GET", "/healthz", None, None).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let missing = "/v1/namespaces/ns/impvms/missing/console";
    let resp = call("GET", missing, Some([7; 32]), None).await;
    assert_eq!(
        resp.status(),
        StatusCode::UNAUTHORIZED,
        "the caller is checked before the lookup"
    );

    // A wrong pin never gets as far as HTTP.
    let mut t = env.target.clone();
    t.fingerprint = "00".repeat(32);
    match client::exec(&t, &env.alice(), "ns", "vm").await {
        Err(ClientError::Pin { detail, .. }) => {
            assert!(detail.contains(&env.target.fingerprint), "{detail}")
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a wrong pin was accepted"),
    }
}

#[tokio::test]
async fn guest_metrics_are_served_per_namespace_to_the_gateway_only() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("top").await;
    let list = client::guest_metrics(&env.target, &env.alice(), "ns")
        .await
        .unwrap();
    assert_eq!(list.namespace, "ns");
    assert_eq!(list.items.len(), 1, "{list:?}");
    assert_eq!(
        (
            list.items[0].name.as_str(),
            list.items[0].report.memory_used_bytes
        ),
        ("vm", 42)
    );
    let other = client::guest_metrics(&env.target, &env.alice(), "other")
        .await
        .unwrap();
    assert!(other.items.is_empty(), "{other:?}");
    assert!(matches!(
        client::guest_metrics(&env.target, &env.stranger(), "ns").await,
        Err(ClientError::Refused {
            status: StatusCode::UNAUTHORIZED,
            ..
        })
    ));
    assert!(
        env.seen.lock().unwrap().is_empty(),
        "reading the figures reached a guest"
    );
}

/// The guest shuts its sending side but still reads: the caller sees the end of the stream
/// (not a reset, not a hang) while what it sends still reaches the guest, and the caller ending
/// its side ends the guest's and the session.
#[tokio::test]
async fn a_guest_that_half_closes_is_half_closed_to_the_caller() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env("halfclose").await;
    let mut s = greeted(&env, "vm").await;
    let request = ExecRequest {
        argv: vec!["half-close".into()],
        stdin: true,
        ..Default::default()
    };
    send(&mut s, &Message::Exec(request.clone())).await;
    assert_eq!(recv(&mut s).await, Some(Message::Started { pid: 2 }));
    assert_eq!(recv(&mut s).await, Some(Message::Stdout(b"bye".to_vec())));
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    let end = end.expect("the guest's half-close never reached the caller");
    assert_eq!(
        end.unwrap(),
        0,
        "a clean end of stream, after nothing: {rest:?}"
    );
    // The other direction is still open, end to end, beyond the relay's linger after an exit.
    tokio::time::sleep(Duration::from_secs(6)).await;
    send(&mut s, &Message::Stdin(b"still heard".to_vec())).await;
    wait_until("the guest heard the caller after its half-close", || {
        env.seen
            .lock()
            .unwrap()
            .contains(&Message::Stdin(b"still heard".to_vec()))
    })
    .await;
    assert_eq!(env.api.exec_sessions(), 1, "the session is still open");
    // The caller ends its side: the guest sees the end, and the session is over.
    send(&mut s, &Message::StdinEof).await;
    s.shutdown().await.unwrap();
    wait_until("the session ended with both sides", || {
        env.api.exec_sessions() == 0
    })
    .await;
    let seen = env.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            Message::Exec(request),
            Message::Stdin(b"still heard".to_vec()),
            Message::StdinEof
        ]
    );
}

/// More sessions than a VM or a caller may have open are refused 429, naming the limit and
/// its flag; a console counts like an exec, and an ended session frees its place.
#[tokio::test]
async fn sessions_over_the_per_vm_or_per_caller_limit_are_refused_429() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env_with(
        "limits",
        SessionLimits {
            per_vm: 2,
            per_caller: 3,
        },
    )
    .await;
    let first = greeted(&env, "vm").await;
    let second = greeted(&env, "vm").await;
    let over_vm = refused(client::exec(&env.target, &env.alice(), "ns", "vm").await);
    says(
        over_vm,
        StatusCode::TOO_MANY_REQUESTS,
        &[
            "ImpVM ns/vm",
            "2 exec and console sessions",
            "--api-max-sessions-per-vm",
        ],
    );
    match client::console(&env.target, &env.alice(), "ns", "vm", false).await {
        Err(ClientError::Refused { status, message }) => {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{message}")
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a third session into vm was let in"),
    }
    // Alice's third session, into another VM, is within both limits; a fourth is not.
    let third = greeted(&env, "vm2").await;
    let over_caller = refused(client::exec(&env.target, &env.alice(), "ns", "vm2").await);
    says(
        over_caller,
        StatusCode::TOO_MANY_REQUESTS,
        &[
            "\"alice\"",
            "3 exec and console sessions",
            "--api-max-sessions-per-caller",
        ],
    );
    assert_eq!(env.api.exec_sessions(), 3, "the refusals opened nothing");
    // One ends: its place is free again.
    drop(first);
    wait_until("the first session ended", || env.api.exec_sessions() == 2).await;
    let again = greeted(&env, "vm").await;
    drop((second, third, again));
    wait_until("every session ended", || env.api.exec_sessions() == 0).await;
    // Unauthorized callers are refused before they count (401, not 429).
    for _ in 0..4 {
        let (status, _) = refused(client::exec(&env.target, &env.stranger(), "ns", "vm").await);
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
}
