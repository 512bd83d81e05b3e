//! Pushing a snapshot directory: each file's chunks planned from its data ranges, read,
//! compressed and uploaded a few at a time (holes and zero chunks skipped, chunks the registry
//! has already not sent again), then the config and the manifest.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _, stream};
use imp_image::RegistryAuth;
use imp_image::manifest::{Digest, MAX_DOCUMENT_BYTES, OCI_MANIFEST};
use imp_image::registry::{Placed, Session};

use super::super::{FORMAT, MANIFEST, Manifest, sparse};
use super::format::{
    Artifact, Chunk, Codec, FileEntry, Planned, build_manifest, encode, is_zero, plan_chunks,
};
use super::{
    BLOCK, Error, FILES, LAYER_JSON_BYTES, MAX_CHUNK_BYTES, MAX_CONFIG_BYTES, MAX_FILE_BYTES,
    PushOptions, PushOutcome, Result, io_err, push_target,
};

/// A file of the directory being pushed.
struct Source {
    name: &'static str,
    path: PathBuf,
    file: Arc<File>,
    size: u64,
}

/// A chunk read and compressed, ready to upload.
struct Prepared {
    data: Bytes,
    digest: Digest,
}

/// What became of one planned chunk.
enum ChunkResult {
    Hole,
    Stored { chunk: Chunk, uploaded: bool },
}

/// Pushes the snapshot directory `dir` to `reference` (`registry/repository:tag`) with the
/// default [`PushOptions`].
pub async fn push(dir: &Path, reference: &str, auth: &RegistryAuth) -> Result<PushOutcome> {
    push_with(dir, reference, auth, PushOptions::default()).await
}

/// Pushes the snapshot directory `dir` to `reference` in the registry format the `oci`
/// module's docs describe. The directory must not change while it is pushed.
pub async fn push_with(
    dir: &Path,
    reference: &str,
    auth: &RegistryAuth,
    options: PushOptions,
) -> Result<PushOutcome> {
    check_push_options(&options)?;
    let target = push_target(reference)?;
    let started = std::time::Instant::now();

    let config_path = dir.join(MANIFEST);
    let config = read_config(dir, &config_path).await?;
    let sources = open_sources(dir).await?;
    let plans = plan_sources(&sources, options.chunk_bytes).await?;
    check_manifest_room(&plans, options.chunk_bytes)?;

    let session = Session::new(target, auth);
    session.authenticate_push().await?;

    let session = &session;
    let sources = &sources;
    let results: Vec<(usize, ChunkResult)> = stream::iter(plans)
        .map(|(i, plan)| async move {
            push_chunk(session, reference, &sources[i], plan)
                .await
                .map(|r| (i, r))
        })
        .buffered(options.in_flight)
        .try_collect()
        .await?;

    let files = sources
        .iter()
        .map(|s| FileEntry {
            name: s.name,
            size: s.size,
            chunks: Vec::new(),
        })
        .collect();
    let (mut outcome, files) = tally(files, results, config.len() as u64);
    let config_digest = Digest::of(&config);
    let config_len = config.len() as u64;
    let what = format!("the config of {reference}");
    if session
        .push_blob(Bytes::from(config), &config_digest, &what)
        .await?
        == Placed::Uploaded
    {
        outcome.bytes_uploaded += config_len;
    }
    let artifact = Artifact {
        config_digest,
        config_size: config_len,
        files,
    };
    let (digest, manifest_bytes) =
        push_manifest(session, reference, &artifact, options.chunk_bytes).await?;
    outcome.bytes_uploaded += manifest_bytes;
    outcome.reference = format!("{}@{digest}", session.reference().whole());
    outcome.digest = digest.to_string();
    tracing::info!(
        reference = %outcome.reference,
        chunks = outcome.chunks,
        reused = outcome.chunks_reused,
        holes = outcome.holes,
        bytes_uploaded = outcome.bytes_uploaded,
        bytes_data = outcome.bytes_data,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "snapshot pushed"
    );
    Ok(outcome)
}

/// Refuses options a push cannot use: chunks must be whole blocks up to [`MAX_CHUNK_BYTES`],
/// and at least one chunk must be in flight.
fn check_push_options(options: &PushOptions) -> Result<()> {
    if options.chunk_bytes == 0
        || !options.chunk_bytes.is_multiple_of(BLOCK as u64)
        || options.chunk_bytes > MAX_CHUNK_BYTES
        || options.in_flight == 0
    {
        return Err(Error::Options {
            reason: format!(
                "chunk_bytes {} must be a multiple of {BLOCK} up to {MAX_CHUNK_BYTES}, in_flight {} at least 1",
                options.chunk_bytes, options.in_flight
            ),
        });
    }
    Ok(())
}

/// The chunks of every source, each with its source's index, planned from the data ranges
/// the file system reports (read on a blocking thread).
async fn plan_sources(sources: &[Source], chunk_bytes: u64) -> Result<Vec<(usize, Planned)>> {
    let mut plans = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        let file = s.file.clone();
        let path = s.path.clone();
        let ranges = tokio::task::spawn_blocking(move || sparse::data_ranges(&file))
            .await
            .map_err(|source| Error::Task {
                what: format!("finding the data of {path:?}"),
                source,
            })?
            .map_err(io_err("Finding the data ranges of", &s.path))?;
        plans.extend(
            plan_chunks(s.size, chunk_bytes, &ranges)
                .into_iter()
                .map(|p| (i, p)),
        );
    }
    Ok(plans)
}

/// Refuses a push whose manifest could grow past what a registry (and a pull) accepts: every
/// chunk that may hold data may become a layer.
fn check_manifest_room(plans: &[(usize, Planned)], chunk_bytes: u64) -> Result<()> {
    let candidates = plans.iter().filter(|(_, p)| p.may_hold_data).count() as u64;
    if candidates * LAYER_JSON_BYTES + 4096 > MAX_DOCUMENT_BYTES {
        return Err(Error::Options {
            reason: format!(
                "{candidates} chunks of {chunk_bytes} bytes would need a manifest over {MAX_DOCUMENT_BYTES} bytes; use larger chunks"
            ),
        });
    }
    Ok(())
}

/// Adds the chunks pushed to their `files` (by index, in plan order) and counts them: the
/// outcome so far (reference, digest and the config's and manifest's uploads still to fill
/// in) with `config_bytes` already stored.
fn tally(
    mut files: Vec<FileEntry>,
    results: Vec<(usize, ChunkResult)>,
    config_bytes: u64,
) -> (PushOutcome, Vec<FileEntry>) {
    let mut outcome = PushOutcome {
        reference: String::new(),
        digest: String::new(),
        bytes_uploaded: 0,
        bytes_stored: config_bytes,
        bytes_data: 0,
        chunks: 0,
        chunks_reused: 0,
        holes: 0,
    };
    for (i, r) in results {
        match r {
            ChunkResult::Hole => outcome.holes += 1,
            ChunkResult::Stored { chunk, uploaded } => {
                outcome.chunks += 1;
                outcome.bytes_stored += chunk.size;
                outcome.bytes_data += chunk.length;
                if uploaded {
                    outcome.bytes_uploaded += chunk.size;
                } else {
                    outcome.chunks_reused += 1;
                }
                files[i].chunks.push(chunk);
            }
        }
    }
    (outcome, files)
}

/// Pushes the manifest of `artifact` (its blobs already uploaded) under the session's tag;
/// returns its digest and its size in bytes.
async fn push_manifest(
    session: &Session,
    reference: &str,
    artifact: &Artifact,
    chunk_bytes: u64,
) -> Result<(Digest, u64)> {
    let manifest = build_manifest(artifact, chunk_bytes).map_err(|e| Error::Invalid {
        reference: reference.to_owned(),
        reason: format!("serialising the manifest: {e}"),
    })?;
    let len = manifest.len() as u64;
    let digest = session.push_manifest(manifest, OCI_MANIFEST).await?;
    Ok((digest, len))
}

/// Reads `snapshot.json` and checks it is a snapshot manifest of [`FORMAT`].
async fn read_config(dir: &Path, path: &Path) -> Result<Vec<u8>> {
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(io_err("Reading the snapshot manifest", path))?;
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(Error::Directory {
            dir: dir.to_path_buf(),
            reason: format!(
                "{MANIFEST} is {} bytes, over {MAX_CONFIG_BYTES}",
                meta.len()
            ),
        });
    }
    let bytes = tokio::fs::read(path)
        .await
        .map_err(io_err("Reading the snapshot manifest", path))?;
    match serde_json::from_slice::<Manifest>(&bytes) {
        Ok(m) if m.format == FORMAT => Ok(bytes),
        Ok(m) => Err(Error::Directory {
            dir: dir.to_path_buf(),
            reason: format!("{MANIFEST} has format {}, not {FORMAT}", m.format),
        }),
        Err(e) => Err(Error::Directory {
            dir: dir.to_path_buf(),
            reason: format!("{MANIFEST} does not parse: {e}"),
        }),
    }
}

/// Opens every file of [`FILES`]; each must be a regular file.
async fn open_sources(dir: &Path) -> Result<Vec<Source>> {
    let mut out = Vec::new();
    for name in FILES {
        let path = dir.join(name);
        let p = path.clone();
        let opened =
            tokio::task::spawn_blocking(move || -> io::Result<(File, std::fs::Metadata)> {
                let f = File::open(&p)?;
                let m = f.metadata()?;
                Ok((f, m))
            })
            .await
            .map_err(|source| Error::Task {
                what: format!("opening {path:?}"),
                source,
            })?;
        let (file, meta) = match opened {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Error::Directory {
                    dir: dir.to_path_buf(),
                    reason: format!("{name} is missing"),
                });
            }
            Err(e) => return Err(io_err("Opening", &path)(e)),
        };
        if !meta.is_file() {
            return Err(Error::Directory {
                dir: dir.to_path_buf(),
                reason: format!("{name} is not a regular file"),
            });
        }
        if meta.len() > MAX_FILE_BYTES {
            return Err(Error::Directory {
                dir: dir.to_path_buf(),
                reason: format!("{name} is {} bytes, over {MAX_FILE_BYTES}", meta.len()),
            });
        }
        out.push(Source {
            name,
            path,
            file: Arc::new(file),
            size: meta.len(),
        });
    }
    Ok(out)
}

/// Reads, checks, compresses and uploads one chunk.
async fn push_chunk(
    session: &Session,
    reference: &str,
    src: &Source,
    plan: Planned,
) -> Result<ChunkResult> {
    if !plan.may_hold_data {
        return Ok(ChunkResult::Hole);
    }
    let (file, path) = (src.file.clone(), src.path.clone());
    let prepared = tokio::task::spawn_blocking(move || prepare(&file, &path, plan))
        .await
        .map_err(|source| Error::Task {
            what: format!("reading {}@{}", src.name, plan.offset),
            source,
        })??;
    let Some(prepared) = prepared else {
        return Ok(ChunkResult::Hole);
    };
    let size = prepared.data.len() as u64;
    let what = format!("chunk {}@{} of {reference}", src.name, plan.offset);
    let placed = session
        .push_blob(prepared.data, &prepared.digest, &what)
        .await?;
    let uploaded = placed == Placed::Uploaded;
    tracing::debug!(
        file = src.name,
        offset = plan.offset,
        size,
        ?placed,
        "snapshot chunk"
    );
    Ok(ChunkResult::Stored {
        chunk: Chunk {
            offset: plan.offset,
            length: plan.len,
            digest: prepared.digest,
            size,
            codec: Codec::Gzip,
        },
        uploaded,
    })
}

/// Blocking: reads a chunk; `None` when it is all zero, else its compressed bytes and digest.
fn prepare(file: &File, path: &Path, plan: Planned) -> Result<Option<Prepared>> {
    let len =
        usize::try_from(plan.len).map_err(|e| io_err("Reading", path)(io::Error::other(e)))?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, plan.offset)
        .map_err(io_err("Reading", path))?;
    if is_zero(&buf) {
        return Ok(None);
    }
    let compressed = encode(&buf).map_err(io_err("Compressing a chunk of", path))?;
    drop(buf);
    let digest = Digest::of(&compressed);
    Ok(Some(Prepared {
        data: Bytes::from(compressed),
        digest,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::format::tests::{MIB, artifact};
    use super::*;

    #[test]
    fn push_options_and_manifest_room_are_checked_before_any_request() {
        let ok = PushOptions::default();
        assert!(check_push_options(&ok).is_ok());
        for bad in [
            PushOptions {
                chunk_bytes: 0,
                ..ok
            },
            PushOptions {
                chunk_bytes: 4097,
                ..ok
            },
            PushOptions {
                chunk_bytes: MAX_CHUNK_BYTES + BLOCK as u64,
                ..ok
            },
            PushOptions { in_flight: 0, ..ok },
        ] {
            let e = check_push_options(&bad).unwrap_err().to_string();
            assert!(e.contains("chunk_bytes"), "{e}");
        }
        let plan = |may_hold_data| Planned {
            offset: 0,
            len: 4096,
            may_hold_data,
        };
        let fits = (MAX_DOCUMENT_BYTES - 4096) / LAYER_JSON_BYTES;
        let mut plans: Vec<(usize, Planned)> = (0..fits).map(|_| (0, plan(true))).collect();
        plans.push((0, plan(false)));
        assert!(
            check_manifest_room(&plans, 4096).is_ok(),
            "holes take no room"
        );
        plans.push((1, plan(true)));
        let e = check_manifest_room(&plans, 4096).unwrap_err().to_string();
        assert!(e.contains("use larger chunks"), "{e}");
    }

    #[test]
    fn tally_puts_chunks_in_their_files_and_counts_reuse_and_holes() {
        let mut expected = artifact();
        let files: Vec<FileEntry> = expected
            .files
            .iter()
            .map(|f| FileEntry {
                chunks: Vec::new(),
                ..f.clone()
            })
            .collect();
        let stored = |file: usize, n: usize, uploaded| {
            let chunk = expected.files[file].chunks[n].clone();
            (file, ChunkResult::Stored { chunk, uploaded })
        };
        let results = vec![
            stored(0, 0, true),
            stored(1, 0, false),
            (1, ChunkResult::Hole),
            stored(1, 1, true),
            (2, ChunkResult::Hole),
        ];
        let (outcome, files) = tally(files, results, 2);
        assert_eq!(files, std::mem::take(&mut expected.files));
        assert_eq!(
            (outcome.chunks, outcome.chunks_reused, outcome.holes),
            (3, 1, 2)
        );
        assert_eq!(outcome.bytes_uploaded, 50 + 5000);
        assert_eq!(outcome.bytes_stored, 2 + 50 + 4000 + 5000);
        assert_eq!(outcome.bytes_data, 1000 + 64 * MIB);
    }
}
