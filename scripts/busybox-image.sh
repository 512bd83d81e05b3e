#!/usr/bin/env bash
# Writes a small OCI image layout built from Debian's static busybox, for trying `imp run`
# without a registry: scripts/busybox-image.sh DIR [TAG]  →  imp run oci:DIR:TAG
# The image's CMD prints a greeting and the guest's kernel; `imp run oci:DIR:TAG -- CMD…`
# replaces it. Needs busybox-static (/bin/busybox must be static), tar, gzip, sha256sum.
set -euo pipefail
dest="${1:?usage: $0 DIR [TAG]}"
tag="${2:-latest}"
busybox="${BUSYBOX:-/bin/busybox}"
if ! [ -x "$busybox" ]; then
    echo "$busybox not found: apt-get install -y busybox-static" >&2
    exit 1
fi
if ldd "$busybox" >/dev/null 2>&1; then
    echo "$busybox is dynamically linked: install busybox-static" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
mkdir -p "$root"/{bin,etc,tmp,root,proc,sys,dev,run}
chmod 1777 "$root/tmp"
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"

mkdir -p "$dest/blobs/sha256"
blob() { # file media-type → prints a descriptor, moves the file into blobs/
    local digest size
    digest="$(sha256sum "$1" | cut -d' ' -f1)"
    size="$(stat -c %s "$1")"
    mv "$1" "$dest/blobs/sha256/$digest"
    printf '{"mediaType":"%s","digest":"sha256:%s","size":%s}' "$2" "$digest" "$size"
}
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$work/layer.tar" .
diff_id="$(sha256sum "$work/layer.tar" | cut -d' ' -f1)"
gzip -n -9 "$work/layer.tar"
layer="$(blob "$work/layer.tar.gz" application/vnd.oci.image.layer.v1.tar+gzip)"
cat > "$work/config.json" <<JSON
{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin","GREETING=hello from an imp microVM"],"Cmd":["sh","-c","echo \$GREETING; uname -sr"],"WorkingDir":"/root"},"rootfs":{"type":"layers","diff_ids":["sha256:$diff_id"]}}
JSON
config="$(blob "$work/config.json" application/vnd.oci.image.config.v1+json)"
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":%s,"layers":[%s]}' \
    "$config" "$layer" > "$work/manifest.json"
manifest="$(blob "$work/manifest.json" application/vnd.oci.image.manifest.v1+json)"
printf '{"imageLayoutVersion":"1.0.0"}' > "$dest/oci-layout"
printf '{"schemaVersion":2,"manifests":[%s]}' \
    "${manifest%\}},\"annotations\":{\"org.opencontainers.image.ref.name\":\"$tag\"}}" > "$dest/index.json"
echo "$dest"
