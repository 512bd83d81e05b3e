//! The agent API served for real (mutual TLS on loopback) with a scripted guest agent behind a
//! `CONNECT <port>` socket, called as the gateway (whose certificate it pins) or as a stranger:
//! what the protocol relay, the sessions and the console follower do over the wire, and every
//! refusal's status. Then a VM's files moved to it by the sender of `imp-agent-api` as a source
//! node's agent would (its own agent certificate, the move's token, a [`MoveAuthority`] fake
//! that knows one move): sparse files arriving with their holes, a cut transfer resumed, the
//! digests checked, the refusals, and the bandwidth cap.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use imp_agent::api::auth::Gateway;
use imp_agent::api::moves::Admission;
use imp_agent::api::sessions::SessionLimits;
use imp_agent::api::top::GuestReading;
use imp_agent::api::{
    AgentApi, ApiConfig, GuestEndpoint, Identity, IncomingMove, MoveAuthority, MoveReceiver,
    MoveRefusal, Moves, VmLookup, Waking,
};
use imp_agent_api::client::{self, Caller, ClientError, Target};
use imp_agent_api::moves::{MoveConnection, MoveSendError, MoveTo, Sent, send_files};
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
    env_full(tag, sessions, None).await
}

/// The directory of test `tag`'s environment (made anew by [`env_full`], removed with it).
fn env_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("imp-agent-api-{tag}-{}", std::process::id()))
}

async fn env_full(tag: &str, sessions: SessionLimits, moves: Option<MoveReceiver>) -> Env {
    let dir = env_dir(tag);
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
    let config = ApiConfig {
        guest_connect_timeout: Duration::from_millis(300),
        console_poll: Duration::from_millis(20),
        wake_timeout: Duration::from_millis(500),
        sessions,
        ..Default::default()
    };
    let api = match moves {
        Some(moves) => AgentApi::with_moves(vms.clone(), pins, moves, config),
        None => AgentApi::new(vms.clone(), pins, config),
    };
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
        async move {
            api.handle(req.body(Empty::<Bytes>::new()).unwrap(), peer.as_ref())
                .await
        }
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

// ---- Moves: a VM's files sent by a source node's agent ----

/// The move's token in the fake authority.
const TOKEN: &str = "move-token-0123456789";

/// The uid of VM ns/vm, which the fake authority says moves here.
const UID: &str = "5b0e7f3c-1d2a-4c5b-9e8f-0a1b2c3d4e5f";

const MIB: u64 = 1 << 20;

/// The fake [`MoveAuthority`]: VM ns/vm moves here from node-a with [`TOKEN`], sent by the
/// agent whose certificate has SHA-256 `source`; any other VM does not exist.
struct OneMove {
    source: [u8; 32],
}

impl MoveAuthority for OneMove {
    fn admit<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        token: &'a str,
        peer_cert_sha256: &'a [u8; 32],
    ) -> Admission<'a> {
        Box::pin(async move {
            if (namespace, name) != ("ns", "vm") {
                return Err(MoveRefusal::UnknownVm(format!("{namespace}/{name}")));
            }
            if token != TOKEN {
                return Err(MoveRefusal::Forbidden(
                    "the token is not ImpVM ns/vm's move token".into(),
                ));
            }
            if *peer_cert_sha256 != self.source {
                return Err(MoveRefusal::Forbidden(format!(
                    "the caller's certificate ({}) is not the one node node-a publishes",
                    imp_agent_api::tls::hex(peer_cert_sha256)
                )));
            }
            Ok(IncomingMove {
                uid: UID.into(),
                source_node: "node-a".into(),
            })
        })
    }
}

/// An agent API receiving moves, the source agent's certificate, and a directory of files to
/// send.
struct MoveEnv {
    env: Env,
    moves: Arc<Moves>,
    /// The source node's agent certificate, as a client's.
    source: ClientIdentity,
    /// Where the files to send are.
    src: PathBuf,
}

impl MoveEnv {
    fn to<'a>(&'a self, identity: &'a ClientIdentity, token: &'a str) -> MoveTo<'a> {
        MoveTo {
            target: &self.env.target,
            identity,
            namespace: "ns",
            name: "vm",
            token,
        }
    }

    /// The source agent moving ns/vm with the right token.
    fn source(&self) -> MoveTo<'_> {
        self.to(&self.source, TOKEN)
    }

    fn source_digest(&self) -> [u8; 32] {
        parse_fingerprint(&self.source.fingerprint()).unwrap()
    }
}

async fn move_env(tag: &str) -> MoveEnv {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let source_agent = Identity::self_signed(&["node-a".into()]).unwrap();
    let source = source_agent.client_identity();
    let moves = Moves::new(env_dir(tag).join("moves"));
    let authority = Arc::new(OneMove {
        source: parse_fingerprint(source_agent.fingerprint()).unwrap(),
    });
    let receiver = MoveReceiver::new(authority, moves.clone());
    let env = env_full(tag, SessionLimits::default(), Some(receiver)).await;
    let src = env.dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    MoveEnv {
        env,
        moves,
        source,
        src,
    }
}

/// The data extents of [`sparse_disk`]: (offset, length) in MiB.
const EXTENTS: [(u64, u64); 4] = [(0, 8), (16, 8), (40, 6), (60, 4)];

/// A 64 MiB file holding data only in [`EXTENTS`] (a pattern that differs at every offset),
/// holes elsewhere; its data bytes.
fn sparse_disk(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(64 * MIB).unwrap();
    for (start, len) in EXTENTS {
        let (start, len) = (start * MIB, len * MIB);
        let data: Vec<u8> = (start..start + len)
            .map(|i| (i % 251) as u8 ^ (i >> 20) as u8)
            .collect();
        f.write_all_at(&data, start).unwrap();
    }
    f.sync_all().unwrap();
    EXTENTS.iter().map(|(_, len)| len * MIB).sum()
}

/// The data bytes of [`sparse_disk`] at or past `from`.
fn data_from(from: u64) -> u64 {
    EXTENTS
        .iter()
        .map(|&(start, len)| ((start + len) * MIB).saturating_sub((start * MIB).max(from)))
        .sum()
}

/// The VM's two files: a sparse disk and a small state file; the disk's data bytes.
fn vm_files(src: &std::path::Path) -> (Vec<(String, PathBuf)>, u64) {
    let disk = src.join("disk.img");
    let data = sparse_disk(&disk);
    let state = src.join("state.json");
    std::fs::write(&state, br#"{"vm":"ns/vm","paused":true}"#).unwrap();
    (
        vec![("disk.img".into(), disk), ("state.json".into(), state)],
        data,
    )
}

/// Asserts every file of `files` is in `dir` byte for byte, and that the disk's holes are
/// holes there too (allocated blocks hardly more than its data).
fn arrived(dir: &std::path::Path, files: &[(String, PathBuf)], disk_data: u64) {
    use std::os::unix::fs::MetadataExt;
    for (name, path) in files {
        let there = dir.join(name);
        assert_eq!(
            std::fs::read(path).unwrap(),
            std::fs::read(&there).unwrap(),
            "{name} differs"
        );
    }
    let disk = std::fs::metadata(dir.join("disk.img")).unwrap();
    let allocated = disk.blocks() * 512;
    println!(
        "disk.img on the target: {} MiB long, {} MiB allocated, {} MiB of data",
        disk.len() / MIB,
        allocated / MIB,
        disk_data / MIB
    );
    assert_eq!(disk.len(), 64 * MIB);
    assert!(
        allocated <= disk_data + MIB,
        "{allocated} bytes allocated for {disk_data} of data: the holes were filled"
    );
}

/// A TCP proxy to `to` for one connection that forwards the first `limit` bytes the client
/// sends, then cuts: the client's side is closed at once (it is sending: a reset), the
/// server's is shut for writing (it reads an end inside the body), and what the server still
/// says is read and dropped until it closes.
async fn cutting_proxy(to: String, limit: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut client, _) = listener.accept().await.unwrap();
        let mut server = tokio::net::TcpStream::connect(&to).await.unwrap();
        let mut left = limit;
        let (mut up, mut down) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
        loop {
            tokio::select! {
                n = client.read(&mut up) => {
                    let n = n.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    let take = n.min(left);
                    server.write_all(&up[..take]).await.unwrap();
                    left -= take;
                    if left == 0 {
                        break;
                    }
                }
                n = server.read(&mut down) => {
                    let n = n.unwrap_or(0);
                    if n == 0 || client.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
        drop(client);
        let _ = server.shutdown().await;
        let mut rest = Vec::new();
        let _ = server.read_to_end(&mut rest).await;
    });
    addr
}

/// The status and message of a refused move.
fn move_refused(r: Result<Sent, MoveSendError>) -> (StatusCode, String) {
    match r {
        Err(MoveSendError::Refused {
            status, message, ..
        }) => (status, message),
        Err(e) => panic!("unexpected error {}", imp_api::chain::chain(&e)),
        Ok(s) => panic!("the move was accepted: {s:?}"),
    }
}

#[tokio::test]
async fn a_sparse_disk_and_a_small_file_arrive_byte_identical_with_their_holes() {
    let m = move_env("move-whole").await;
    let (files, disk_data) = vm_files(&m.src);
    let started = Instant::now();
    let sent = send_files(&m.source(), &files, None).await.unwrap();
    let state_len = std::fs::metadata(&files[1].1).unwrap().len();
    println!(
        "sent {} bytes of 64 MiB + {state_len} in {:?}",
        sent.bytes_sent,
        started.elapsed()
    );
    assert_eq!(
        sent.bytes_sent,
        disk_data + state_len,
        "only the data is sent"
    );
    assert_eq!(
        sent.files
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>(),
        ["disk.img", "state.json"]
    );
    assert_eq!(
        sent.files[0].sha256,
        imp_agent_api::moves::sha256_file(&files[0].1).unwrap().1
    );
    let dir = m.moves.received(UID).expect("the move is complete");
    arrived(&dir, &files, disk_data);
    assert!(!m.moves.incoming(UID).exists(), "incoming became received");
    // Sent again (its answer lost, say): nothing is sent, and the target agrees.
    let again = send_files(&m.source(), &files, None).await.unwrap();
    assert_eq!(again.bytes_sent, 0);
    assert_eq!(again.files, sent.files);
}

#[tokio::test]
async fn a_cut_transfer_resumes_where_the_target_acknowledged() {
    let m = move_env("move-cut").await;
    let (files, disk_data) = vm_files(&m.src);
    let proxy = cutting_proxy(m.env.target.endpoint.clone(), 12 << 20).await;
    let through_proxy = Target {
        endpoint: proxy,
        fingerprint: m.env.target.fingerprint.clone(),
    };
    let to = MoveTo {
        target: &through_proxy,
        ..m.source()
    };
    let err = send_files(&to, &files, None).await.unwrap_err();
    println!("cut: {}", imp_api::chain::chain(&err));
    let MoveSendError::Cut { file, offset, .. } = &err else {
        panic!("not a cut: {}", imp_api::chain::chain(&err));
    };
    assert_eq!(file, "disk.img");
    assert!(*offset > 0 && *offset < 64 * MIB, "{offset}");
    assert!(err.to_string().contains("disk.img") && err.to_string().contains(&offset.to_string()));
    // What the target acknowledged (its answer waits for the cut request's last whole frames).
    let mut conn = MoveConnection::open(&m.source()).await.unwrap();
    let held = conn.held("disk.img").await.unwrap();
    println!(
        "the target holds disk.img up to {} MiB",
        held.received / MIB
    );
    assert_eq!(held.size, Some(64 * MIB));
    assert!(
        held.received >= 4 * MIB,
        "whole frames before the cut were kept: {held:?}"
    );
    assert!(held.received < 64 * MIB, "{held:?}");
    drop(conn);
    // Resumed: only the rest is sent.
    let resumed = send_files(&m.source(), &files, None).await.unwrap();
    let state_len = std::fs::metadata(&files[1].1).unwrap().len();
    println!(
        "resumed: {} of {} data bytes sent again",
        resumed.bytes_sent,
        disk_data + state_len
    );
    assert!(resumed.bytes_sent < 64 * MIB);
    assert_eq!(resumed.bytes_sent, data_from(held.received) + state_len);
    assert!(resumed.bytes_sent < disk_data);
    arrived(&m.moves.received(UID).unwrap(), &files, disk_data);
}

#[tokio::test]
async fn a_wrong_token_a_strangers_certificate_or_another_vm_is_refused_and_nothing_is_written() {
    let m = move_env("move-refused").await;
    let (files, _) = vm_files(&m.src);
    let (status, message) = move_refused(send_files(&m.to(&m.source, "wrong"), &files, None).await);
    assert_eq!(status, StatusCode::FORBIDDEN, "{message}");
    assert!(message.contains("move token"), "{message}");
    // The gateway's certificate, or anybody else's: not the source node's.
    for identity in [&m.env.gateway, &m.env.stranger] {
        let (status, message) =
            move_refused(send_files(&m.to(identity, TOKEN), &files, None).await);
        assert_eq!(status, StatusCode::FORBIDDEN, "{message}");
        assert!(
            message.contains("not the one node node-a publishes"),
            "{message}"
        );
    }
    let other = MoveTo {
        name: "other",
        ..m.source()
    };
    let (status, message) = move_refused(send_files(&other, &files, None).await);
    assert_eq!(status, StatusCode::NOT_FOUND, "{message}");
    assert!(
        !m.moves.root().exists(),
        "a refused caller had something written"
    );

    // Straight into the handler: no token, a bearer token, no certificate are 401.
    let path = "/v1/moves/ns/vm/files/disk.img";
    let call = |token: Option<&str>, bearer: bool, peer: Option<[u8; 32]>| {
        let mut req = Request::builder().method("GET").uri(path);
        if let Some(t) = token {
            req = req.header(imp_agent_api::moves::TOKEN_HEADER, t);
        }
        if bearer {
            req = req.header("authorization", "Bearer abc");
        }
        let api = m.env.api.clone();
        async move {
            api.handle(req.body(Empty::<Bytes>::new()).unwrap(), peer.as_ref())
                .await
        }
    };
    let source = Some(m.source_digest());
    assert_eq!(
        call(Some(TOKEN), false, source).await.status(),
        StatusCode::OK
    );
    for (token, bearer, peer) in [
        (None, false, source),
        (Some(TOKEN), true, source),
        (Some(TOKEN), false, None),
    ] {
        let resp = call(token, bearer, peer).await;
        assert_eq!(
            resp.status(),
            StatusCode::UNAUTHORIZED,
            "{token:?} {bearer} {peer:?}"
        );
    }
    assert!(!m.moves.root().exists());

    // An agent API given no moves has no such endpoints.
    let plain = env("move-none").await;
    let req = Request::builder()
        .uri(path)
        .header(imp_agent_api::moves::TOKEN_HEADER, TOKEN)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = plain.api.clone().handle(req, source.as_ref()).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("receives no VM moves"));
}

#[tokio::test]
async fn a_file_changed_on_the_target_before_done_is_refused_422_by_name_then_sent_anew() {
    let m = move_env("move-tamper").await;
    let (files, disk_data) = vm_files(&m.src);
    let mut conn = MoveConnection::open(&m.source()).await.unwrap();
    for (name, path) in &files {
        let held = conn.held(name).await.unwrap();
        conn.send_file(name, path, held, None).await.unwrap();
    }
    // One byte changed in the target's incoming copy.
    {
        use std::os::unix::fs::FileExt;
        let copy = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.moves.incoming(UID).join("disk.img"))
            .unwrap();
        let mut byte = [0u8; 1];
        copy.read_exact_at(&mut byte, 17 * MIB + 3).unwrap();
        copy.write_all_at(&[byte[0] ^ 0xff], 17 * MIB + 3).unwrap();
    }
    let digests = imp_agent_api::moves::digests(&files).await.unwrap();
    let err = conn.done(&digests).await.unwrap_err();
    println!("{}", imp_api::chain::chain(&err));
    match &err {
        MoveSendError::Mismatch { file, message, .. } => {
            assert_eq!(file, "disk.img");
            assert!(
                message.contains("disk.img") && message.contains("SHA-256"),
                "{message}"
            );
        }
        e => panic!("not a mismatch: {}", imp_api::chain::chain(e)),
    }
    assert!(m.moves.received(UID).is_none(), "nothing was taken");
    // Its progress was dropped: sent again, it is sent whole, the other file not at all.
    assert_eq!(conn.held("disk.img").await.unwrap(), Default::default());
    drop(conn);
    let sent = send_files(&m.source(), &files, None).await.unwrap();
    assert_eq!(sent.bytes_sent, disk_data);
    arrived(&m.moves.received(UID).unwrap(), &files, disk_data);
}

#[tokio::test]
async fn a_file_name_that_is_a_path_is_refused_400_by_both_ends() {
    let m = move_env("move-names").await;
    let (mut files, _) = vm_files(&m.src);
    files.push(("../x".into(), m.src.join("state.json")));
    match send_files(&m.source(), &files, None).await {
        Err(MoveSendError::FileName(name)) => assert_eq!(name, "../x"),
        other => panic!("expected the sender to refuse ../x: {other:?}"),
    }
    let source = m.source_digest();
    for (method, path) in [
        ("GET", "/v1/moves/ns/vm/files/../x"),
        ("PUT", "/v1/moves/ns/vm/files/../x?size=1"),
        ("PUT", "/v1/moves/ns/vm/files/.hidden?size=1"),
        ("GET", "/v1/moves/ns/vm/files/a/b"),
    ] {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(imp_agent_api::moves::TOKEN_HEADER, TOKEN)
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = m.env.api.clone().handle(req, Some(&source)).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{method} {path}");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("Invalid file name"), "{body}");
    }
    assert!(!m.moves.root().exists());
}

#[tokio::test]
async fn a_move_callers_certificate_opens_none_of_the_gateways_endpoints() {
    let m = move_env("move-exec").await;
    let caller = Caller {
        identity: &m.source,
        user: "alice",
        groups: &[],
    };
    let exec = refused(client::exec(&m.env.target, &caller, "ns", "vm").await);
    says(exec, StatusCode::UNAUTHORIZED, &["only imp's gateway"]);
    match client::console(&m.env.target, &caller, "ns", "vm", false).await {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, StatusCode::UNAUTHORIZED),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("the move's caller read the console"),
    }
    assert!(matches!(
        client::guest_metrics(&m.env.target, &caller, "ns").await,
        Err(ClientError::Refused {
            status: StatusCode::UNAUTHORIZED,
            ..
        })
    ));
    assert_eq!(m.env.api.exec_sessions(), 0);
    assert!(
        m.env.seen.lock().unwrap().is_empty(),
        "the guest was reached"
    );
}

#[tokio::test]
async fn a_bandwidth_cap_paces_the_transfer() {
    let m = move_env("move-pace").await;
    let dense = m.src.join("memory");
    let data: Vec<u8> = (0..16 * MIB).map(|i| (i % 253) as u8).collect();
    std::fs::write(&dense, &data).unwrap();
    let files = [("memory".to_owned(), dense)];
    let started = Instant::now();
    let sent = send_files(&m.source(), &files, Some(8 * MIB))
        .await
        .unwrap();
    let took = started.elapsed();
    println!(
        "16 MiB at a cap of 8 MiB/s took {took:?} ({:.1} MiB/s)",
        sent.bytes_sent as f64 / MIB as f64 / took.as_secs_f64()
    );
    assert_eq!(sent.bytes_sent, 16 * MIB);
    assert!(took >= Duration::from_millis(1500), "{took:?}");
    assert_eq!(
        std::fs::read(m.moves.received(UID).unwrap().join("memory")).unwrap(),
        data
    );
}
