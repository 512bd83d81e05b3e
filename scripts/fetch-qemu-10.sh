#!/usr/bin/env bash
# A second QEMU, newer than Debian 12's 7.2, for the tests that need one: clones that map
# their snapshot's memory image read-only and private (QEMU >= 8.2: memory-backend-file
# readonly=on,rom=off) and snapshots crossing QEMU versions. QEMU 10.0 from
# bookworm-backports, unpacked beside the system's 7.2 (which stays the default) into
# /usr/local/lib/imp-test/qemu-10: under /usr, which a confined QEMU's jail shows (its
# firmware is the system's qboot). Run as root (scripts/setup runs it); prints the binary.
set -euo pipefail
dest=/usr/local/lib/imp-test/qemu-10
qemu="$dest/usr/bin/qemu-system-x86_64"
if [ -x "$qemu" ] && "$qemu" --version 2>/dev/null | grep -q "version 10\."; then
    echo "$qemu"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "deb http://deb.debian.org/debian bookworm-backports main" >"$work/sources.list"
mkdir -p "$work/lists/partial"
apt_opts=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o Dir::State::Lists="$work/lists" -o APT::Sandbox::User=root -qq)
apt-get "${apt_opts[@]}" update
(cd "$work" && apt-get "${apt_opts[@]}" download \
    qemu-system-x86/bookworm-backports qemu-system-data/bookworm-backports)
rm -rf "$dest"
mkdir -p "$dest"
for deb in "$work"/*.deb; do
    dpkg-deb -x "$deb" "$dest"
done
missing=$(ldd "$qemu" | grep "not found" || true)
if [ -n "$missing" ]; then
    echo "QEMU 10 lacks libraries (install qemu-system-x86 first: its 7.2 needs the same):" >&2
    echo "$missing" >&2
    exit 1
fi
"$qemu" --version | head -1 >&2
echo "$qemu"
