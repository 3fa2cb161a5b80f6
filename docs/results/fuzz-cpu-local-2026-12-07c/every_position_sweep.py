"""Every request that needs every position, on every fuzz architecture, float32 and bf16, at forced retention.

    PYTHONPATH=/tmp/ppN OMP_NUM_THREADS=1 python -P every_position_sweep.py OUT.json

One `_every_position_case` per (architecture, request, dtype), the request forced (router logits only where the
model has them), the rest drawn from a seed of the triple; writes the counts and every case that was not equal.
"""
import json
import random
import sys
import time
import warnings
from collections import Counter

import torch

from uniprefill.testing.fuzz import ARCHS, _Pool
from uniprefill.testing.fuzz_every_position import REQUESTS, _every_position_case

warnings.filterwarnings("ignore")
archs = list(dict.fromkeys([*ARCHS, "gpt-oss", "qwen3-next-6", "qwen3.5-6"]))
pool, counts, cases, start = _Pool(), Counter(), [], time.time()
for i, arch in enumerate(archs):
    pool.clear()
    for j, request in enumerate(REQUESTS):
        for dtype in (torch.float32, torch.bfloat16):
            model = pool.get(arch, dtype, keep_ratio=0.5)[0]
            if request == "output_router_logits" and not hasattr(model.config, "output_router_logits"):
                continue
            seed = 1000 * i + 10 * j + (dtype == torch.bfloat16)
            try:
                r = _every_position_case(random.Random(seed), pool, 7_000_000 + seed, arch, dtype, request=request)
                status, detail, reasons = r.status, r.detail, r.reasons
            except Exception as exc:  # noqa: BLE001
                status, detail, reasons = "raised", f"{type(exc).__name__}: {exc}"[:300], []
            counts[status] += 1
            cases.append({"arch": arch, "request": request, "dtype": str(dtype), "status": status, "detail": detail,
                          "reasons": reasons})
    print(arch, dict(counts), f"{time.time() - start:.0f} s", flush=True)
json.dump({"counts": dict(counts), "seconds": time.time() - start, "cases": cases}, open(sys.argv[1], "w"), indent=1)
