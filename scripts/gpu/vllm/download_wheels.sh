#!/usr/bin/env bash
# Download the LEAN vllm==0.26.0 wheel set for the offline H200 box and cut it into parts.
#
#   scripts/gpu/vllm/download_wheels.sh [--part-mib 55] [--skip-download]
#
# Runs on the dev machine (network to PyPI). Steps, each idempotent:
#  1. pip download --no-deps --only-binary=:all: for CPython 3.12 / manylinux x86_64 the 74 pins of
#     lean-wheels.txt into .whl_vllm_download/ (pip evaluates no markers: --no-deps, exact pins).
#  2. Copy them into .whl_vllm_lean/, repacking the vllm wheel without the FA2 library
#     (vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so: the H200 selects FA3) and the Rust HTTP
#     frontend (vllm/vllm-rs): 289.6 -> ~151 MiB. pip installs the repacked wheel although its
#     RECORD still lists the two files (see docs/vllm.md).
#  3. tar the lean folder into one w.tar, split it into <part-mib> MiB pieces, and put piece NN in
#     its own folder .whl_vllm_partNN/ (git-ignored by /.whl*/), so that one device call carries
#     one folder. The last folder also gets w.tar.sha256, checked on the box before unpacking.
# At the end it prints the part sizes and writes them to .whl_vllm_lean/PARTS.txt.
set -euo pipefail

PART_MIB=45  # 60 MiB parts plus the ~4.5 MiB working tree exceeded the 64 MiB per call (2026-12-01); 55 MiB plus
             # the ~11 MB tree (counted in disk blocks) did too (2026-12-05): 7 parts
DOWNLOAD=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --part-mib) PART_MIB="$2"; shift 2 ;;
    --skip-download) DOWNLOAD=0; shift ;;
    *) echo "unknown argument: $1 (expected --part-mib N or --skip-download)" >&2; exit 2 ;;
  esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
DL="$ROOT/.whl_vllm_download"
LEAN="$ROOT/.whl_vllm_lean"
STAGE="$ROOT/.whl_vllm_tar"
VLLM_WHEEL="vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
STRIP=("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "vllm/vllm-rs")

mapfile -t PINS < <(grep -v '^\s*#' "$HERE/lean-wheels.txt" | grep -v '^\s*$')
echo "lean set: ${#PINS[@]} pins"

if [[ $DOWNLOAD == 1 ]]; then
  mkdir -p "$DL"
  # Several --platform tags: pip accepts a wheel that matches any of them. Highest glibc tag in the
  # lean set is manylinux_2_31 (llguidance); the box's glibc is newer.
  python3 -m pip download --no-deps --only-binary=:all: -d "$DL" \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    "${PINS[@]}"
fi

count=$(find "$DL" -maxdepth 1 -name '*.whl' | wc -l)
if [[ $count -ne ${#PINS[@]} ]]; then
  echo "expected ${#PINS[@]} wheels in $DL, found $count" >&2
  exit 1
fi

rm -rf "$LEAN" && mkdir -p "$LEAN"
for whl in "$DL"/*.whl; do
  name="$(basename "$whl")"
  [[ $name == "$VLLM_WHEEL" ]] || ln "$whl" "$LEAN/$name" 2>/dev/null || cp "$whl" "$LEAN/$name"
done
if [[ ! -f "$DL/$VLLM_WHEEL" ]]; then
  echo "missing $VLLM_WHEEL in $DL" >&2
  exit 1
fi
cp "$DL/$VLLM_WHEEL" "$LEAN/$VLLM_WHEEL"
zip -q -d "$LEAN/$VLLM_WHEEL" "${STRIP[@]}"
for member in "${STRIP[@]}"; do
  if unzip -l "$LEAN/$VLLM_WHEEL" "$member" >/dev/null 2>&1; then
    echo "repack failed: $member is still in $VLLM_WHEEL" >&2
    exit 1
  fi
done
unzip -tq "$LEAN/$VLLM_WHEEL" >/dev/null

rm -rf "$STAGE" "$ROOT"/.whl_vllm_part[0-9][0-9]
mkdir -p "$STAGE"
tar -cf "$STAGE/w.tar" -C "$LEAN" --exclude PARTS.txt .
(cd "$STAGE" && split -b "${PART_MIB}m" -d w.tar w.tar.part. && sha256sum w.tar > w.tar.sha256)
parts=("$STAGE"/w.tar.part.*)
last=$(( ${#parts[@]} - 1 ))
for i in "${!parts[@]}"; do
  nn=$(printf '%02d' "$i")
  mkdir -p "$ROOT/.whl_vllm_part$nn"
  mv "${parts[$i]}" "$ROOT/.whl_vllm_part$nn/"
  [[ $i == "$last" ]] && cp "$STAGE/w.tar.sha256" "$ROOT/.whl_vllm_part$nn/"
done
rm -f "$STAGE/w.tar"

{
  echo "lean wheels: $(find "$LEAN" -name '*.whl' | wc -l), $(du -cb "$LEAN"/*.whl | tail -1 | awk '{printf "%.1f MiB", $1/1048576}')"
  echo "vllm repacked: $(stat -c %s "$LEAN/$VLLM_WHEEL" | awk '{printf "%.1f MiB", $1/1048576}')"
  echo "tar sha256: $(cut -d' ' -f1 "$STAGE/w.tar.sha256")"
  for d in "$ROOT"/.whl_vllm_part[0-9][0-9]; do
    f=("$d"/w.tar.part.*)
    echo "$(basename "$d"): $(basename "${f[0]}") $(stat -c %s "${f[0]}") bytes ($(stat -c %s "${f[0]}" | awk '{printf "%.1f MiB", $1/1048576}'))"
  done
} | tee "$LEAN/PARTS.txt"
