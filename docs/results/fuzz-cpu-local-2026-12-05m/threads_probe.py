import warnings, sys, torch, threading; warnings.filterwarnings("ignore")
import uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS
model = fuzz.build_model("tiny-llama", torch.float32)
drops = fuzz._first_full_layers(model)
fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(keep_ratio=0.3, drop_layers=drops, **SETTINGS))
ids = torch.randint(3, 100, (1, 250), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    plain_ref = model.generate(input_ids=ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    fast_ref = fast.generate(input_ids=ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
print("fast differs from plain (p<1):", not torch.equal(plain_ref, fast_ref))
res = {}
def run_plain(i):
    with torch.no_grad():
        res[f"plain{i}"] = model.generate(input_ids=ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
def run_fast(i):
    with torch.no_grad():
        res[f"fast{i}"] = fast.generate(input_ids=ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
ts = [threading.Thread(target=run_fast, args=(i,)) for i in range(2)] + [threading.Thread(target=run_plain, args=(i,)) for i in range(2)]
for t in ts: t.start()
for t in ts: t.join()
for k, v in sorted(res.items()):
    ref = plain_ref if k.startswith("plain") else fast_ref
    print(k, "as expected" if torch.equal(v, ref) else "WRONG")
