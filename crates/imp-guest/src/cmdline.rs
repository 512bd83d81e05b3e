//! The `imp.*` parameters of the kernel command line, for what must be known before the
//! config file can be read (modules an initramfs carries, another config path).

use std::path::PathBuf;

/// The imp parameters found on the kernel command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelParams {
    /// `imp.config=PATH`: read the config from here instead of `/.imp/config.json`.
    pub config: Option<PathBuf>,
    /// `imp.modules=A,B,...`: module paths to load, in order, before reading the config.
    pub modules: Vec<String>,
}

/// Parses `/proc/cmdline` text; unknown parameters are ignored.
pub fn parse(cmdline: &str) -> KernelParams {
    let mut params = KernelParams::default();
    for word in cmdline.split_whitespace() {
        if let Some(path) = word.strip_prefix("imp.config=") {
            params.config = Some(PathBuf::from(path));
        } else if let Some(list) = word.strip_prefix("imp.modules=") {
            params
                .modules
                .extend(list.split(',').filter(|m| !m.is_empty()).map(String::from));
        }
    }
    params
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imp_parameters_are_picked_out_of_the_command_line() {
        let p = parse(
            "console=ttyS0 reboot=k imp.modules=/m/virtio_ring.ko,/m/virtio.ko imp.config=/c.json \
             imp.modules=/m/vsock.ko quiet\n",
        );
        assert_eq!(p.config, Some(PathBuf::from("/c.json")));
        assert_eq!(
            p.modules,
            vec!["/m/virtio_ring.ko", "/m/virtio.ko", "/m/vsock.ko"]
        );
        assert_eq!(parse("console=ttyS0"), KernelParams::default());
    }
}
