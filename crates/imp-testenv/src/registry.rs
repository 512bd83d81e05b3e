//! A real OCI registry on loopback for tests, and a writer of OCI image layouts to push to it.
//!
//! [`TestRegistry`] runs Debian's `docker-registry` (distribution v2) with filesystem storage in a
//! temporary directory on a free 127.0.0.1 port, optionally behind htpasswd basic auth (needs
//! `htpasswd` from apache2-utils). [`TestImage`] builds gzip-compressed layers from in-memory
//! entries or host directories and writes an OCI layout; [`push`] copies it to a registry with
//! `skopeo`. Entries are written byte for byte, so a test can build hostile layers (`../` paths,
//! absolute symlinks, escaping hardlinks).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// OCI manifest media type.
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI index media type.
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI gzip layer media type.
const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// OCI zstd layer media type.
const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

/// Why the test registry or an image could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A file operation failed.
    #[error("{op} {path:?}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A tool (docker-registry, htpasswd, skopeo) failed or is missing.
    #[error("Running {tool} failed: {detail}")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// What happened.
        detail: String,
    },
    /// A scratch directory for the registry's storage could not be made.
    #[error(transparent)]
    Scratch(#[from] crate::scratch::ScratchError),
    /// The registry did not answer in time.
    #[error("Registry on {addr} not ready after {secs} s")]
    NotReady {
        /// Where it should listen.
        addr: SocketAddr,
        /// How long we waited.
        secs: u64,
    },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> RegistryError {
    let path = path.to_path_buf();
    move |source| RegistryError::Io { op, path, source }
}

/// Kept here for the tests that import it from `registry`; it lives in [`crate::scratch`].
pub use crate::scratch::scratch_dir;

/// A running `docker-registry serve`; killed and its storage removed on drop.
#[derive(Debug)]
pub struct TestRegistry {
    addr: SocketAddr,
    dir: PathBuf,
    child: tokio::process::Child,
}

impl TestRegistry {
    /// Starts an anonymous registry.
    pub async fn start() -> Result<Self, RegistryError> {
        Self::start_inner(None, true).await
    }

    /// Starts an anonymous registry that refuses to delete manifests (`storage.delete.enabled:
    /// false`, the distribution default), answering DELETE with 405 UNSUPPORTED.
    pub async fn start_with_delete_disabled() -> Result<Self, RegistryError> {
        Self::start_inner(None, false).await
    }

    /// Starts a registry that requires HTTP basic auth as `user`/`password`.
    pub async fn start_with_basic_auth(user: &str, password: &str) -> Result<Self, RegistryError> {
        Self::start_inner(Some((user, password)), true).await
    }

    async fn start_inner(creds: Option<(&str, &str)>, delete: bool) -> Result<Self, RegistryError> {
        let dir = scratch_dir("imp-test-registry")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io("Finding a free port for", &dir))?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut auth = String::new();
        if let Some((user, password)) = creds {
            let out = tokio::process::Command::new("htpasswd")
                .args(["-Bbn", user, password])
                .output()
                .await
                .map_err(|e| RegistryError::Tool {
                    tool: "htpasswd",
                    detail: e.to_string(),
                })?;
            if !out.status.success() {
                return Err(RegistryError::Tool {
                    tool: "htpasswd",
                    detail: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
            let file = dir.join("htpasswd");
            std::fs::write(&file, &out.stdout).map_err(io("Writing", &file))?;
            auth = format!(
                "auth:\n  htpasswd:\n    realm: imp-test\n    path: {}\n",
                file.display()
            );
        }
        let config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: {delete}\nhttp:\n  addr: {addr}\n{auth}",
            dir.join("storage").display()
        );
        let config_path = dir.join("config.yml");
        std::fs::write(&config_path, config).map_err(io("Writing", &config_path))?;
        let child = tokio::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| RegistryError::Tool {
                tool: "docker-registry",
                detail: e.to_string(),
            })?;
        let reg = Self { addr, dir, child };
        reg.wait_ready(Duration::from_secs(10)).await?;
        Ok(reg)
    }

    async fn wait_ready(&self, within: Duration) -> Result<(), RegistryError> {
        let start = Instant::now();
        while start.elapsed() < within {
            if let Ok(mut s) = tokio::net::TcpStream::connect(self.addr).await {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let req = format!("GET /v2/ HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr);
                if s.write_all(req.as_bytes()).await.is_ok() {
                    let mut buf = [0u8; 12];
                    if s.read_exact(&mut buf).await.is_ok() && buf.starts_with(b"HTTP/1.") {
                        return Ok(());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(RegistryError::NotReady {
            addr: self.addr,
            secs: within.as_secs(),
        })
    }

    /// `127.0.0.1:PORT`, the registry part of image references.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the registry keeps blobs: `<dir>/docker/registry/v2/blobs/sha256/<2>/<hex>/data`.
    pub fn storage_dir(&self) -> PathBuf {
        self.dir.join("storage")
    }

    /// The stored file of blob `digest` (`sha256:…`), for tests that tamper with it.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.storage_dir()
            .join("docker/registry/v2/blobs/sha256")
            .join(hex.get(..2).unwrap_or(hex))
            .join(hex)
            .join("data")
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Copies tag `tag` of the OCI layout `layout` to `dest` (`127.0.0.1:PORT/repo:tag`) with skopeo,
/// as `creds` (`user`, `password`) when given.
pub async fn push(
    layout: &Path,
    tag: &str,
    dest: &str,
    creds: Option<(&str, &str)>,
) -> Result<(), RegistryError> {
    let mut cmd = tokio::process::Command::new("skopeo");
    cmd.args(["copy", "--quiet", "--dest-tls-verify=false"]);
    if let Some((u, p)) = creds {
        cmd.arg(format!("--dest-creds={u}:{p}"));
    }
    cmd.arg(format!("oci:{}:{tag}", layout.display()))
        .arg(format!("docker://{dest}"));
    let out = cmd.output().await.map_err(|e| RegistryError::Tool {
        tool: "skopeo",
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(RegistryError::Tool {
            tool: "skopeo",
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(())
}

/// One tar entry, written exactly as given.
#[derive(Debug, Clone)]
enum Entry {
    File(String, Vec<u8>, u32),
    Dir(String, u32),
    Symlink(String, String),
    Hardlink(String, String),
}

/// A layer under construction: entries in order, or whole host directories.
#[derive(Debug, Clone, Default)]
pub struct TestLayer {
    entries: Vec<Entry>,
    dirs: Vec<(PathBuf, String)>,
}

impl TestLayer {
    /// An empty layer.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a regular file.
    pub fn file(mut self, path: &str, data: impl Into<Vec<u8>>, mode: u32) -> Self {
        self.entries
            .push(Entry::File(path.into(), data.into(), mode));
        self
    }
    /// Adds a directory.
    pub fn dir(mut self, path: &str, mode: u32) -> Self {
        self.entries.push(Entry::Dir(path.into(), mode));
        self
    }
    /// Adds a symlink `path` → `target`.
    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        self.entries
            .push(Entry::Symlink(path.into(), target.into()));
        self
    }
    /// Adds a hardlink `path` → `target`.
    pub fn hardlink(mut self, path: &str, target: &str) -> Self {
        self.entries
            .push(Entry::Hardlink(path.into(), target.into()));
        self
    }
    /// Adds the host directory `src` (recursively, symlinks kept as symlinks) under `prefix`.
    pub fn host_dir(mut self, src: impl Into<PathBuf>, prefix: &str) -> Self {
        self.dirs.push((src.into(), prefix.into()));
        self
    }

    /// The uncompressed tar.
    pub fn tar(&self) -> Result<Vec<u8>, RegistryError> {
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        let werr = |e| RegistryError::Io {
            op: "Building layer tar",
            path: PathBuf::new(),
            source: e,
        };
        for e in &self.entries {
            let (kind, path, data, mode, link): (tar::EntryType, &str, &[u8], u32, Option<&str>) =
                match e {
                    Entry::File(p, d, m) => (tar::EntryType::Regular, p, d, *m, None),
                    Entry::Dir(p, m) => (tar::EntryType::Directory, p, &[], *m, None),
                    Entry::Symlink(p, t) => (tar::EntryType::Symlink, p, &[], 0o777, Some(t)),
                    Entry::Hardlink(p, t) => (tar::EntryType::Link, p, &[], 0o644, Some(t)),
                };
            let mut h = tar::Header::new_gnu();
            if path.len() > 100 || link.is_some_and(|l| l.len() > 100) {
                return Err(RegistryError::Tool {
                    tool: "tar",
                    detail: format!("entry name over 100 bytes: {path:?}"),
                });
            }
            h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            if let Some(l) = link {
                h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_700_000_000);
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data).map_err(werr)?;
        }
        for (src, prefix) in &self.dirs {
            b.append_dir_all(prefix.trim_start_matches('/'), src)
                .map_err(io("Adding directory to layer", src))?;
        }
        b.into_inner().map_err(werr)
    }
}

/// An image under construction: layers and the config's process fields.
#[derive(Debug, Clone)]
pub struct TestImage {
    layers: Vec<TestLayer>,
    architecture: String,
    zstd: bool,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    env: Vec<String>,
    working_dir: Option<String>,
    user: Option<String>,
}

impl Default for TestImage {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            architecture: "amd64".into(),
            zstd: false,
            entrypoint: None,
            cmd: None,
            env: Vec::new(),
            working_dir: None,
            user: None,
        }
    }
}

/// Digests of an image written into a layout.
#[derive(Debug, Clone)]
pub struct WrittenImage {
    /// The image manifest's digest (or the index's, for [`write_index`]).
    pub digest: String,
    /// The config blob's digest.
    pub config_digest: String,
    /// The compressed layer blobs' digests, lowest first.
    pub layer_digests: Vec<String>,
}

/// Compresses `data` with the `zstd` command-line tool.
fn zstd_compress(data: &[u8]) -> Result<Vec<u8>, RegistryError> {
    let tool = |detail: String| RegistryError::Tool {
        tool: "zstd",
        detail,
    };
    let mut child = std::process::Command::new("zstd")
        .args(["-q", "-c", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| tool(e.to_string()))?;
    let mut stdin = child.stdin.take().ok_or_else(|| tool("no stdin".into()))?;
    let input = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().map_err(|e| tool(e.to_string()))?;
    writer
        .join()
        .map_err(|_| tool("writer thread panicked".into()))?
        .map_err(|e| tool(e.to_string()))?;
    if !out.status.success() {
        return Err(tool(out.status.to_string()));
    }
    Ok(out.stdout)
}

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

fn put_blob(layout: &Path, bytes: &[u8]) -> Result<String, RegistryError> {
    let digest = sha(bytes);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).map_err(io("Creating directory", &dir))?;
    let path = dir.join(&digest[7..]);
    std::fs::write(&path, bytes).map_err(io("Writing blob", &path))?;
    Ok(digest)
}

/// Adds `{mediaType, digest, size}` tagged `tag` to the layout's index.json (replacing that tag).
fn tag_in_index(
    layout: &Path,
    media_type: &str,
    digest: &str,
    size: usize,
    tag: &str,
) -> Result<(), RegistryError> {
    let marker = layout.join("oci-layout");
    std::fs::write(&marker, br#"{"imageLayoutVersion":"1.0.0"}"#)
        .map_err(io("Writing", &marker))?;
    let index_path = layout.join("index.json");
    let mut manifests: Vec<serde_json::Value> = std::fs::read(&index_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("manifests").and_then(|m| m.as_array()).cloned())
        .unwrap_or_default();
    manifests.retain(|m| m["annotations"]["org.opencontainers.image.ref.name"] != tag);
    manifests.push(serde_json::json!({
        "mediaType": media_type, "digest": digest, "size": size,
        "annotations": {"org.opencontainers.image.ref.name": tag}
    }));
    let index =
        serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
    std::fs::write(&index_path, index.to_string()).map_err(io("Writing", &index_path))
}

impl TestImage {
    /// An image with no layers, for linux/amd64.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a layer on top.
    pub fn layer(mut self, layer: TestLayer) -> Self {
        self.layers.push(layer);
        self
    }
    /// Sets the config's architecture (default `amd64`).
    pub fn architecture(mut self, arch: &str) -> Self {
        self.architecture = arch.into();
        self
    }
    /// Compresses the layers with zstd (the `zstd` tool) instead of gzip.
    pub fn zstd(mut self) -> Self {
        self.zstd = true;
        self
    }
    /// Sets `Entrypoint`.
    pub fn entrypoint(mut self, v: &[&str]) -> Self {
        self.entrypoint = Some(v.iter().map(|s| s.to_string()).collect());
        self
    }
    /// Sets `Cmd`.
    pub fn cmd(mut self, v: &[&str]) -> Self {
        self.cmd = Some(v.iter().map(|s| s.to_string()).collect());
        self
    }
    /// Adds an `Env` entry `NAME=value`.
    pub fn env(mut self, kv: &str) -> Self {
        self.env.push(kv.into());
        self
    }
    /// Sets `WorkingDir`.
    pub fn working_dir(mut self, d: &str) -> Self {
        self.working_dir = Some(d.into());
        self
    }
    /// Sets `User`.
    pub fn user(mut self, u: &str) -> Self {
        self.user = Some(u.into());
        self
    }

    /// Writes blobs and the manifest into `layout` without tagging; returns digests and size.
    fn write_blobs(&self, layout: &Path) -> Result<(WrittenImage, usize), RegistryError> {
        let mut layer_descs = Vec::new();
        let mut diff_ids = Vec::new();
        let mut layer_digests = Vec::new();
        for l in &self.layers {
            let tar = l.tar()?;
            diff_ids.push(sha(&tar));
            let (blob, media_type) = if self.zstd {
                (zstd_compress(&tar)?, OCI_LAYER_ZSTD)
            } else {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(&tar)
                    .map_err(io("Compressing layer for", layout))?;
                (
                    gz.finish().map_err(io("Compressing layer for", layout))?,
                    OCI_LAYER_GZIP,
                )
            };
            let d = put_blob(layout, &blob)?;
            layer_descs.push(
                serde_json::json!({"mediaType": media_type, "digest": d, "size": blob.len()}),
            );
            layer_digests.push(d);
        }
        let config = serde_json::json!({
            "architecture": self.architecture, "os": "linux",
            "config": {"Entrypoint": self.entrypoint, "Cmd": self.cmd, "Env": self.env,
                       "WorkingDir": self.working_dir.clone().unwrap_or_default(),
                       "User": self.user.clone().unwrap_or_default()},
            "rootfs": {"type": "layers", "diff_ids": diff_ids}
        })
        .to_string();
        let config_digest = put_blob(layout, config.as_bytes())?;
        let manifest = serde_json::json!({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
            "layers": layer_descs
        })
        .to_string();
        let digest = put_blob(layout, manifest.as_bytes())?;
        Ok((
            WrittenImage {
                digest,
                config_digest,
                layer_digests,
            },
            manifest.len(),
        ))
    }

    /// Writes the image into the OCI layout directory `layout` (created if needed) as `tag`.
    pub fn write_layout(&self, layout: &Path, tag: &str) -> Result<WrittenImage, RegistryError> {
        let (w, size) = self.write_blobs(layout)?;
        tag_in_index(layout, OCI_MANIFEST, &w.digest, size, tag)?;
        Ok(w)
    }
}

/// Writes a multi-platform index of `images` (each tagged with its config's architecture, os
/// linux) into `layout` as `tag`; returns the index digest and each image's digests.
pub fn write_index(
    layout: &Path,
    tag: &str,
    images: &[&TestImage],
) -> Result<(String, Vec<WrittenImage>), RegistryError> {
    let mut entries = Vec::new();
    let mut written = Vec::new();
    for img in images {
        let (w, size) = img.write_blobs(layout)?;
        entries.push(serde_json::json!({
            "mediaType": OCI_MANIFEST, "digest": w.digest, "size": size,
            "platform": {"os": "linux", "architecture": img.architecture}
        }));
        written.push(w);
    }
    let index =
        serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries})
            .to_string();
    let digest = put_blob(layout, index.as_bytes())?;
    tag_in_index(layout, OCI_INDEX, &digest, index.len(), tag)?;
    Ok((digest, written))
}

/// Writes a tar of the directory `layout` (an `oci-archive`) to `file`.
pub fn write_archive(layout: &Path, file: &Path) -> Result<(), RegistryError> {
    let out = std::fs::File::create(file).map_err(io("Creating", file))?;
    let mut b = tar::Builder::new(out);
    b.append_dir_all(".", layout)
        .map_err(io("Archiving", layout))?;
    b.into_inner().map_err(io("Archiving", layout))?;
    Ok(())
}
