import warnings, sys, time, torch; warnings.filterwarnings("ignore")
import uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS
L, C = int(sys.argv[1]), int(sys.argv[2])
model = fuzz.build_model("tiny-llama", torch.float32)
fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=0.5, **SETTINGS))
ids = torch.randint(3, 100, (1, L), generator=torch.Generator().manual_seed(0))
def t(f, **kw):
    f(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **kw)  # warm
    best = 1e9
    for _ in range(3):
        s = time.perf_counter(); f(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **kw); best = min(best, time.perf_counter() - s)
    return best
with torch.no_grad():
    r = {"plain": t(model.generate), "plain chunked": t(model.generate, prefill_chunk_size=C),
         "uniprefill": t(fast.generate), "uniprefill chunked": t(fast.generate, prefill_chunk_size=C)}
print(f"tiny-llama L={L} chunk={C} p=0.5, best of 3 (s):", {k: round(v, 4) for k, v in r.items()}, "| last reason:", str(fast.backend.last_unaccelerated)[:60])
