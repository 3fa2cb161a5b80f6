"""Sweep of the fuzzer's left-padded batch case at forced retention (fuzz_reference._batch_after_drop) over the
eager reference's architectures: cases START..END on each, a fresh pool every 10 cases; JSON of every case."""
import collections, json, random, sys, time, warnings
import torch, transformers
warnings.filterwarnings("ignore")
from uniprefill.testing import fuzz, fuzz_reference
start, end, out_path, budget = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
t0 = time.time(); pool = fuzz._Pool(); counts = collections.Counter(); rows = []
for case in range(start, end):
    if time.time() - t0 > budget:
        break
    for arch in fuzz.REFERENCE_ARCHS:
        rng = random.Random(case); ratio = rng.choice([0.3, 0.5, 0.8])
        model, fast = pool.get(arch, torch.float32, keep_ratio=ratio)
        try:
            r = fuzz_reference._batch_after_drop(rng, model, fast, case, arch, ratio)
            status, detail, acc = r.status, r.detail, r.accelerated
        except Exception as exc:  # noqa: BLE001
            status, detail, acc = "error", f"{type(exc).__name__}: {exc}"[:300], 0
        counts[status] += 1; counts["accelerated"] += bool(acc)
        rows.append(dict(case=case, arch=arch, keep_ratio=ratio, status=status, accelerated=acc, detail=detail))
        if status != "equal":
            print("FLAG", rows[-1], flush=True)
    if case % 10 == 9:
        pool.clear()
summary = dict(transformers=transformers.__version__, torch=torch.__version__, cases=len(rows), counts=dict(counts),
               seconds=round(time.time() - t0), first_case=start, rows=rows)
json.dump(summary, open(out_path, "w"), indent=1)
print(transformers.__version__, len(rows), dict(counts), flush=True)
