"""The fuzzer's p < 1 reference cases alone (prefill last logits and decode steps after the drop, against the eager
reference), on the three reference architectures: `python reference_run.py SEED SECONDS OUT.json`."""
import json, random, sys, time, warnings
from collections import Counter

import torch

from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_reference import _reference_case

warnings.filterwarnings("ignore")
seed, seconds, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
rng, pool, start = random.Random(seed), fuzz._Pool(), time.time()
status, kinds, failures, i = Counter(), Counter(), [], 0
while time.time() - start < seconds:
    if i % 25 == 0:
        pool.clear()
    arch = rng.choice(fuzz.REFERENCE_ARCHS)
    try:
        r = _reference_case(rng, pool, seed * 1_000_003 + i, arch, torch.float32)
        status[r.status] += 1
        kinds[f"{r.kind}: {r.detail.split(', ')[-1] if 'decode' in r.kind else ''}".rstrip(": ")] += 1
        if r.status not in ("equal", "invalid"):
            failures.append(vars(r))
    except Exception as exc:  # noqa: BLE001
        status["error"] += 1
        failures.append({"case": seed * 1_000_003 + i, "arch": arch, "error": f"{type(exc).__name__}: {exc}"[:500]})
    i += 1
    json.dump({"seed": seed, "cases": i, "seconds": time.time() - start, "by_status": status, "by_kind": kinds,
               "failures": failures}, open(out, "w"), indent=1)
