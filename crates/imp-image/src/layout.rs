//! Reading images from a local OCI image layout directory or an `oci-archive` tar of one.
//!
//! A layout is untrusted like a registry: digests come from its `index.json` and manifests and
//! are validated before they become file names, and every blob is hashed when imported.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::blobs::BlobStore;
use super::manifest::{Descriptor, MAX_DOCUMENT_BYTES, RawDescriptor};
use super::progress::Meter;
use super::{ImageError, Result, blocking};

/// The annotation naming a tag in a layout's `index.json`.
const REF_NAME: &str = "org.opencontainers.image.ref.name";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OciLayoutFile {
    image_layout_version: String,
}

#[derive(Deserialize)]
struct LayoutIndex {
    #[serde(default)]
    manifests: Vec<RawDescriptor>,
}

/// One OCI layout directory being read.
pub(crate) struct LayoutFetcher {
    dir: PathBuf,
    tag: Option<String>,
}

impl LayoutFetcher {
    /// Opens `dir`, checking its `oci-layout` marker.
    pub(crate) async fn open(dir: &Path, tag: Option<String>) -> Result<Self> {
        let marker = dir.join("oci-layout");
        let text = tokio::fs::read(&marker)
            .await
            .map_err(ImageError::io("Reading the OCI layout marker", &marker))?;
        let parsed: OciLayoutFile =
            serde_json::from_slice(&text).map_err(|e| ImageError::Manifest {
                what: marker.display().to_string(),
                reason: e.to_string(),
            })?;
        if !parsed.image_layout_version.starts_with("1.") {
            return Err(ImageError::Manifest {
                what: marker.display().to_string(),
                reason: format!(
                    "unsupported imageLayoutVersion {:?}",
                    parsed.image_layout_version
                ),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            tag,
        })
    }

    fn blob_path(&self, desc: &Descriptor) -> PathBuf {
        self.dir
            .join("blobs")
            .join("sha256")
            .join(desc.digest.hex())
    }

    /// The index.json entry for the tag (or the only entry), read and verified.
    pub(crate) async fn root(&self) -> Result<(Vec<u8>, super::manifest::Digest)> {
        let path = self.dir.join("index.json");
        let what = path.display().to_string();
        let bytes = tokio::fs::read(&path)
            .await
            .map_err(ImageError::io("Reading the OCI layout index", &path))?;
        let index: LayoutIndex =
            serde_json::from_slice(&bytes).map_err(|e| ImageError::Manifest {
                what: what.clone(),
                reason: e.to_string(),
            })?;
        let entry = match &self.tag {
            Some(tag) => index
                .manifests
                .iter()
                .find(|m| m.annotations.get(REF_NAME) == Some(tag))
                .ok_or_else(|| ImageError::Manifest {
                    what: what.clone(),
                    reason: format!("no manifest is tagged {tag:?}"),
                })?,
            None => match index.manifests.as_slice() {
                [one] => one,
                many => {
                    return Err(ImageError::Manifest {
                        what,
                        reason: format!("{} manifests and no tag given", many.len()),
                    });
                }
            },
        };
        let desc = entry.validate(&format!("{what}: entry"))?;
        let bytes = self.manifest(&desc).await?;
        Ok((bytes, desc.digest))
    }

    /// A manifest or index blob by descriptor, verified.
    pub(crate) async fn manifest(&self, desc: &Descriptor) -> Result<Vec<u8>> {
        let what = format!("manifest {} in {}", desc.digest, self.dir.display());
        if desc.size > MAX_DOCUMENT_BYTES {
            return Err(ImageError::Manifest {
                what,
                reason: format!("{} bytes is more than the limit", desc.size),
            });
        }
        let path = self.blob_path(desc);
        let bytes = tokio::fs::read(&path)
            .await
            .map_err(ImageError::io("Reading layout blob", &path))?;
        if bytes.len() as u64 != desc.size {
            return Err(ImageError::SizeMismatch {
                what,
                expected: desc.size,
                actual: bytes.len() as u64,
            });
        }
        desc.digest.verify(&bytes, &what)?;
        Ok(bytes)
    }

    /// Imports blob `desc` into `blobs` unless cached, counting its bytes into `meter`; true
    /// when it was copied.
    pub(crate) async fn blob(
        &self,
        blobs: &BlobStore,
        desc: &Descriptor,
        what: &str,
        meter: Meter,
    ) -> Result<bool> {
        if blobs.has(desc).await {
            return Ok(false);
        }
        blobs
            .import_file_metered(desc, &self.blob_path(desc), what, meter)
            .await?;
        Ok(true)
    }
}

/// Extracts the layout files of `archive` (`oci-layout`, `index.json`, `blobs/sha256/<hex>`,
/// nothing else, never through links) into the fresh directory `dest`. Blocking.
fn extract_archive_blocking(archive: &Path, dest: &Path) -> Result<()> {
    let file =
        std::fs::File::open(archive).map_err(ImageError::io("Opening the OCI archive", archive))?;
    let blobs = dest.join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs).map_err(ImageError::io("Creating directory", &blobs))?;
    let mut tar = tar::Archive::new(std::io::BufReader::new(file));
    let entries = tar
        .entries()
        .map_err(ImageError::io("Reading the OCI archive", archive))?;
    for entry in entries {
        let mut entry = entry.map_err(ImageError::io("Reading the OCI archive", archive))?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let name = name.trim_start_matches("./");
        let target = match name {
            "oci-layout" | "index.json" => dest.join(name),
            _ => match name.strip_prefix("blobs/sha256/") {
                Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
                    blobs.join(hex)
                }
                _ => continue,
            },
        };
        let limit = if target.starts_with(&blobs) {
            u64::MAX
        } else {
            MAX_DOCUMENT_BYTES
        };
        let mut out =
            std::fs::File::create(&target).map_err(ImageError::io("Extracting", &target))?;
        std::io::copy(&mut (&mut entry).take(limit), &mut out)
            .map_err(ImageError::io("Extracting", &target))?;
    }
    Ok(())
}

/// Extracts an `oci-archive` tar into `dest` on the blocking pool.
pub(crate) async fn extract_archive(archive: &Path, dest: &Path) -> Result<()> {
    let (a, d) = (archive.to_path_buf(), dest.to_path_buf());
    blocking(move || extract_archive_blocking(&a, &d)).await
}
