import random, sys, warnings, torch
warnings.filterwarnings("ignore")
from uniprefill.testing import fuzz
seed, upto = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed); pool = fuzz._Pool()
import uniprefill.testing.fuzz_cases as fc
orig = fc._random_inputs
log = []
def spy(rng_, model, dtype):
    call = orig(rng_, model, dtype); log.append(call); return call
fc._random_inputs = spy
import uniprefill.testing.fuzz_plain_compile as fp
fp._random_inputs = spy
for i in range(upto + 1):
    if i % 25 == 0: pool.clear()
    log.clear()
    r = fuzz.run_case(rng, pool, seed * 1_000_003 + i)
    if i >= upto - 1 or r.status not in ("equal", "invalid"):
        print(i, r.arch, r.kind, r.status, r.detail[:300], flush=True)
        if i == upto:
            torch.save([{"kwargs": c["kwargs"], "spec": c["spec"], "mask": c["mask"]} for c in log], "/tmp/probe/case.pt")
