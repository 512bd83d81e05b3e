#!/usr/bin/env bash
# Fetches Debian's cloud kernel for the QEMU/TCG guest tests and unpacks it.
#
# Usage: scripts/fetch-guest-kernel.sh [DEST]
#   DEST defaults to target/guest-kernel. Writes DEST/vmlinuz (a bzImage) and DEST/modules/
#   (the lib/modules/<version>/ tree; virtio_mmio, vsock, virtio_blk... are modules there), and
#   DEST/vmlinux, the uncompressed ELF Firecracker boots (scripts/extract-vmlinux.sh).
#   Idempotent: does nothing when DEST/vmlinuz and DEST/modules already exist.
#   Needs `apt-get update` to have run (the caller's job) and apt-get/dpkg on PATH.
set -euo pipefail

cd "$(dirname "$0")/.."
dest="${1:-target/guest-kernel}"

# Firecracker boots an uncompressed ELF on x86_64: unpack it from the bzImage once.
ensure_vmlinux() {
    [[ -s "$dest/vmlinux" ]] || scripts/extract-vmlinux.sh "$dest/vmlinuz" "$dest/vmlinux"
}

if [[ -s "$dest/vmlinuz" && -d "$dest/modules" ]]; then
    echo "$dest/vmlinuz already present ($(cat "$dest/version" 2>/dev/null || echo unknown))"
    ensure_vmlinux
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
chmod 777 "$tmp" # apt-get download writes as _apt when it can (else it warns)

# The meta package depends on the versioned image package, e.g. linux-image-6.1.0-40-cloud-amd64.
meta=linux-image-cloud-amd64
(cd "$tmp" && apt-get download -q "$meta")
meta_deb="$(ls "$tmp"/${meta}_*.deb)"
versioned="$(dpkg-deb -f "$meta_deb" Depends | tr ',' '\n' | sed 's/(.*)//; s/|.*//; s/ //g' |
    grep -E '^linux-image-[0-9].*-cloud-amd64$' | head -n1)"
if [[ -z "$versioned" ]]; then
    echo "error: no linux-image-*-cloud-amd64 in the Depends of $meta:" >&2
    dpkg-deb -f "$meta_deb" Depends >&2
    exit 1
fi
(cd "$tmp" && apt-get download -q "$versioned")
deb="$(ls "$tmp"/${versioned}_*.deb)"
dpkg -x "$deb" "$tmp/root"

vmlinuz="$(ls "$tmp"/root/boot/vmlinuz-* | head -n1)"
moddir="$(ls -d "$tmp"/root/lib/modules/* | head -n1)"

mkdir -p "$dest"
rm -rf "$dest/modules" "$dest/modules.tmp"
cp -a "$moddir" "$dest/modules.tmp"
mv "$dest/modules.tmp" "$dest/modules"
basename "$moddir" >"$dest/version.tmp"
mv "$dest/version.tmp" "$dest/version"
# vmlinuz last: its presence (with modules/) marks a complete fetch.
cp "$vmlinuz" "$dest/vmlinuz.tmp"
mv "$dest/vmlinuz.tmp" "$dest/vmlinuz"
echo "$dest/vmlinuz $(cat "$dest/version") from $versioned"
ensure_vmlinux
