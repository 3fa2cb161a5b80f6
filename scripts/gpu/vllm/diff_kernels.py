"""Which Triton kernels two engines' Inductor generated differently (`defaults_grid.sh` with DUMP_CODE=1).

    python3 scripts/gpu/vllm/diff_kernels.py code-smollm2-standard.tar.gz code-smollm2-p1.tar.gz [--show 3]

Each archive holds the Python files Inductor wrote into that engine's cache. Every Triton kernel in them
(its `@triton_heuristics...` decorator and `@triton.jit` body) is normalised: the kernel's name, the
symbol names and the source-file hashes are blanked, so two kernels that compute the same thing with the
same launch heuristics compare equal whatever they were called. Prints how many distinct kernels each
side has, how many they share, how many distinct kernel bodies (the `@triton.jit` function alone) each has and
shares, and, with --show N, the first N kernels found on the second side only, each beside its nearest kernel on
the first side (a unified diff), so that a size hint, a block size or a
reduction order that differs can be read off. Where the archives hold Inductor's `*.best_config` files (the
launch config its autotuner picked for a kernel, beside the kernel's file; `defaults_grid.sh` DUMP_CODE=1 keeps
them since 2026-12-05), it also says how many kernels both engines compiled from the same source got another
launch config (block sizes, warps, stages: a reduction's summation order can follow them), and the same for
kernels with the same body (the `@triton.jit` function, normalised as above) whatever their decorators: two
engines that compile one kernel under different size hints or benchmark harnesses have other sources but the
same arithmetic, and only the launch config can then part their numbers (Gemma-3-270M at p = 1, H200,
2026-12-05: the q/k RMSNorm reductions got R0_BLOCK 4 and 8 against standard vLLM's 64).
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import re
import tarfile
from collections import Counter
from pathlib import Path

# a kernel: its decorator (lines up to `@triton.jit`, none starting with "@"), `@triton.jit`, and its body up to
# the end of the string Inductor passes to `async_compile.triton(...)`, or of the file
_KERNEL = re.compile(r"((?:@triton_heuristics\.[^\n]*\n(?:[^@\n][^\n]*\n)*?)?@triton\.jit\ndef (\w+)\(.*?)"
                     r"(?=\n'''|\n\"\"\"|\Z)", re.S)
_BLANKS = [(re.compile(r"\b[su]\d+\b"), "SYM"), (re.compile(r"\bks\d+\b"), "ksN"),  # backed or unbacked alike
           (re.compile(r"[0-9a-f]{40,64}"), "HASH"), (re.compile(r"'kernel_name': '[^']*'"), "'kernel_name': K"),
           (re.compile(r"'backend_hash': '[^']*'"), "'backend_hash': H")]


def _normalised(source: str, name: str) -> str:
    source = source.replace(name, "KERNEL")
    for pattern, blank in _BLANKS:
        source = pattern.sub(blank, source)
    return source.strip()


def _kernels_by_file(archive: Path):
    """(member path, kernel name, its source) for every kernel in the archive's Python files."""
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            text = io.TextIOWrapper(tar.extractfile(member), encoding="utf-8", errors="replace").read()
            for match in _KERNEL.finditer(text):
                source = match.group(1)
                yield member.name, match.group(2), source[:source.index("@triton.jit")] + _body(source)


def kernels(archive: Path) -> Counter:
    """Normalised kernel sources of one archive, counted."""
    return Counter(_normalised(source, name) for _, name, source in _kernels_by_file(archive))


_TIMINGS = ("time_taken_ms", "triton_cache_hash")  # not the config itself


def launch_configs(archive: Path) -> dict[str, dict]:
    """Kernel file stem (its source hash) -> the launch config Inductor's autotuner picked for it."""
    found = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".best_config"):
                config = json.load(tar.extractfile(member))
                found[Path(member.name).stem] = {k: v for k, v in config.items() if k not in _TIMINGS}
    return found


def launch_configs_by_body(archive: Path) -> dict[str, tuple[str, list[dict]]]:
    """Normalised kernel body -> (a name Inductor gave it, the distinct launch configs picked for it). A
    `*.best_config` belongs to the kernel file in its folder (Inductor writes it there); folders holding
    several kernel files, or a file with several kernels, are left out (which kernel it tuned is not known)."""
    configs = launch_configs(archive)
    folders: dict[str, list[str]] = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".best_config"):
                folders.setdefault(str(Path(member.name).parent), []).append(Path(member.name).stem)
    per_file: dict[str, list[tuple[str, str]]] = {}
    for path, name, source in _kernels_by_file(archive):
        body = source[source.index("@triton.jit"):]  # the decorator aside
        per_file.setdefault(path, []).append((name, _normalised(body, name)))
    files_in: Counter = Counter(str(Path(path).parent) for path in per_file)
    found: dict[str, tuple[str, list[dict]]] = {}
    for path, kernels_here in per_file.items():
        folder = str(Path(path).parent)
        if len(kernels_here) != 1 or files_in[folder] != 1 or folder not in folders:
            continue
        name, body = kernels_here[0]
        known, picked = found.get(body, (name, []))
        found[body] = (max(known, name, key=len), picked)  # Inductor names a combined kernel's parts `triton_`
        picked.extend(json.dumps(configs[stem], sort_keys=True) for stem in folders[folder])
    return {body: (name, [json.loads(c) for c in sorted(set(picked))]) for body, (name, picked) in found.items()}


def _body(source: str) -> str:
    """The `@triton.jit` function of a kernel's source: its `def` and the indented lines after it (a kernel
    file of its own goes on with a benchmark harness, which is not the kernel)."""
    lines = source[source.index("@triton.jit"):].splitlines()
    end = next((i for i, line in enumerate(lines[2:], 2) if line and not line[0].isspace()), len(lines))
    return "\n".join(lines[:end])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--show", type=int, default=0, help="kernels of one side only to print, with a diff")
    args = parser.parse_args(argv)
    a, b = kernels(args.a), kernels(args.b)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    print(f"{args.a.name}: {len(a)} distinct kernels; {args.b.name}: {len(b)}; shared {len(set(a) & set(b))}; "
          f"only in the first {len(only_a)}, only in the second {len(only_b)}")
    body_a, body_b = {_body(k) for k in a}, {_body(k) for k in b}
    print(f"kernel bodies (the @triton.jit function alone): {len(body_a)} and {len(body_b)}; shared "
          f"{len(body_a & body_b)}")
    for kernel in only_b[:args.show]:  # beside its nearest kernel of the first side, a same-body twin where one exists
        nearest = max(list(a), key=lambda k: difflib.SequenceMatcher(None, k, kernel).ratio(), default="")
        print("\n".join(difflib.unified_diff(nearest.splitlines(), kernel.splitlines(), args.a.name, args.b.name,
                                             lineterm="", n=1)))
        print("-" * 80)
    configs_a, configs_b = launch_configs(args.a), launch_configs(args.b)
    both = sorted(set(configs_a) & set(configs_b))
    if both:
        differ = [stem for stem in both if configs_a[stem] != configs_b[stem]]
        print(f"launch configs of kernels both compiled from the same source: {len(both)}, {len(differ)} differ")
        for stem in differ[:args.show]:
            print(f"  {stem}: {configs_a[stem]} -> {configs_b[stem]}")
    bodies_a, bodies_b = launch_configs_by_body(args.a), launch_configs_by_body(args.b)
    same_body = sorted(set(bodies_a) & set(bodies_b))
    if same_body:
        differ = [body for body in same_body if bodies_a[body][1] != bodies_b[body][1]]
        print(f"launch configs of kernels with the same body: {len(same_body)}, {len(differ)} differ")
        for body in differ[:args.show]:
            print(f"  {bodies_a[body][0]}: {bodies_a[body][1]} -> {bodies_b[body][1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
