//! Pulling a snapshot into a directory: the manifest and config checked first, every chunk
//! downloaded a few at a time, verified, decompressed to its declared length and written with
//! its zero blocks left as holes, `snapshot.json` written last.

use std::fs::File;
use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt as _, TryStreamExt as _, stream};
use imp_image::RegistryAuth;
use imp_image::registry::Session;

use super::super::MANIFEST;
use super::format::{Artifact, Chunk, decode, nonzero_runs, parse_artifact, parse_config};
use super::{
    BLOCK, CONFIG_MEDIA_TYPE, Error, IN_FLIGHT, PullOutcome, Result, fetch_manifest, io_err,
    parse_reference,
};

/// A file being written by a pull.
struct Target {
    name: &'static str,
    partial: PathBuf,
    file: Arc<File>,
}

/// Pulls the snapshot `reference` (`registry/repository:tag` or `…@sha256:…`) into `dest`
/// (created if needed): every blob verified, files written sparse, `snapshot.json` written last,
/// so a directory with a `snapshot.json` is complete. Refuses anything that is not a snapshot
/// this agent can read.
pub async fn pull(reference: &str, dest: &Path, auth: &RegistryAuth) -> Result<PullOutcome> {
    let parsed = parse_reference(reference)?;
    let session = Session::new(parsed, auth);
    let started = std::time::Instant::now();
    let (bytes, digest) = fetch_manifest(&session, reference).await?;
    let artifact = parse_artifact(reference, &bytes)?;
    let config = session
        .blob(
            CONFIG_MEDIA_TYPE,
            &artifact.config_digest,
            artifact.config_size,
            &format!("the config of {reference}"),
        )
        .await?;
    let manifest = parse_config(reference, &config)?;

    // Owner-only: the snapshot holds its source VM's memory and environment (Secrets).
    let d = dest.to_path_buf();
    tokio::task::spawn_blocking(move || crate::host_fs::create_private_dir_all(&d))
        .await
        .map_err(io::Error::other)
        .and_then(|r| r)
        .map_err(io_err("Creating the snapshot directory", dest))?;
    let final_manifest = dest.join(MANIFEST);
    match tokio::fs::remove_file(&final_manifest).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err(
                "Removing the old snapshot manifest",
                &final_manifest,
            )(e));
        }
        _ => {}
    }
    let mut targets = Vec::new();
    let result = pull_files(&session, reference, &artifact, dest, &mut targets).await;
    let result = match result {
        Ok(counts) => finish(dest, &targets, &config).await.map(|()| counts),
        Err(e) => Err(e),
    };
    let (bytes_downloaded, bytes_written) = match result {
        Ok(c) => c,
        Err(e) => {
            for t in &targets {
                let _ = tokio::fs::remove_file(&t.partial).await;
            }
            return Err(e);
        }
    };
    let outcome = PullOutcome {
        digest: digest.to_string(),
        manifest,
        bytes_downloaded: bytes_downloaded + config.len() as u64,
        bytes_written,
    };
    tracing::info!(
        reference,
        digest = %outcome.digest,
        bytes_downloaded = outcome.bytes_downloaded,
        bytes_written = outcome.bytes_written,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "snapshot pulled"
    );
    Ok(outcome)
}

/// Creates the partial files at their sizes and fills in every chunk; returns (bytes
/// downloaded, bytes written).
async fn pull_files(
    session: &Session,
    reference: &str,
    artifact: &Artifact,
    dest: &Path,
    targets: &mut Vec<Target>,
) -> Result<(u64, u64)> {
    for f in &artifact.files {
        let partial = dest.join(format!(".{}.partial", f.name));
        let p = partial.clone();
        let size = f.size;
        let file = tokio::task::spawn_blocking(move || -> io::Result<File> {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&p)?;
            file.set_len(size)?;
            Ok(file)
        })
        .await
        .map_err(|source| Error::Task {
            what: format!("creating {partial:?}"),
            source,
        })?
        .map_err(io_err("Creating", &partial))?;
        targets.push(Target {
            name: f.name,
            partial,
            file: Arc::new(file),
        });
    }
    // Owned jobs: a borrowing iterator here makes the future `Send` for one lifetime only,
    // and a caller inside a kube Controller needs it for every one.
    let jobs: Vec<(usize, Chunk)> = artifact
        .files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| f.chunks.iter().map(move |c| (i, c.clone())))
        .collect();
    let targets = &targets;
    let counts: Vec<(u64, u64)> = stream::iter(jobs)
        .map(|(i, c)| async move { pull_chunk(session, reference, &targets[i], &c).await })
        .buffered(IN_FLIGHT)
        .try_collect()
        .await?;
    Ok(counts
        .iter()
        .fold((0, 0), |(d, w), (cd, cw)| (d + cd, w + cw)))
}

/// Downloads, checks, decompresses and writes one chunk; returns (downloaded, written).
async fn pull_chunk(
    session: &Session,
    reference: &str,
    t: &Target,
    c: &Chunk,
) -> Result<(u64, u64)> {
    let what = format!("chunk {}@{} ({})", t.name, c.offset, c.digest);
    let data = session
        .blob(
            c.codec.media_type(),
            &c.digest,
            c.size,
            &format!("{what} of {reference}"),
        )
        .await?;
    let (file, path, chunk, reference) = (
        t.file.clone(),
        t.partial.clone(),
        c.clone(),
        reference.to_owned(),
    );
    let written = tokio::task::spawn_blocking(move || -> Result<u64> {
        let plain =
            decode(chunk.codec, &data, chunk.length).map_err(|source| Error::Decompress {
                reference,
                what,
                source,
            })?;
        drop(data);
        let mut written = 0;
        for run in nonzero_runs(&plain, BLOCK) {
            file.write_all_at(&plain[run.clone()], chunk.offset + run.start as u64)
                .map_err(io_err("Writing", &path))?;
            written += run.len() as u64;
        }
        Ok(written)
    })
    .await
    .map_err(|source| Error::Task {
        what: format!("writing {}@{}", t.name, c.offset),
        source,
    })??;
    Ok((c.size, written))
}

/// Syncs and renames the partial files into place, then writes `snapshot.json`.
async fn finish(dest: &Path, targets: &[Target], config: &[u8]) -> Result<()> {
    for t in targets {
        let file = t.file.clone();
        tokio::task::spawn_blocking(move || file.sync_all())
            .await
            .map_err(|source| Error::Task {
                what: format!("syncing {:?}", t.partial),
                source,
            })?
            .map_err(io_err("Syncing", &t.partial))?;
        let to = dest.join(t.name);
        tokio::fs::rename(&t.partial, &to)
            .await
            .map_err(io_err("Moving into place", &to))?;
    }
    let tmp = dest.join(format!(".{MANIFEST}.partial"));
    let config = config.to_vec();
    let t = tmp.clone();
    tokio::task::spawn_blocking(move || -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&t)?;
        f.write_all(&config)?;
        f.sync_all()
    })
    .await
    .map_err(|source| Error::Task {
        what: format!("writing {tmp:?}"),
        source,
    })?
    .map_err(io_err("Writing", &tmp))?;
    let to = dest.join(MANIFEST);
    tokio::fs::rename(&tmp, &to)
        .await
        .map_err(io_err("Moving into place", &to))
}
