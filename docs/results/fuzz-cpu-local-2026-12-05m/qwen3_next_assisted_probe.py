import warnings, torch, traceback; warnings.filterwarnings("ignore")
from uniprefill.testing import fuzz
import sys
model = fuzz.build_model("tiny-qwen3-next", torch.float32)
draft = fuzz.build_model("tiny-qwen3-next", torch.float32)
if sys.argv[1] == "compile":
    import uniprefill
    fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=fuzz._first_full_layers(model), sink=16, last_q=16, block_size=16))
ids = torch.randint(3, 100, (1, 90), generator=torch.Generator().manual_seed(0))
try:
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0, assistant_model=draft)
    print("ok", out[0, 90:].tolist())
except Exception as e:
    traceback.print_exc()
