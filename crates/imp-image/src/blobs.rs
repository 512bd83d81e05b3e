//! The content-addressed blob cache: `<root>/blobs/sha256/<hex>`, each file written to a
//! temporary name, checked against its digest and size, fsynced and renamed into place.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use futures::{Stream, StreamExt};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use super::manifest::{Descriptor, Digest};
use super::progress::{Event, Meter, Metered, Reporter};
use super::{ImageError, Result, blocking};

/// Distinguishes temporary files of concurrent writers in one process.
static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

/// A fresh temporary path next to `final_path`'s directory `dir`.
pub(crate) fn temp_path(dir: &Path, stem: &str) -> PathBuf {
    let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(".{stem}.{}.{n}.tmp", std::process::id()))
}

/// The process that made the temporary name `name` with [`temp_path`] (`.STEM.PID.N.tmp`).
pub(crate) fn temp_owner(name: &str) -> Option<i32> {
    let inner = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = inner.rsplitn(3, '.');
    let _n: u64 = parts.next()?.parse().ok()?;
    let pid = parts.next()?.parse().ok()?;
    parts.next().filter(|stem| !stem.is_empty())?;
    Some(pid)
}

/// Fsyncs directory `dir`, so a rename into it survives a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(ImageError::io("Syncing directory", dir))
}

/// Blobs on disk, named by digest.
#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    /// A store under `root` (the image cache root).
    pub fn new(root: &Path) -> Self {
        Self {
            dir: root.join("blobs").join("sha256"),
        }
    }

    /// Where the blob `digest` lives (or would).
    pub fn path(&self, digest: &Digest) -> PathBuf {
        self.dir.join(digest.hex())
    }

    /// True when the blob is cached with the descriptor's size (its digest is checked on use).
    pub async fn has(&self, desc: &Descriptor) -> bool {
        tokio::fs::metadata(self.path(&desc.digest))
            .await
            .is_ok_and(|m| m.is_file() && m.len() == desc.size)
    }

    async fn ensure_dir(&self) -> Result<()> {
        tokio::fs::create_dir_all(&self.dir)
            .await
            .map_err(ImageError::io("Creating the blob directory", &self.dir))
    }

    /// Writes `bytes` (already verified against `digest`) as that blob.
    pub async fn put(&self, digest: &Digest, bytes: &[u8]) -> Result<()> {
        let stream =
            futures::stream::iter([Ok::<_, io::Error>(bytes::Bytes::copy_from_slice(bytes))]);
        let desc = Descriptor {
            media_type: String::new(),
            digest: digest.clone(),
            size: bytes.len() as u64,
        };
        self.put_stream(&desc, stream, "document").await
    }

    /// Streams a blob into the cache, failing (and keeping nothing) unless it has exactly the
    /// descriptor's size and digest. `what` names it in errors.
    pub async fn put_stream<S, E>(&self, desc: &Descriptor, mut stream: S, what: &str) -> Result<()>
    where
        S: Stream<Item = std::result::Result<bytes::Bytes, E>> + Unpin,
        E: Into<io::Error>,
    {
        self.ensure_dir().await?;
        let tmp = temp_path(&self.dir, desc.digest.hex());
        let result = async {
            let mut file = tokio::fs::File::create(&tmp)
                .await
                .map_err(ImageError::io("Creating blob temp file", &tmp))?;
            let mut hasher = Sha256::new();
            let mut len = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| ImageError::Download {
                    what: what.to_owned(),
                    digest: desc.digest.to_string(),
                    source: e.into(),
                })?;
                len += chunk.len() as u64;
                if len > desc.size {
                    return Err(ImageError::SizeMismatch {
                        what: format!("{what} {}", desc.digest),
                        expected: desc.size,
                        actual: len,
                    });
                }
                hasher.update(&chunk);
                file.write_all(&chunk)
                    .await
                    .map_err(ImageError::io("Writing blob", &tmp))?;
            }
            self.finish(file, hasher, len, desc, what, &tmp).await
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
    }

    async fn finish(
        &self,
        mut file: tokio::fs::File,
        hasher: Sha256,
        len: u64,
        desc: &Descriptor,
        what: &str,
        tmp: &Path,
    ) -> Result<()> {
        if len != desc.size {
            return Err(ImageError::SizeMismatch {
                what: format!("{what} {}", desc.digest),
                expected: desc.size,
                actual: len,
            });
        }
        let actual = Digest::from_hasher(hasher);
        if actual != desc.digest {
            return Err(ImageError::DigestMismatch {
                what: what.to_owned(),
                expected: desc.digest.to_string(),
                actual: actual.to_string(),
            });
        }
        file.flush()
            .await
            .map_err(ImageError::io("Writing blob", tmp))?;
        file.sync_all()
            .await
            .map_err(ImageError::io("Syncing blob", tmp))?;
        drop(file);
        let dest = self.path(&desc.digest);
        tokio::fs::rename(tmp, &dest)
            .await
            .map_err(ImageError::io("Renaming blob into the cache", &dest))?;
        let dir = self.dir.clone();
        blocking(move || sync_dir(&dir)).await
    }

    /// Copies the local file `src` into the cache as blob `desc`, with the same checks.
    pub async fn import_file(&self, desc: &Descriptor, src: &Path, what: &str) -> Result<()> {
        let meter = Reporter::default().meter(0, |index, bytes| Event::Fetching { index, bytes });
        self.import_file_metered(desc, src, what, meter).await
    }

    /// [`Self::import_file`], counting the bytes copied into `meter`.
    pub(crate) async fn import_file_metered(
        &self,
        desc: &Descriptor,
        src: &Path,
        what: &str,
        meter: Meter,
    ) -> Result<()> {
        self.ensure_dir().await?;
        let store = self.clone();
        let (desc, src, what) = (desc.clone(), src.to_path_buf(), what.to_owned());
        blocking(move || store.import_blocking(&desc, &src, &what, meter)).await
    }

    fn import_blocking(
        &self,
        desc: &Descriptor,
        src: &Path,
        what: &str,
        meter: Meter,
    ) -> Result<()> {
        let tmp = temp_path(&self.dir, desc.digest.hex());
        let result = (|| {
            let input = std::fs::File::open(src).map_err(ImageError::io("Opening blob", src))?;
            let input = Metered::new(input, meter);
            let mut out = std::fs::File::create(&tmp)
                .map_err(ImageError::io("Creating blob temp file", &tmp))?;
            let mut reader = HashingReader::new(input.take(desc.size + 1));
            io::copy(&mut reader, &mut out).map_err(ImageError::io("Copying blob", src))?;
            let (hasher, len) = reader.finish();
            check(desc, hasher, len, what)?;
            out.flush().map_err(ImageError::io("Writing blob", &tmp))?;
            out.sync_all()
                .map_err(ImageError::io("Syncing blob", &tmp))?;
            let dest = self.path(&desc.digest);
            std::fs::rename(&tmp, &dest)
                .map_err(ImageError::io("Renaming blob into the cache", &dest))?;
            sync_dir(&self.dir)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Reads a cached manifest or index by digest alone, if present and intact.
    pub async fn read_cached_document(
        &self,
        digest: &Digest,
        what: &str,
    ) -> Result<Option<Vec<u8>>> {
        let path = self.path(digest);
        match tokio::fs::metadata(&path).await {
            Ok(md) if md.is_file() && md.len() <= super::manifest::MAX_DOCUMENT_BYTES => {}
            _ => return Ok(None),
        }
        let bytes = tokio::fs::read(&path)
            .await
            .map_err(ImageError::io("Reading cached manifest", &path))?;
        if digest.verify(&bytes, what).is_err() {
            let _ = tokio::fs::remove_file(&path).await;
            return Ok(None);
        }
        Ok(Some(bytes))
    }

    /// Reads a small cached blob (manifest, config) and checks its digest and size.
    pub async fn read_verified(&self, desc: &Descriptor, what: &str) -> Result<Vec<u8>> {
        if desc.size > super::manifest::MAX_DOCUMENT_BYTES {
            return Err(ImageError::Manifest {
                what: what.to_owned(),
                reason: format!("{} bytes is more than the limit", desc.size),
            });
        }
        let path = self.path(&desc.digest);
        let bytes = tokio::fs::read(&path)
            .await
            .map_err(ImageError::io("Reading cached blob", &path))?;
        if bytes.len() as u64 != desc.size {
            return Err(ImageError::SizeMismatch {
                what: format!("{what} {}", desc.digest),
                expected: desc.size,
                actual: bytes.len() as u64,
            });
        }
        desc.digest.verify(&bytes, what)?;
        Ok(bytes)
    }
}

/// Fails unless a hashed stream of `len` bytes matches `desc`.
pub(crate) fn check(desc: &Descriptor, hasher: Sha256, len: u64, what: &str) -> Result<()> {
    if len != desc.size {
        return Err(ImageError::SizeMismatch {
            what: format!("{what} {}", desc.digest),
            expected: desc.size,
            actual: len,
        });
    }
    let actual = Digest::from_hasher(hasher);
    if actual != desc.digest {
        return Err(ImageError::DigestMismatch {
            what: what.to_owned(),
            expected: desc.digest.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

/// A reader that hashes and counts what passes through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    len: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            len: 0,
        }
    }

    /// Reads the rest to the end (decoders may stop early), then returns hash and length.
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(|_| ())
    }

    pub(crate) fn finish(self) -> (Sha256, u64) {
        (self.hasher, self.len)
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_carry_their_owner() {
        let p = temp_path(Path::new("/c/tmp"), "unpack-ab.cd");
        let name = p.file_name().unwrap().to_str().unwrap();
        assert_eq!(temp_owner(name), Some(std::process::id() as i32));
        for other in [
            "ab.ext4",
            ".x.tmp",
            ".x.12.tmp",
            "..12.3.tmp",
            ".x.a.3.tmp",
            ".x.1.2",
        ] {
            assert_eq!(temp_owner(other), None, "{other}");
        }
    }
}
