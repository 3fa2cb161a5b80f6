import warnings, torch; warnings.filterwarnings("ignore")
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import _rows_alone_tie, _compare_logits
case = 1011004033220
pool = fuzz._Pool()
model, fast = pool.get("gpt-oss", torch.bfloat16, p=1.0)
ids = torch.randint(3, model.config.vocab_size, (2, 183), generator=torch.Generator().manual_seed(case))
mask = torch.ones_like(ids); mask[-1, :27] = 0
with torch.no_grad():
    out = fast(input_ids=ids, attention_mask=mask, use_cache=True)
    ref = model(input_ids=ids, attention_mask=mask, use_cache=True)
    print("fast vs plain batch:", _compare_logits(out.logits, ref.logits, mask, None, torch.bfloat16))
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=True)
    print("tie:", _rows_alone_tie(model, fast, out.logits, ref.logits, mask, kwargs, torch.bfloat16))
    r32 = model.float()
