#!/usr/bin/env bash
# Build uniprefill's own wheel into .whl_uniprefill/ (git-ignored), for the GPU box.
#
# The box cannot import uniprefill from the working tree alone (the `kernels/` folder becomes
# `uniprefill.kernels` only through the package-dir mapping of pyproject.toml), and vLLM finds
# the `vllm.general_plugins` entry point only through installed metadata. Built from a copy
# of the tree (tracked + untracked, not ignored files) so no build/ or *.egg-info lands in it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
OUT="$ROOT/.whl_uniprefill"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$TMP"
rm -rf "$OUT" && mkdir -p "$OUT"
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$TMP"
ls -l "$OUT"
