import warnings, sys, torch; warnings.filterwarnings("ignore")
import uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS
from uniprefill.models.layer_kinds import LayerKind, layer_kinds
arch = sys.argv[1]
model = fuzz.build_model(arch, torch.float32)
drops = tuple(i for i, k in enumerate(layer_kinds(model.config)) if k == LayerKind.FULL)[:2] or "all"
fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=drops, **SETTINGS))
draft = fuzz.build_model(arch, torch.float32)
g = torch.Generator().manual_seed(0)
for rows in (1, 2):
    ids = torch.randint(3, 100, (rows, 90), generator=g); mask = torch.ones_like(ids)
    if rows == 2: mask[1, :20] = 0
    padded = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1].item()
    cases = {
        "mask inferred from pads": dict(input_ids=padded),
        "early eos row 0": dict(input_ids=ids, attention_mask=mask, eos_token_id=first),
        "beam+return 2": dict(input_ids=ids, attention_mask=mask, num_beams=3, num_return_sequences=2),
        "beam sample": dict(input_ids=ids, attention_mask=mask, num_beams=2, do_sample=True, seed=5),
        "prefill_chunk_size 32": dict(input_ids=ids, attention_mask=mask, prefill_chunk_size=32),
        "prefill_chunk_size 64": dict(input_ids=ids, attention_mask=mask, prefill_chunk_size=64),
        "no_repeat_ngram 2": dict(input_ids=ids, attention_mask=mask, no_repeat_ngram_size=2, max_new_tokens=8),
        "assistant_model": dict(input_ids=ids, attention_mask=mask, assistant_model=draft),
        "offloaded cache": dict(input_ids=ids, attention_mask=mask, cache_implementation="offloaded"),
        "dynamic_full cache": dict(input_ids=ids, attention_mask=mask, cache_implementation="dynamic_full"),
        "sliding_window cache": dict(input_ids=ids, attention_mask=mask, cache_implementation="sliding_window"),
        "hybrid cache": dict(input_ids=ids, attention_mask=mask, cache_implementation="hybrid"),
        "min_p sample": dict(input_ids=ids, attention_mask=mask, do_sample=True, min_p=0.05, temperature=0.7, seed=3),
        "diversity(group beam)": dict(input_ids=ids, attention_mask=mask, num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
    }
    for name, kw in cases.items():
        seed = kw.pop("seed", None)
        kw = {"max_new_tokens": 5, "pad_token_id": 0, "do_sample": False, **kw}
        with torch.no_grad():
            try:
                if seed is not None: torch.manual_seed(seed)
                ref = model.generate(**kw)
            except Exception as e:
                print(arch, rows, name, "plain raised", type(e).__name__, str(e)[:120]); continue
            try:
                if seed is not None: torch.manual_seed(seed)
                out = fast.generate(**kw)
            except Exception as e:
                print(arch, rows, name, "FAST RAISED", type(e).__name__, str(e)[:300]); continue
        ok = out.shape == ref.shape and torch.equal(out, ref)
        h = fast.history
        acc = (h is not None and h.points) or any(x is not None and x.points for x in (fast.row_histories or []))
        print(arch, rows, name, "equal" if ok else "MISMATCH", "accelerated" if acc else f"unaccelerated: {str(fast.backend.last_unaccelerated)[:100]}", flush=True)
