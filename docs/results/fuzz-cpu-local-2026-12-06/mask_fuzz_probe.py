import random, torch, collections, warnings, sys
warnings.simplefilter("ignore")
from uniprefill.testing import fuzz_cases as fc, fuzz_plain_compile as fp
from uniprefill.testing.fuzz import _Pool
pool = _Pool(); stats = collections.Counter()
archs = ["tiny-llama", "tiny-gemma3", "tiny-qwen3-next", "gpt-oss", "tiny-lfm2", "gemma2"]
for case in range(int(sys.argv[1])):
    rng = random.Random(7000 + case); arch = archs[case % len(archs)]
    f = fp._plain_compile_case if case % 3 == 2 else fc._forward_case
    try:
        r = f(rng, pool, case, arch, torch.float32)
    except Exception as e:
        print(case, arch, "EXC", type(e).__name__, str(e)[:200], flush=True); continue
    tag = "4d" if "'4d" in r.detail else ""
    stats[(r.status, tag)] += 1
    print(case, arch, f.__name__, r.status, tag, r.detail[:200] if r.status not in ("equal",) else "", flush=True)
    if case % 24 == 23: pool.clear()
print(dict(stats))
