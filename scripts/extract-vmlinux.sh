#!/usr/bin/env bash
# Extracts the uncompressed ELF vmlinux that Firecracker boots on x86_64 from a bzImage
# (Debian's /boot/vmlinuz-*). The payload's place comes from the bzImage header (setup_sects at
# 0x1f1, payload_offset at 0x248, payload_length at 0x24c); its compression from its magic.
#
# Usage: scripts/extract-vmlinux.sh BZIMAGE OUT
set -euo pipefail
in=${1:?usage: $0 BZIMAGE OUT}
out=${2:?usage: $0 BZIMAGE OUT}

u8() { od -An -tu1 -j "$1" -N 1 "$in" | tr -d ' '; }
u32() { od -An -tu4 -j "$1" -N 4 "$in" | tr -d ' '; }

if [[ "$(od -An -c -j 514 -N 4 "$in" | tr -d ' ')" != "HdrS" ]]; then
    echo "error: $in is not a bzImage (no HdrS header)" >&2
    exit 1
fi
setup_sects=$(u8 $((0x1f1)))
[[ "$setup_sects" == 0 ]] && setup_sects=4
start=$(( (setup_sects + 1) * 512 + $(u32 $((0x248))) ))
length=$(u32 $((0x24c)))
magic=$(od -An -tx1 -j "$start" -N 6 "$in" | tr -d ' \n')
case "$magic" in
    28b52ffd*) dec=(zstd -dcq) ;;
    fd377a585a00) dec=(xz -dcq) ;;
    1f8b08*) dec=(gzip -dcq) ;;
    02214c18*) dec=(lz4 -dcq) ;;
    5d0000*) dec=(xz --format=lzma -dcq) ;;
    425a68*) dec=(bzip2 -dcq) ;;
    *) echo "error: $in: unknown payload compression (magic $magic)" >&2; exit 1 ;;
esac
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# Decompressors may complain about the trailing bytes after the stream; the ELF check decides.
tail -c "+$((start + 1))" "$in" | head -c "$length" | "${dec[@]}" >"$tmp" 2>/dev/null || true
if [[ "$(od -An -tx1 -N 4 "$tmp" | tr -d ' \n')" != "7f454c46" ]]; then
    echo "error: $in: decompressing the payload with ${dec[0]} did not give an ELF" >&2
    exit 1
fi
mv "$tmp" "$out"
echo "$out: ELF vmlinux ($(stat -c %s "$out") bytes, ${dec[0]} payload)"
