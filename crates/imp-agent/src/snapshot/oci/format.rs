//! The snapshot artifact's format (see [`super`]): how files are cut into chunks and which
//! chunks are holes, the chunk codecs, the manifest a push writes, and the checks a pull makes
//! of a manifest and config before it reads a byte of data.

use std::collections::BTreeMap;
use std::io::{self, Read as _, Write as _};
use std::ops::Range;

use imp_image::manifest::{Digest, OCI_MANIFEST};
use serde::{Deserialize, Serialize};

use super::super::{FORMAT, Manifest};
use super::{
    ANNOTATION_CHUNK_BYTES, ANNOTATION_FILE, ANNOTATION_LENGTH, ANNOTATION_OFFSET,
    ANNOTATION_SIZE_PREFIX, ARTIFACT_TYPE, BLOCK, CHUNK_GZIP, CHUNK_ZSTD, CONFIG_MEDIA_TYPE, Error,
    FILES, MAX_CHUNK_BYTES, MAX_CONFIG_BYTES, MAX_FILE_BYTES, Result,
};

/// One chunk of a file to push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Planned {
    pub(super) offset: u64,
    pub(super) len: u64,
    /// False when the file system says the range is a hole: it is skipped without reading.
    pub(super) may_hold_data: bool,
}

/// Cuts a file of `size` bytes into chunks of `chunk` bytes, marking those that no data range
/// (`[start, end)`, from `SEEK_DATA`) touches.
pub(super) fn plan_chunks(size: u64, chunk: u64, data: &[(u64, u64)]) -> Vec<Planned> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    let mut offset = 0;
    while offset < size {
        let len = chunk.min(size - offset);
        let end = offset + len;
        let may_hold_data = data.iter().any(|&(s, e)| s < end && e > offset);
        out.push(Planned {
            offset,
            len,
            may_hold_data,
        });
        offset = end;
    }
    out
}

/// True when every byte is zero (checked a block at a time so it stops early and vectorises).
pub(super) fn is_zero(bytes: &[u8]) -> bool {
    bytes
        .chunks(BLOCK)
        .all(|b| b.iter().fold(0u8, |acc, &x| acc | x) == 0)
}

/// The byte ranges of `bytes` to write, in `block`-sized steps: runs of blocks that are not all
/// zero, merged. What is left out stays a hole in a file created empty.
pub(super) fn nonzero_runs(bytes: &[u8], block: usize) -> Vec<Range<usize>> {
    let block = block.max(1);
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, b) in bytes.chunks(block).enumerate() {
        if is_zero(b) {
            continue;
        }
        let start = i * block;
        let end = start + b.len();
        match runs.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => runs.push(start..end),
        }
    }
    runs
}

/// How a chunk's blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Codec {
    Gzip,
    Zstd,
}

impl Codec {
    fn of(media_type: &str) -> Option<Self> {
        match media_type {
            CHUNK_GZIP => Some(Self::Gzip),
            CHUNK_ZSTD => Some(Self::Zstd),
            _ => None,
        }
    }

    pub(super) fn media_type(self) -> &'static str {
        match self {
            Self::Gzip => CHUNK_GZIP,
            Self::Zstd => CHUNK_ZSTD,
        }
    }
}

/// Compresses one chunk (gzip, fastest level; deterministic: no name, no time).
pub(super) fn encode(data: &[u8]) -> io::Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(
        Vec::with_capacity(data.len() / 4),
        flate2::Compression::fast(),
    );
    gz.write_all(data)?;
    gz.finish()
}

/// Decompresses one chunk, refusing output that is not exactly `length` bytes without ever
/// holding more than `length + 1`.
pub(super) fn decode(codec: Codec, data: &[u8], length: u64) -> io::Result<Vec<u8>> {
    let cap = usize::try_from(length).map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(cap);
    match codec {
        Codec::Gzip => {
            flate2::read::GzDecoder::new(data)
                .take(length + 1)
                .read_to_end(&mut out)?;
        }
        Codec::Zstd => {
            ruzstd::decoding::StreamingDecoder::new(data)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
                .take(length + 1)
                .read_to_end(&mut out)?;
        }
    }
    if out.len() as u64 != length {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} bytes decompressed, the layer says {length}",
                if out.len() as u64 > length {
                    format!("more than {length}")
                } else {
                    out.len().to_string()
                }
            ),
        ));
    }
    Ok(out)
}

/// The most a compressed chunk of `length` bytes can take (deflate's stored blocks cost 5 bytes
/// per 64 KiB, zstd's raw blocks 3 per 128 KiB; with room for headers).
fn max_compressed(length: u64) -> u64 {
    length + length / 1024 + 4096
}

/// An OCI descriptor as this module writes and reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Desc {
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

/// An OCI image manifest as this module writes and reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ManifestDoc {
    schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    media_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    artifact_type: Option<String>,
    config: Desc,
    #[serde(default)]
    layers: Vec<Desc>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

/// One stored chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Chunk {
    pub(super) offset: u64,
    pub(super) length: u64,
    pub(super) digest: Digest,
    pub(super) size: u64,
    pub(super) codec: Codec,
}

/// One file of the artifact: its size and its stored chunks, by offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FileEntry {
    pub(super) name: &'static str,
    pub(super) size: u64,
    pub(super) chunks: Vec<Chunk>,
}

/// A validated snapshot artifact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Artifact {
    pub(super) config_digest: Digest,
    pub(super) config_size: u64,
    pub(super) files: Vec<FileEntry>,
}

/// The manifest JSON of `artifact` (layers in file order, then offset order).
pub(super) fn build_manifest(
    artifact: &Artifact,
    chunk_bytes: u64,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut annotations = BTreeMap::new();
    annotations.insert(ANNOTATION_CHUNK_BYTES.to_owned(), chunk_bytes.to_string());
    let mut layers = Vec::new();
    for f in &artifact.files {
        annotations.insert(
            format!("{ANNOTATION_SIZE_PREFIX}{}", f.name),
            f.size.to_string(),
        );
        for c in &f.chunks {
            layers.push(Desc {
                media_type: c.codec.media_type().to_owned(),
                digest: c.digest.to_string(),
                size: c.size,
                annotations: BTreeMap::from([
                    (ANNOTATION_FILE.to_owned(), f.name.to_owned()),
                    (ANNOTATION_OFFSET.to_owned(), c.offset.to_string()),
                    (ANNOTATION_LENGTH.to_owned(), c.length.to_string()),
                ]),
            });
        }
    }
    serde_json::to_vec(&ManifestDoc {
        schema_version: 2,
        media_type: Some(OCI_MANIFEST.to_owned()),
        artifact_type: Some(ARTIFACT_TYPE.to_owned()),
        config: Desc {
            media_type: CONFIG_MEDIA_TYPE.to_owned(),
            digest: artifact.config_digest.to_string(),
            size: artifact.config_size,
            annotations: BTreeMap::new(),
        },
        layers,
        annotations,
    })
}

/// Reads and checks a manifest: that it is an imp snapshot of a kind this agent reads, and that
/// every size, offset and digest in it is in bounds. `reference` names it in errors.
pub(super) fn parse_artifact(reference: &str, bytes: &[u8]) -> Result<Artifact> {
    let why = Refusal { reference };
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| why.not_snapshot(format!("its manifest is not JSON ({e})")))?;
    check_artifact_type(&value, why)?;
    let doc: ManifestDoc = serde_json::from_value(value)
        .map_err(|e| why.invalid(format!("manifest does not parse: {e}")))?;
    let config_digest = check_config_desc(&doc, why)?;
    let mut files = file_entries(&doc.annotations, why)?;
    for (i, layer) in doc.layers.iter().enumerate() {
        let (file, chunk) = layer_chunk(i, layer, &files, why)?;
        files[file].chunks.push(chunk);
    }
    sort_chunks(&mut files, why)?;
    Ok(Artifact {
        config_digest,
        config_size: doc.config.size,
        files,
    })
}

/// The errors a manifest of `reference` is refused with.
#[derive(Debug, Clone, Copy)]
struct Refusal<'a> {
    reference: &'a str,
}

impl Refusal<'_> {
    /// Not an imp snapshot at all.
    fn not_snapshot(self, found: String) -> Error {
        Error::NotASnapshot {
            reference: self.reference.to_owned(),
            found,
        }
    }

    /// An imp snapshot (or OCI feature) this agent does not read.
    fn unsupported(self, found: String) -> Error {
        Error::Unsupported {
            reference: self.reference.to_owned(),
            found,
        }
    }

    /// An imp snapshot whose manifest is broken or out of bounds.
    fn invalid(self, reason: String) -> Error {
        Error::Invalid {
            reference: self.reference.to_owned(),
            reason,
        }
    }
}

/// Checks the manifest's media type and `artifactType` before anything else is read, so
/// something that is no imp snapshot is named as such.
fn check_artifact_type(value: &serde_json::Value, why: Refusal<'_>) -> Result<()> {
    let text = |k: &str| value.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    let media_type = text("mediaType");
    if media_type.as_deref().is_some_and(|m| m != OCI_MANIFEST) {
        return Err(why.not_snapshot(format!(
            "manifest media type {:?}",
            media_type.unwrap_or_default()
        )));
    }
    let config_type = value
        .get("config")
        .and_then(|c| c.get("mediaType"))
        .and_then(|m| m.as_str())
        .map(str::to_owned);
    match text("artifactType") {
        Some(t) if t == ARTIFACT_TYPE => Ok(()),
        Some(t) if t.starts_with("application/vnd.imp.snapshot.") => {
            Err(why.unsupported(format!("artifactType {t:?}")))
        }
        Some(t) => Err(why.not_snapshot(format!("artifactType {t:?}"))),
        None => Err(why.not_snapshot(format!(
            "no artifactType (config media type {:?})",
            config_type.unwrap_or_default()
        ))),
    }
}

/// Checks the schema version and the config's descriptor: media type, digest and size; returns
/// the config's digest.
fn check_config_desc(doc: &ManifestDoc, why: Refusal<'_>) -> Result<Digest> {
    if doc.schema_version != 2 {
        return Err(why.unsupported(format!("schemaVersion {}", doc.schema_version)));
    }
    if doc.config.media_type != CONFIG_MEDIA_TYPE {
        return Err(why.unsupported(format!("config media type {:?}", doc.config.media_type)));
    }
    let digest = check_digest(&doc.config.digest, "the config", why)?;
    if doc.config.size > MAX_CONFIG_BYTES {
        return Err(why.invalid(format!(
            "config of {} bytes is over the limit of {MAX_CONFIG_BYTES}",
            doc.config.size
        )));
    }
    Ok(digest)
}

/// The artifact's files (each of [`FILES`], in that order, no other) with the sizes the
/// manifest's annotations give them, their chunks still to be added.
fn file_entries(
    annotations: &BTreeMap<String, String>,
    why: Refusal<'_>,
) -> Result<Vec<FileEntry>> {
    let mut files = Vec::new();
    for name in FILES {
        let key = format!("{ANNOTATION_SIZE_PREFIX}{name}");
        let size = annotations
            .get(&key)
            .ok_or_else(|| why.invalid(format!("annotation {key} is missing")))?;
        let size: u64 = size
            .parse()
            .map_err(|_| why.invalid(format!("annotation {key} is {size:?}, not a size")))?;
        if size > MAX_FILE_BYTES {
            return Err(why.invalid(format!(
                "{name} of {size} bytes is over the limit of {MAX_FILE_BYTES}"
            )));
        }
        files.push(FileEntry {
            name,
            size,
            chunks: Vec::new(),
        });
    }
    if let Some(k) = annotations
        .keys()
        .filter_map(|k| k.strip_prefix(ANNOTATION_SIZE_PREFIX))
        .find(|f| !FILES.contains(f))
    {
        return Err(why.unsupported(format!("a file named {k:?}")));
    }
    Ok(files)
}

/// Reads layer `i` as a chunk of one of `files`: its codec, digest and annotations, its range
/// inside the file and its compressed size all in bounds. Returns the file's index and the chunk.
fn layer_chunk(
    i: usize,
    layer: &Desc,
    files: &[FileEntry],
    why: Refusal<'_>,
) -> Result<(usize, Chunk)> {
    let what = format!("layer {i} ({})", layer.digest);
    let codec = Codec::of(&layer.media_type)
        .ok_or_else(|| why.unsupported(format!("{what} of media type {:?}", layer.media_type)))?;
    let digest = check_digest(&layer.digest, &what, why)?;
    let ann = |k: &str| {
        layer
            .annotations
            .get(k)
            .ok_or_else(|| why.invalid(format!("{what} has no annotation {k}")))
    };
    let file = ann(ANNOTATION_FILE)?;
    let num = |k: &str| -> Result<u64> {
        let v = ann(k)?;
        v.parse()
            .map_err(|_| why.invalid(format!("{what}: annotation {k} is {v:?}, not a number")))
    };
    let (offset, length) = (num(ANNOTATION_OFFSET)?, num(ANNOTATION_LENGTH)?);
    let index = files
        .iter()
        .position(|f| f.name == file.as_str())
        .ok_or_else(|| why.unsupported(format!("{what} for a file named {file:?}")))?;
    let entry = &files[index];
    if length == 0 || length > MAX_CHUNK_BYTES {
        return Err(why.invalid(format!(
            "{what} has length {length}, outside 1..={MAX_CHUNK_BYTES}"
        )));
    }
    if offset
        .checked_add(length)
        .is_none_or(|end| end > entry.size)
    {
        return Err(why.invalid(format!(
            "{what} covers {offset}+{length}, past the end of {file} ({} bytes)",
            entry.size
        )));
    }
    if layer.size == 0 || layer.size > max_compressed(length) {
        return Err(why.invalid(format!(
            "{what} is {} bytes compressed for {length} bytes of data",
            layer.size
        )));
    }
    let chunk = Chunk {
        offset,
        length,
        digest,
        size: layer.size,
        codec,
    };
    Ok((index, chunk))
}

/// Puts each file's chunks in offset order and refuses overlapping ones.
fn sort_chunks(files: &mut [FileEntry], why: Refusal<'_>) -> Result<()> {
    for f in files {
        f.chunks.sort_by_key(|c| c.offset);
        if let Some(w) = f
            .chunks
            .windows(2)
            .find(|w| w[0].offset + w[0].length > w[1].offset)
        {
            return Err(why.invalid(format!(
                "chunks of {} at {} and {} overlap",
                f.name, w[0].offset, w[1].offset
            )));
        }
    }
    Ok(())
}

/// Checks a digest is `sha256:<64 hex>`: a malformed one is invalid, another algorithm is
/// unsupported.
fn check_digest(digest: &str, what: &str, why: Refusal<'_>) -> Result<Digest> {
    if let Some(d) = Digest::checked(digest) {
        return Ok(d);
    }
    if digest.starts_with("sha256:") || !digest.contains(':') {
        return Err(why.invalid(format!("{what} has a malformed digest {digest:?}")));
    }
    Err(why.unsupported(format!("a digest algorithm in {digest:?}")))
}

/// Checks a config blob: its `format` first (so a newer agent's snapshot is named as such), then
/// the whole [`Manifest`].
pub(super) fn parse_config(reference: &str, bytes: &[u8]) -> Result<Manifest> {
    let invalid = |reason: String| Error::Invalid {
        reference: reference.to_owned(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| invalid(format!("config is not JSON: {e}")))?;
    match value.get("format").and_then(serde_json::Value::as_u64) {
        Some(f) if f == u64::from(FORMAT) => {}
        Some(f) => {
            return Err(Error::Unsupported {
                reference: reference.to_owned(),
                found: format!("snapshot format {f} (not {FORMAT})"),
            });
        }
        None => return Err(invalid("config has no numeric format".into())),
    }
    serde_json::from_value(value).map_err(|e| invalid(format!("config does not parse: {e}")))
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::super::{DISK, INITRD, MEMORY, Source, VMM_NOTE, VMSTATE};
    use super::*;

    pub(in super::super) const MIB: u64 = 1 << 20;

    #[test]
    fn chunks_cover_the_file_and_holes_are_marked() {
        let p = plan_chunks(100 * MIB, 32 * MIB, &[(0, 4096), (70 * MIB, 70 * MIB + 1)]);
        assert_eq!(p.len(), 4);
        assert_eq!(
            p.iter().map(|c| (c.offset, c.len)).collect::<Vec<_>>(),
            vec![
                (0, 32 * MIB),
                (32 * MIB, 32 * MIB),
                (64 * MIB, 32 * MIB),
                (96 * MIB, 4 * MIB)
            ]
        );
        assert_eq!(
            p.iter().map(|c| c.may_hold_data).collect::<Vec<_>>(),
            vec![true, false, true, false]
        );
        // A range ending exactly at a chunk boundary does not touch the next chunk.
        let p = plan_chunks(64 * MIB, 32 * MIB, &[(0, 32 * MIB)]);
        assert_eq!(
            p.iter().map(|c| c.may_hold_data).collect::<Vec<_>>(),
            vec![true, false]
        );
        assert!(plan_chunks(0, 32 * MIB, &[]).is_empty());
        // A file system that reports the whole file as data: every chunk is read.
        assert!(
            plan_chunks(70 * MIB, 32 * MIB, &[(0, 70 * MIB)])
                .iter()
                .all(|c| c.may_hold_data)
        );
    }

    #[test]
    fn zeros_and_nonzero_runs() {
        assert!(is_zero(&[]));
        assert!(is_zero(&[0; 10_000]));
        let mut b = vec![0u8; 5 * BLOCK + 100];
        assert!(nonzero_runs(&b, BLOCK).is_empty());
        b[BLOCK + 1] = 1;
        b[2 * BLOCK] = 1;
        b[5 * BLOCK + 99] = 1;
        assert!(!is_zero(&b));
        assert_eq!(
            nonzero_runs(&b, BLOCK),
            vec![BLOCK..3 * BLOCK, 5 * BLOCK..5 * BLOCK + 100]
        );
    }

    #[test]
    fn codecs_round_trip_and_are_bounded() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let gz = encode(&data).unwrap();
        assert_eq!(gz, encode(&data).unwrap(), "deterministic");
        assert!((gz.len() as u64) < max_compressed(data.len() as u64));
        assert_eq!(decode(Codec::Gzip, &gz, data.len() as u64).unwrap(), data);
        let e = decode(Codec::Gzip, &gz, 1000).unwrap_err().to_string();
        assert!(e.contains("more than 1000"), "{e}");
        let e = decode(Codec::Gzip, &gz, 300_000).unwrap_err().to_string();
        assert!(e.contains("200000 bytes decompressed"), "{e}");
        assert!(decode(Codec::Gzip, b"not gzip", 8).is_err());
        let zs = ruzstd::encoding::compress_to_vec(
            &data[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        assert_eq!(decode(Codec::Zstd, &zs, data.len() as u64).unwrap(), data);
        assert!(decode(Codec::Zstd, &zs, 10).is_err());
        // Random data does not compress; the bound still holds.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..(4 * MIB) as usize)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let gz = encode(&noise).unwrap();
        assert!((gz.len() as u64) <= max_compressed(noise.len() as u64));
    }

    /// An artifact with a chunk of each kind: stored, a hole between two, a file of holes.
    pub(in super::super) fn artifact() -> Artifact {
        Artifact {
            config_digest: Digest::of(b"{}"),
            config_size: 2,
            files: vec![
                FileEntry {
                    name: VMSTATE,
                    size: 1000,
                    chunks: vec![Chunk {
                        offset: 0,
                        length: 1000,
                        digest: Digest::of(b"a"),
                        size: 50,
                        codec: Codec::Gzip,
                    }],
                },
                FileEntry {
                    name: MEMORY,
                    size: 96 * MIB,
                    chunks: vec![
                        Chunk {
                            offset: 0,
                            length: 32 * MIB,
                            digest: Digest::of(b"b"),
                            size: 4000,
                            codec: Codec::Gzip,
                        },
                        Chunk {
                            offset: 64 * MIB,
                            length: 32 * MIB,
                            digest: Digest::of(b"c"),
                            size: 5000,
                            codec: Codec::Gzip,
                        },
                    ],
                },
                FileEntry {
                    name: DISK,
                    size: 10 * MIB,
                    chunks: vec![],
                },
                FileEntry {
                    name: INITRD,
                    size: 0,
                    chunks: vec![],
                },
                FileEntry {
                    name: VMM_NOTE,
                    size: 0,
                    chunks: vec![],
                },
            ],
        }
    }

    #[test]
    fn manifest_round_trips_with_holes_absent() {
        let a = artifact();
        let bytes = build_manifest(&a, 32 * MIB).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["artifactType"], ARTIFACT_TYPE);
        assert_eq!(v["mediaType"], OCI_MANIFEST);
        assert_eq!(v["config"]["mediaType"], CONFIG_MEDIA_TYPE);
        assert_eq!(
            v["layers"].as_array().unwrap().len(),
            3,
            "the hole has no layer"
        );
        assert_eq!(v["layers"][2]["annotations"][ANNOTATION_OFFSET], "67108864");
        assert_eq!(
            v["annotations"]["dev.imp.snapshot.size.disk.ext4"],
            "10485760"
        );
        assert_eq!(parse_artifact("r", &bytes).unwrap(), a);
    }

    /// Rewrites the manifest of [`artifact`] with `f` and parses it.
    fn tampered(f: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut v: serde_json::Value =
            serde_json::from_slice(&build_manifest(&artifact(), 32 * MIB).unwrap()).unwrap();
        f(&mut v);
        parse_artifact("reg.example/snaps:x", &serde_json::to_vec(&v).unwrap())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn foreign_or_hostile_manifests_are_refused_by_name() {
        let e = tampered(|v| v["artifactType"] = "application/vnd.other".into());
        assert!(
            e.contains("reg.example/snaps:x") && e.contains("not an imp snapshot"),
            "{e}"
        );
        assert!(e.contains("application/vnd.other"), "{e}");
        let e = tampered(|v| {
            v.as_object_mut().unwrap().remove("artifactType");
        });
        assert!(
            e.contains("no artifactType") && e.contains(CONFIG_MEDIA_TYPE),
            "{e}"
        );
        let e = tampered(|v| v["artifactType"] = "application/vnd.imp.snapshot.v2".into());
        assert!(
            e.contains("cannot read") && e.contains("snapshot.v2"),
            "{e}"
        );
        let e = tampered(|v| v["mediaType"] = "application/vnd.oci.image.index.v1+json".into());
        assert!(e.contains("index"), "{e}");
        let e = tampered(|v| v["layers"][0]["mediaType"] = "application/x-tar".into());
        assert!(
            e.contains("application/x-tar") && e.contains("cannot read"),
            "{e}"
        );
        let e = tampered(|v| v["config"]["mediaType"] = "application/json".into());
        assert!(e.contains("config media type"), "{e}");
        let e = tampered(|v| v["annotations"]["dev.imp.snapshot.size.memory"] = "1e30".into());
        assert!(e.contains("not a size"), "{e}");
        let e = tampered(|v| {
            v["annotations"]["dev.imp.snapshot.size.memory"] = (u64::MAX / 2).to_string().into()
        });
        assert!(e.contains("over the limit"), "{e}");
        let e = tampered(|v| {
            v["annotations"]
                .as_object_mut()
                .unwrap()
                .remove("dev.imp.snapshot.size.disk.ext4");
        });
        assert!(e.contains("missing"), "{e}");
        let e = tampered(|v| v["annotations"]["dev.imp.snapshot.size.../etc"] = "1".into());
        assert!(e.contains("a file named"), "{e}");
        let e = tampered(|v| v["layers"][0]["annotations"][ANNOTATION_FILE] = "../x".into());
        assert!(e.contains("a file named \"../x\""), "{e}");
        let e = tampered(|v| v["layers"][1]["annotations"][ANNOTATION_OFFSET] = "-1".into());
        assert!(e.contains("not a number"), "{e}");
        let e = tampered(|v| {
            v["layers"][2]["annotations"][ANNOTATION_OFFSET] = (u64::MAX - 5).to_string().into()
        });
        assert!(e.contains("past the end"), "{e}");
        let e = tampered(|v| v["layers"][2]["annotations"][ANNOTATION_OFFSET] = "1048576".into());
        assert!(e.contains("overlap"), "{e}");
        let e = tampered(|v| {
            v["layers"][1]["annotations"][ANNOTATION_LENGTH] = (1u64 << 40).to_string().into()
        });
        assert!(e.contains("outside"), "{e}");
        let e = tampered(|v| v["layers"][1]["size"] = (40 * MIB).into());
        assert!(e.contains("compressed"), "{e}");
        let e = tampered(|v| v["layers"][1]["digest"] = "sha256:XYZ".into());
        assert!(e.contains("malformed digest"), "{e}");
        let e =
            tampered(|v| v["layers"][1]["digest"] = format!("sha512:{}", "a".repeat(128)).into());
        assert!(e.contains("digest algorithm"), "{e}");
        let e = tampered(|v| v["config"]["size"] = (2 * MIB).into());
        assert!(e.contains("config of"), "{e}");
        let e = parse_artifact("r", b"<html>").unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn config_format_is_checked_first() {
        let m = Manifest {
            format: FORMAT,
            vmm: "qemu 7.2.22".into(),
            machine: "microvm".into(),
            vcpus: 2,
            memory_mib: 256,
            source: Source {
                namespace: "ns".into(),
                name: "vm".into(),
                image: "img".into(),
            },
            taken_unix: 1,
            pause_ms: 2,
        };
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(parse_config("r", &bytes).unwrap(), m);
        let e = parse_config("reg/x:1", br#"{"format":99,"whatever":true}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("reg/x:1") && e.contains("format 99"), "{e}");
        assert!(parse_config("r", br#"{"format":1}"#).is_err());
    }
}
