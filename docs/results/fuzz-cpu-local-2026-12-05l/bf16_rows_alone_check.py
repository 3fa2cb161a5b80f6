import warnings, torch; warnings.filterwarnings("ignore")
import uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import _call
calls = torch.load("/tmp/probe/case.pt", weights_only=False)
model = fuzz.build_model("gpt-oss", torch.bfloat16)
fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=fuzz._first_full_layers(model), **fuzz.SETTINGS))
for c in calls:
    kw, spec, mask = c["kwargs"], c["spec"], c["mask"]
    print(spec, sorted(kw))
    with torch.no_grad():
        ref = model(**kw).logits; out = _call(fast, model, kw, spec["positional"]).logits
    bad = fuzz._compare_logits(out, ref, mask, kw.get("logits_to_keep"), torch.bfloat16)
    print("  bad:", bad, "| tie:", fuzz._rows_alone_tie(model, fast, out, ref, mask, kw, torch.bfloat16) if bad else "-")
