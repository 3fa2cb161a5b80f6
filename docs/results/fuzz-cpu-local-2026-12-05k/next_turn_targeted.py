import random, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import _generate_case, ARCHS

class R(random.Random):
    def choice(self, seq):
        if "next turn" in seq:
            return "next turn"
        return super().choice(seq)

pool = fuzz._Pool()
archs = sys.argv[1].split(",") if len(sys.argv) > 1 else ARCHS
counts = {}
for arch in archs:
    for case in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
        t = time.time()
        try:
            r = _generate_case(R(case), pool, 5000 + case, arch, torch.float32)
        except Exception as e:
            print(arch, case, "EXC", type(e).__name__, str(e)[:300]); continue
        counts[r.status] = counts.get(r.status, 0) + 1
        print(arch, case, r.status, r.accelerated, r.detail[:200], r.reasons[:1], f"{time.time()-t:.1f}s", flush=True)
    pool.clear()
print(counts)
