# Round 61's case 1093004279057 (docs/results/fuzz-cpu-local-2026-12-08/README.md); run: OMP_NUM_THREADS=1 python -P case_1093004279057_doors.py
import warnings, torch, uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_reference import _left_padded
from uniprefill.first_call import restart_with_dynamic_length
warnings.simplefilter("ignore")
case = 1093001 * 1_000_003 + 54
model = fuzz.build_model("qwen3-next-6", torch.bfloat16)
gen = torch.Generator().manual_seed(case)
ids, mask = _left_padded([torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in [199, 87]])
kw = {"input_ids": ids, "attention_mask": mask}
real = mask.bool()
d = lambda a, b: float((a.float() - b.float())[real].abs().max())
graphs = []
def restart_backend(gm, ex):
    restart_with_dynamic_length(gm, ex)
    graphs.append(gm)
    return gm.forward
def plain_backend(gm, ex):
    graphs.append(gm)
    return gm.forward
torch.set_grad_enabled(True)
ref = model(**kw).logits
for name, be, dyn in [("eager dyn=None", "eager", None), ("eager dyn=True", "eager", True), ("restart", restart_backend, None), ("plain gm", plain_backend, None)]:
    torch._dynamo.reset(); graphs.clear()
    out = torch.compile(model, backend=be, dynamic=dyn)(**kw).logits
    print(name, d(out, ref), "graphs", len(graphs))
torch._dynamo.reset()
config = uniprefill.UniPrefillConfig(drop_layers=fuzz._first_full_layers(model), **fuzz.SETTINGS, keep_ratio=0.3)
fast = uniprefill.compile(model, config)
print("uniprefill.compile", d(fast(**kw).logits, ref), [str(g)[:150] for g in fast.backend.graphs])
torch._dynamo.reset()
fast2 = torch.compile(model, backend="uniprefill", options={"keep_ratio": 0.3, "drop_layers": list(config.drop_layers), **fuzz.SETTINGS})
print("torch.compile uniprefill", d(fast2(**kw).logits, ref))
