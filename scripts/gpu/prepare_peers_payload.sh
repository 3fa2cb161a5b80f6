#!/usr/bin/env bash
# Prepare, on this (networked) machine, what the offline GPU box needs to run the peers
# (issue 22): the minference 0.1.6.0 sdist (pure Python kernels plus the CUDA sources of its
# index builder) and the einops wheel, in the git-ignored folder .gpu_peers (~0.5 MiB), which
# travels with a device call as `carry: [".gpu_peers"]`. On the box, scripts/gpu/peers_issue22.sh
# unpacks it: the sdist's `minference/` goes on PYTHONPATH as is (uniprefill.peers loads its
# modules without running the package's __init__, and finds csrc/ beside it).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .gpu_peers && mkdir .gpu_peers
git check-ignore -q .gpu_peers/ || { echo "error: .gpu_peers is not git-ignored" >&2; exit 1; }
MINFERENCE_FORCE_BUILD=TRUE MINFERENCE_SKIP_CUDA_BUILD=TRUE python3 -m pip download --quiet --no-deps \
    --no-binary :all: --no-build-isolation -d .gpu_peers minference==0.1.6.0
python3 -m pip download --quiet --no-deps -d .gpu_peers einops==0.8.2
(cd .gpu_peers && sha256sum ./* > SHA256SUMS)
ls -la .gpu_peers
