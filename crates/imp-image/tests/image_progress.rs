//! What the image pipeline reports while it pulls a local OCI layout and builds its ext4 base:
//! the layers once resolved, each layer's bytes and its end, then each layer verified and
//! extracted, the build and the base; a second pull and build of the same image reports every
//! layer as already cached and the base as cached. Needs mkfs.ext4 (e2fsprogs).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use imp_image::progress::{Event, LayerInfo, Observer, Reporter};
use imp_image::{ImageSource, ImageStore, Limits, RegistryAuth};
use imp_testenv::registry::{TestImage, TestLayer, scratch_dir};

#[derive(Default)]
struct Record(Mutex<Vec<Event>>);

impl Observer for Record {
    fn event(&self, event: Event) {
        self.0.lock().unwrap().push(event);
    }
}

impl Record {
    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// The events without the byte counts (their number depends on timing), after checking that
/// each layer's counts only grow, stay within `sizes` and came in the phase they belong to.
fn without_bytes(events: &[Event], sizes: &[u64]) -> Vec<Event> {
    let mut last = std::collections::HashMap::new();
    for e in events {
        let (phase, index, bytes) = match e {
            Event::Fetching { index, bytes } => ("fetch", *index, *bytes),
            Event::Verifying { index, bytes } => ("verify", *index, *bytes),
            Event::Extracting { index, bytes } => ("extract", *index, *bytes),
            _ => continue,
        };
        assert!(bytes <= sizes[index], "{e:?} beyond the blob's size");
        let prev = last.insert((phase, index), bytes).unwrap_or(0);
        assert!(bytes >= prev, "{e:?} went back from {prev}");
    }
    events
        .iter()
        .filter(|e| {
            !matches!(
                e,
                Event::Fetching { .. } | Event::Verifying { .. } | Event::Extracting { .. }
            )
        })
        .cloned()
        .collect()
}

#[tokio::test]
async fn a_pull_and_build_report_each_layer_then_the_base() {
    if !imp_testenv::guard::require(
        imp_testenv::guard::which("mkfs.ext4").is_some(),
        "tool `mkfs.ext4` on PATH",
    ) {
        return;
    }
    let dir = scratch_dir("imp-progress-test").unwrap();
    let image = TestImage::new()
        .layer(
            TestLayer::new()
                .dir("etc", 0o755)
                .file("etc/big", vec![42u8; 300_000], 0o644),
        )
        .layer(TestLayer::new().file("etc/small", "small\n", 0o644));
    let written = image.write_layout(&dir.join("layout"), "v1").unwrap();
    let record = Arc::new(Record::default());
    let store = ImageStore::new(dir.join("cache"), Limits::default())
        .with_reporter(Reporter::new(record.clone()));
    let source: ImageSource = format!("oci:{}:v1", dir.join("layout").display())
        .parse()
        .unwrap();

    let pulled = store.pull(&source, &RegistryAuth::Anonymous).await.unwrap();
    let sizes: Vec<u64> = pulled.layers.iter().map(|l| l.size).collect();
    let events = record.take();
    // Every fetched layer says how far it got before it is done.
    for index in 0..2 {
        assert!(
            events.iter().any(
                |e| matches!(e, Event::Fetching { index: i, bytes } if *i == index && *bytes > 0)
            ),
            "no byte count for layer {index}: {events:?}"
        );
    }
    let layers: Vec<LayerInfo> = written
        .layer_digests
        .iter()
        .zip(&sizes)
        .map(|(digest, &size)| LayerInfo {
            digest: digest.clone(),
            size,
        })
        .collect();
    assert_eq!(
        without_bytes(&events, &sizes),
        [
            Event::Resolved {
                digest: written.digest.clone(),
                layers: layers.clone(),
            },
            Event::Fetched {
                index: 0,
                bytes: sizes[0]
            },
            Event::Fetched {
                index: 1,
                bytes: sizes[1]
            },
        ]
    );

    let base = store.rootfs(&pulled, &[]).await.unwrap();
    let events = record.take();
    assert_eq!(
        without_bytes(&events, &sizes),
        [
            Event::Extracted { index: 0 },
            Event::Extracted { index: 1 },
            Event::Building,
            Event::Built {
                size_bytes: base.size_bytes,
                cached: false
            },
        ]
    );
    // Every layer is read whole twice, verified before anything is extracted.
    let first_extract = events
        .iter()
        .position(|e| matches!(e, Event::Extracting { .. }))
        .unwrap();
    for index in 0..2 {
        let verified = events
            .iter()
            .position(|e| matches!(e, Event::Verifying { index: i, .. } if *i == index))
            .unwrap_or_else(|| panic!("layer {index} not verified: {events:?}"));
        assert!(verified < first_extract, "{events:?}");
    }

    // Again: everything is cached, nothing is fetched or unpacked.
    let again = store.pull(&source, &RegistryAuth::Anonymous).await.unwrap();
    store.rootfs(&again, &[]).await.unwrap();
    assert_eq!(
        record.take(),
        [
            Event::Resolved {
                digest: written.digest.clone(),
                layers,
            },
            Event::Fetched { index: 0, bytes: 0 },
            Event::Fetched { index: 1, bytes: 0 },
            Event::Built {
                size_bytes: base.size_bytes,
                cached: true
            },
        ]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
