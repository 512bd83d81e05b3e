//! Console: the VM's serial log as a byte stream, from its start, then (when following) what is
//! appended while the VM runs.
//!
//! The log is read in chunks with tokio's file API, never whole. Following polls the file at
//! its end; it stops when the VM no longer runs (after one last read, so the final lines are
//! not lost) or when the caller goes away (the body is dropped).

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::fs::File;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use super::VmLookup;

/// How many bytes one chunk of the stream holds at most.
const CHUNK: usize = 32 * 1024;

/// What to stream and how.
pub struct Tail {
    /// The serial log.
    pub path: PathBuf,
    /// Keep streaming appended bytes while the VM runs.
    pub follow: bool,
    /// The VM's namespace, to ask `lookup` whether it still runs.
    pub namespace: String,
    /// The VM's name.
    pub name: String,
    /// Where to ask.
    pub lookup: Arc<dyn VmLookup>,
    /// Pause between looks at the end of the file.
    pub poll: Duration,
}

/// The stream's position between chunks.
struct State {
    tail: Tail,
    file: Option<File>,
    offset: u64,
    /// The VM was seen stopped: one more read, then the end.
    last: bool,
    done: bool,
}

impl Tail {
    /// The log as a stream of chunks.
    pub fn stream(self) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
        let state = State {
            tail: self,
            file: None,
            offset: 0,
            last: false,
            done: false,
        };
        futures::stream::unfold(state, |mut s| async move {
            if s.done {
                return None;
            }
            match s.next_chunk().await {
                Ok(Some(chunk)) => Some((Ok(chunk), s)),
                Ok(None) => None,
                Err(e) => {
                    s.done = true;
                    Some((Err(e), s))
                }
            }
        })
    }
}

impl State {
    async fn next_chunk(&mut self) -> io::Result<Option<Bytes>> {
        loop {
            if self.file.is_none() {
                match File::open(&self.tail.path).await {
                    Ok(f) => self.file = Some(f),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            if let Some(file) = self.file.as_mut() {
                let mut buf = vec![0u8; CHUNK];
                let n = file.read(&mut buf).await?;
                if n > 0 {
                    buf.truncate(n);
                    self.offset += n as u64;
                    return Ok(Some(Bytes::from(buf)));
                }
                // At the end. A log cut shorter than what we read was truncated: start over.
                if file.metadata().await?.len() < self.offset {
                    file.seek(io::SeekFrom::Start(0)).await?;
                    self.offset = 0;
                    continue;
                }
            }
            if !self.tail.follow || self.last {
                return Ok(None);
            }
            let running = self
                .tail
                .lookup
                .find(&self.tail.namespace, &self.tail.name)
                .is_some_and(|vm| vm.running);
            if running {
                tokio::time::sleep(self.tail.poll).await;
            } else {
                self.last = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::GuestEndpoint;
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct OneVm {
        log: PathBuf,
        running: AtomicBool,
    }

    impl VmLookup for OneVm {
        fn find(&self, _: &str, _: &str) -> Option<GuestEndpoint> {
            Some(GuestEndpoint {
                vsock: PathBuf::new(),
                agent_port: 0,
                serial_log: self.log.clone(),
                running: self.running.load(Ordering::SeqCst),
                guest_agent: true,
            })
        }
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("imp-console-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn tail(vm: &Arc<OneVm>, follow: bool) -> Tail {
        Tail {
            path: vm.log.clone(),
            follow,
            namespace: "ns".into(),
            name: "vm".into(),
            lookup: vm.clone(),
            poll: Duration::from_millis(20),
        }
    }

    #[tokio::test]
    async fn without_follow_the_log_so_far_comes_in_bounded_chunks() {
        let dir = scratch("nofollow");
        let vm = Arc::new(OneVm {
            log: dir.join("serial.log"),
            running: AtomicBool::new(true),
        });
        let content: Vec<u8> = (0..CHUNK * 3 + 5).map(|i| (i % 251) as u8).collect();
        std::fs::write(&vm.log, &content).unwrap();
        let chunks: Vec<Bytes> = tail(&vm, false)
            .stream()
            .map(|c| c.unwrap())
            .collect()
            .await;
        assert!(chunks.iter().all(|c| c.len() <= CHUNK));
        assert_eq!(chunks.concat(), content);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn following_streams_appended_bytes_and_ends_when_the_vm_stops() {
        let dir = scratch("follow");
        let vm = Arc::new(OneVm {
            log: dir.join("serial.log"),
            running: AtomicBool::new(true),
        });
        // The log does not exist yet: following waits for it.
        let mut stream = Box::pin(tail(&vm, true).stream());
        let writer = {
            let vm = vm.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                std::fs::write(&vm.log, b"boot\n").unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&vm.log)
                    .unwrap();
                f.write_all(b"last words\n").unwrap();
                vm.running.store(false, Ordering::SeqCst);
            })
        };
        let mut got = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(chunk) = stream.next().await {
                got.extend_from_slice(&chunk.unwrap());
            }
        })
        .await;
        assert!(ended.is_ok(), "the stream did not end after the VM stopped");
        assert_eq!(got, b"boot\nlast words\n");
        writer.await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
