# Round 61's case 1093004279057 (docs/results/fuzz-cpu-local-2026-12-08/README.md); run: OMP_NUM_THREADS=1 python -P case_1093004279057_rows_alone.py
import warnings, torch, uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_reference import _left_padded
warnings.simplefilter("ignore")
case = 1093001 * 1_000_003 + 54
model = fuzz.build_model("qwen3-next-6", torch.bfloat16)
gen = torch.Generator().manual_seed(case)
rows = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in [199, 87]]
ids, mask = _left_padded(rows)
kw = {"input_ids": ids, "attention_mask": mask}
real = mask.bool()
torch.set_grad_enabled(True)
ref = model(**kw).logits
config = uniprefill.UniPrefillConfig(drop_layers=fuzz._first_full_layers(model), **fuzz.SETTINGS, keep_ratio=0.3)
fast = uniprefill.compile(model, config)
out = fast(**kw).logits
for i, r in enumerate(rows):
    alone = model(input_ids=r[None]).logits[0]
    n = len(r)
    print(f"row {i} ({n}): compiled vs plain-alone {float((out[i, -n:].float() - alone.float()).abs().max()):.4g}; "
          f"plain batched vs plain-alone {float((ref[i, -n:].float() - alone.float()).abs().max()):.4g}; "
          f"compiled vs plain batched {float((out[i, -n:].float() - ref[i, -n:].float()).abs().max()):.4g}")
