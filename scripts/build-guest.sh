#!/usr/bin/env bash
# Builds the imp guest agent as a static binary (glibc with crt-static, which needs no target
# beyond the host's) and checks that it really is static.
#
# Usage: scripts/build-guest.sh [--release] [OUT]
#   OUT defaults to target/imp-guest/imp-guest. Prints the path and size on success.
#   IMP_GUEST_RUSTFLAGS adds rustc flags (scripts/images remaps paths for a reproducible build).
set -euo pipefail

cd "$(dirname "$0")/.."
profile=dev
dir=debug
if [[ "${1:-}" == "--release" ]]; then
    profile=release
    dir=release
    shift
fi
out="${1:-target/imp-guest/imp-guest}"
target=x86_64-unknown-linux-gnu

# A separate target dir keeps the static build from invalidating the normal one's cache.
RUSTFLAGS="-C target-feature=+crt-static ${IMP_GUEST_RUSTFLAGS:-}" \
    cargo build --locked -p imp-guest --bin imp-guest --profile "$profile" --target "$target" \
    --target-dir target/static

bin="target/static/$target/$dir/imp-guest"
if ldd "$bin" 2>&1 | grep -qv -e 'not a dynamic executable' -e 'statically linked'; then
    echo "error: $bin is dynamically linked:" >&2
    ldd "$bin" >&2
    exit 1
fi
if file "$bin" 2>/dev/null | grep -q 'dynamically linked'; then
    echo "error: file(1) says $bin is dynamically linked" >&2
    exit 1
fi

mkdir -p "$(dirname "$out")"
cp "$bin" "$out.tmp"
mv "$out.tmp" "$out"
echo "$out $(stat -c %s "$out") bytes (static)"
