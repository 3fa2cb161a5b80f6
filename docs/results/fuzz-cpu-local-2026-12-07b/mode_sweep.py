"""generate's decoding modes at p = 1 over the fuzzer's architectures (fuzz_cases._generate_case with the mode
forced): cases START..END, each on architecture ARCHS[case % 17], bf16 every seventh case, a fresh pool every 10.
    python -P mode_sweep.py START END OUT.json "beam sample,no cache"
"""
import torch, transformers, warnings, random, sys, json, collections
warnings.filterwarnings("ignore")
from uniprefill.testing import fuzz, fuzz_cases
pool = fuzz._Pool()
counts = collections.Counter(); rows = []
for case in range(int(sys.argv[1]), int(sys.argv[2])):
    for mode in sys.argv[4].split(","):
        rng = random.Random(case)
        arch = fuzz.ARCHS[case % len(fuzz.ARCHS)]
        dtype = torch.bfloat16 if case % 7 == 0 else torch.float32
        r = fuzz_cases._generate_case(rng, pool, case, arch, dtype, mode=mode)
        counts[(mode, r.status)] += 1; counts[(mode, "accelerated")] += bool(r.accelerated)
        rows.append(dict(case=case, arch=arch, mode=mode, dtype=str(dtype), status=r.status, accelerated=r.accelerated, reasons=r.reasons[:1], detail=r.detail[:300]))
        if r.status not in ("equal", "tie"):
            print("FLAG", rows[-1], flush=True)
    if case % 10 == 0: pool.clear()
print(transformers.__version__, dict(counts))
json.dump(dict(version=transformers.__version__, counts={" ".join(k): v for k, v in counts.items()}, cases=rows), open(sys.argv[3], "w"), indent=1)
