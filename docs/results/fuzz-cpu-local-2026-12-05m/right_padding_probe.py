import warnings, sys, torch; warnings.filterwarnings("ignore")
import uniprefill
from transformers import DynamicCache
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS
arch = sys.argv[1]; real = int(sys.argv[2]); L = int(sys.argv[3])
model = fuzz.build_model(arch, torch.float32)
print("window", getattr(model.config, "sliding_window", None))
drops = fuzz._first_full_layers(model)
fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=drops, **SETTINGS))
ids = torch.randint(3, 100, (1, L), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids); mask[0, real:] = 0
with torch.no_grad():
    a = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    b = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
print(a.sequences[0, L:].tolist(), b.sequences[0, L:].tolist())
for i, (x, y) in enumerate(zip(a.logits, b.logits)):
    print(i, f"{(x-y).abs().max().item():.3e}")
print(fast.history)
