//! `imp image pull|prune`: the local image cache that `imp run` boots from.
//!
//! `imp image pull` does in this process what a VM's shim does before its first boot: pulls
//! the image into the cache and builds its ext4 base, with the same limits as `imp run` with
//! the same `--disk`, so the next `imp run` of it starts from the cache.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use imp_agent::runtime::state::StateDir;
use imp_image::progress::{Event, Observer, Reporter};
use imp_image::{ImageSource, ImageStore, Limits, RegistryAuth};

use super::progress::{Mode, Progress};
use crate::args::Common;

/// `imp image pull`.
#[derive(Args, Debug)]
pub struct PullArgs {
    /// The image: a registry reference (`registry/repo:tag`, `…@sha256:…`), `oci:DIR[:TAG]`,
    /// `oci-archive:FILE[:TAG]` or a local OCI layout directory.
    pub image: String,
    /// Unpack within the bounds of a VM disk of this many GiB (as `imp run --disk`).
    #[arg(long, default_value_t = 1)]
    pub disk: u32,
    /// The most bytes the image may unpack to, whatever the disk size.
    #[arg(long, env = "IMP_IMAGE_MAX_BYTES")]
    pub image_max_bytes: Option<u64>,
    /// A `.dockerconfigjson`-style file with registry credentials.
    #[arg(long)]
    pub auth_file: Option<PathBuf>,
    /// Show no progress (on a terminal it is redrawn in place, elsewhere it is a few log lines
    /// on stderr).
    #[arg(short = 'q', long)]
    pub quiet: bool,
    #[command(flatten)]
    common: Common,
}

/// `imp image prune`.
#[derive(Args, Debug)]
pub struct PruneArgs {
    /// Also remove the pulled blobs (fetched again when next needed), not only temporaries
    /// and the built bases.
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    common: Common,
}

/// Shows the pipeline's events as they happen, in this process.
struct Live {
    started: Instant,
    shown: Mutex<Progress>,
}

impl Observer for Live {
    fn event(&self, event: Event) {
        let at = self.started.elapsed();
        if let Ok(mut shown) = self.shown.lock() {
            shown.event(at, &event);
        }
    }
}

impl Live {
    fn finish(&self) {
        if let Ok(mut shown) = self.shown.lock() {
            shown.finish();
        }
    }
}

/// `imp image pull IMAGE`: pulls the image and builds its base, showing the progress; prints
/// the manifest digest.
pub fn pull(args: PullArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let image = super::run::absolute_image(&args.image)?;
    let source: ImageSource = image
        .parse()
        .with_context(|| format!("reading the image reference {:?}", args.image))?;
    let auth = match (&args.auth_file, &source) {
        (Some(path), ImageSource::Registry(r)) => {
            let json =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            imp_image::auth_from_docker_config(&json, r.resolve_registry())
                .with_context(|| format!("credentials in {}", path.display()))?
        }
        (Some(_), _) => anyhow::bail!("--auth-file is for registry images, not {}", args.image),
        (None, _) => RegistryAuth::Anonymous,
    };
    let live = Arc::new(Live {
        started: Instant::now(),
        shown: Mutex::new(Progress::new(
            Mode::detect(args.quiet),
            matches!(source, ImageSource::Registry(_)),
        )),
    });
    let limits = Limits::for_disk(u64::from(args.disk) << 30, args.image_max_bytes);
    let store = ImageStore::new(state.cache().join("images"), limits)
        .with_reporter(Reporter::new(live.clone()));
    let started = Instant::now();
    let result = super::block_on(async {
        let pulled = store
            .pull(&source, &auth)
            .await
            .with_context(|| format!("pulling {}", args.image))?;
        let base = store
            .rootfs(&pulled, &[])
            .await
            .with_context(|| format!("building the root filesystem of {}", args.image))?;
        anyhow::Ok((pulled, base))
    })?;
    live.finish();
    let (pulled, base) = result?;
    if !args.quiet {
        let n = pulled.layers.len();
        eprintln!(
            "imp: {} is ready ({n} layer{}, root filesystem {}) in {:.1}s",
            args.image,
            if n == 1 { "" } else { "s" },
            super::progress::bytes(base.size_bytes),
            started.elapsed().as_secs_f64()
        );
    }
    println!("{}", pulled.manifest_digest);
    Ok(())
}

/// `imp image prune`: removes what unpacks killed half-way left and the cached bases (rebuilt
/// from the blobs when next needed), and with `--all` the blobs too; prints what it freed.
pub fn prune(args: PruneArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let store = super::run::image_store(&state);
    let pruned = super::block_on(store.prune(args.all))?
        .with_context(|| format!("pruning the image cache {}", store.root().display()))?;
    println!(
        "removed {} entries, {:.1} MiB",
        pruned.entries,
        pruned.bytes as f64 / f64::from(1u32 << 20)
    );
    Ok(())
}
