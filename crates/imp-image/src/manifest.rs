//! The OCI (and Docker v2) documents an image is made of: index, manifest, config, descriptors.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::ImageError;

/// OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Docker manifest list.
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker image manifest.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Every manifest type a registry may answer with; sent in `Accept`.
pub const ACCEPT: &[&str] = &[OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST];
/// Largest manifest, index or config accepted, so a hostile registry cannot exhaust memory.
pub const MAX_DOCUMENT_BYTES: u64 = 4 << 20;

/// A validated `sha256:<64 lowercase hex>` digest, safe to use as a file name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Checks `s`; `what` names where it was found, for the error.
    pub fn parse(s: &str, what: &str) -> Result<Self, ImageError> {
        Self::checked(s).ok_or_else(|| ImageError::InvalidDigest {
            digest: s.to_owned(),
            what: what.to_owned(),
        })
    }

    /// `s` as a digest when it is one (`sha256:<64 lowercase hex>`), for callers with errors
    /// of their own.
    pub fn checked(s: &str) -> Option<Self> {
        let ok = s.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        ok.then(|| Self(s.to_owned()))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(bytes))
    }

    /// The digest a finished hasher holds.
    pub fn from_hasher(h: Sha256) -> Self {
        Self(format!("sha256:{:x}", h.finalize()))
    }

    /// The hex part.
    pub fn hex(&self) -> &str {
        &self.0[7..]
    }

    /// The whole `sha256:…` text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Fails unless `bytes` hash to this digest.
    pub fn verify(&self, bytes: &[u8], what: &str) -> Result<(), ImageError> {
        let actual = Self::of(bytes);
        if &actual == self {
            Ok(())
        } else {
            Err(ImageError::DigestMismatch {
                what: what.to_owned(),
                expected: self.0.clone(),
                actual: actual.0,
            })
        }
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An OS/architecture pair an index entry is for.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Platform {
    /// `os`, e.g. `linux`.
    pub os: String,
    /// `architecture`, e.g. `amd64`.
    pub architecture: String,
    /// `variant`, e.g. `v8`; None matches any.
    #[serde(default)]
    pub variant: Option<String>,
}

impl Platform {
    /// linux on the host's architecture in OCI spelling (`amd64` here).
    pub fn host() -> Self {
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            "x86" => "386",
            other => other,
        };
        Self::linux(architecture)
    }

    /// linux on `architecture`.
    pub fn linux(architecture: &str) -> Self {
        Self {
            os: "linux".into(),
            architecture: architecture.into(),
            variant: None,
        }
    }

    fn matches(&self, other: &Platform) -> bool {
        self.os == other.os
            && self.architecture == other.architecture
            && (self.variant.is_none() || self.variant == other.variant)
    }
}

impl Default for Platform {
    fn default() -> Self {
        Self::host()
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// A content descriptor as it appears in JSON.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RawDescriptor {
    /// Media type.
    #[serde(default)]
    pub media_type: String,
    /// Digest text (validated before use).
    pub digest: String,
    /// Size in bytes.
    pub size: i64,
    /// Platform, in index entries.
    #[serde(default)]
    pub platform: Option<Platform>,
    /// Annotations, e.g. `org.opencontainers.image.ref.name` in a layout's index.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// A validated descriptor: digest checked, size non-negative.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// Media type.
    pub media_type: String,
    /// Digest.
    pub digest: Digest,
    /// Size in bytes.
    pub size: u64,
}

impl RawDescriptor {
    /// Validates the digest and size; `what` names the descriptor in errors.
    pub fn validate(&self, what: &str) -> Result<Descriptor, ImageError> {
        let digest = Digest::parse(&self.digest, what)?;
        let size = u64::try_from(self.size).map_err(|_| ImageError::Manifest {
            what: what.to_owned(),
            reason: format!("negative size {}", self.size),
        })?;
        Ok(Descriptor {
            media_type: self.media_type.clone(),
            digest,
            size,
        })
    }
}

/// A manifest document: either an index of platform manifests or one image manifest.
#[derive(Debug)]
pub enum Document {
    /// An OCI index or Docker manifest list.
    Index(Vec<RawDescriptor>),
    /// An image manifest: config and layers, lowest first.
    Manifest {
        /// The config blob.
        config: Descriptor,
        /// The layers, lowest first.
        layers: Vec<Descriptor>,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawDocument {
    schema_version: Option<u32>,
    #[serde(default)]
    media_type: Option<String>,
    manifests: Option<Vec<RawDescriptor>>,
    config: Option<RawDescriptor>,
    layers: Option<Vec<RawDescriptor>>,
}

impl Document {
    /// Parses a manifest or index; `what` names it in errors.
    pub fn parse(bytes: &[u8], what: &str) -> Result<Self, ImageError> {
        let bad = |reason: String| ImageError::Manifest {
            what: what.to_owned(),
            reason,
        };
        let raw: RawDocument = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if raw.schema_version != Some(2) {
            return Err(bad(format!(
                "schemaVersion is {:?}, not 2",
                raw.schema_version
            )));
        }
        let mt = raw.media_type.as_deref().unwrap_or("");
        let is_index =
            mt == OCI_INDEX || mt == DOCKER_LIST || (mt.is_empty() && raw.manifests.is_some());
        if is_index {
            return Ok(Self::Index(raw.manifests.unwrap_or_default()));
        }
        if !(mt.is_empty() || mt == OCI_MANIFEST || mt == DOCKER_MANIFEST) {
            return Err(bad(format!("unsupported media type {mt:?}")));
        }
        let config = raw
            .config
            .ok_or_else(|| bad("no config descriptor".into()))?
            .validate(&format!("{what}: config"))?;
        let layers = raw
            .layers
            .unwrap_or_default()
            .iter()
            .enumerate()
            .map(|(i, l)| l.validate(&format!("{what}: layer {i}")))
            .collect::<Result<_, _>>()?;
        Ok(Self::Manifest { config, layers })
    }
}

/// Picks the entry of `index` for `platform`; `image` names the image in errors.
pub fn select_platform(
    index: &[RawDescriptor],
    platform: &Platform,
    image: &str,
) -> Result<Descriptor, ImageError> {
    index
        .iter()
        .find(|d| d.platform.as_ref().is_some_and(|p| platform.matches(p)))
        .ok_or_else(|| ImageError::NoPlatform {
            image: image.to_owned(),
            platform: platform.to_string(),
        })?
        .validate(&format!("{image}: index entry for {platform}"))
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "PascalCase")]
struct RawProcess {
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    env: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architecture: Option<String>,
    #[serde(default)]
    os: Option<String>,
    #[serde(default)]
    config: Option<RawProcess>,
}

/// Parses an image config blob into the process fields the guest runs, checking its platform.
pub fn parse_config(
    bytes: &[u8],
    what: &str,
) -> Result<(imp_proto::config::ImageConfig, Option<Platform>), ImageError> {
    let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| ImageError::Manifest {
        what: what.to_owned(),
        reason: e.to_string(),
    })?;
    let p = raw.config.unwrap_or_default();
    let platform = match (raw.os, raw.architecture) {
        (Some(os), Some(architecture)) => Some(Platform {
            os,
            architecture,
            variant: None,
        }),
        _ => None,
    };
    let image = imp_proto::config::ImageConfig {
        entrypoint: p.entrypoint.unwrap_or_default(),
        cmd: p.cmd.unwrap_or_default(),
        env: p.env.unwrap_or_default(),
        working_dir: p.working_dir.filter(|w| !w.is_empty()),
        user: p.user.filter(|u| !u.is_empty()),
    };
    Ok((image, platform))
}

#[derive(Deserialize)]
struct RawRootfs {
    rootfs: Option<RawDiffIds>,
}

#[derive(Deserialize)]
struct RawDiffIds {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// The config's `rootfs.diff_ids`: the sha256 of each layer's uncompressed tar, lowest first,
/// which the unpack checks (the OCI image spec requires them).
pub fn parse_diff_ids(bytes: &[u8], what: &str) -> Result<Vec<Digest>, ImageError> {
    let raw: RawRootfs = serde_json::from_slice(bytes).map_err(|e| ImageError::Manifest {
        what: what.to_owned(),
        reason: e.to_string(),
    })?;
    let Some(rootfs) = raw.rootfs else {
        return Err(ImageError::Manifest {
            what: what.to_owned(),
            reason: "it has no rootfs.diff_ids".into(),
        });
    };
    rootfs
        .diff_ids
        .iter()
        .map(|d| Digest::parse(d, &format!("rootfs.diff_ids of {what}")))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn digest_must_be_sha256_hex() {
        let good = format!("sha256:{}", "0f".repeat(32));
        assert_eq!(Digest::parse(&good, "x").unwrap().hex(), "0f".repeat(32));
        for bad in ["sha256:../../etc", "sha512:00", "sha256:ABC", ""] {
            let e = Digest::parse(bad, "layer 3").unwrap_err().to_string();
            assert!(e.contains("layer 3"), "{e}");
        }
        assert_eq!(
            Digest::of(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn index_picks_the_platform() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let json = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[
            {{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":1,"platform":{{"os":"linux","architecture":"arm64"}}}},
            {{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":2,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#,
            d('a'),
            d('b')
        );
        let Document::Index(entries) = Document::parse(json.as_bytes(), "i").unwrap() else {
            panic!()
        };
        let amd = select_platform(&entries, &Platform::linux("amd64"), "img").unwrap();
        assert_eq!(amd.digest.as_str(), d('b'));
        let e = select_platform(&entries, &Platform::linux("s390x"), "img").unwrap_err();
        assert_eq!(
            e.to_string(),
            "Image img has no manifest for platform linux/s390x"
        );
    }

    #[test]
    fn config_process_fields_map() {
        let json = br#"{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/bin/sh"],"Cmd":["-c","x"],"Env":["PATH=/bin"],"WorkingDir":"/w","User":"1:2"}}"#;
        let (c, p) = parse_config(json, "cfg").unwrap();
        assert_eq!(c.entrypoint, vec!["/bin/sh"]);
        assert_eq!(c.cmd, vec!["-c", "x"]);
        assert_eq!(c.env, vec!["PATH=/bin"]);
        assert_eq!(c.working_dir.as_deref(), Some("/w"));
        assert_eq!(c.user.as_deref(), Some("1:2"));
        assert_eq!(p, Some(Platform::linux("amd64")));
    }
}
