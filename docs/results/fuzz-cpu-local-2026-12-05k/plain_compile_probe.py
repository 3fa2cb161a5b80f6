import warnings, random, copy, sys; warnings.filterwarnings("ignore")
import torch, uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS, _random_inputs, _call, _compare_logits
from uniprefill.backend import _backend_of
arch = sys.argv[1]
model = fuzz.build_model(arch, torch.float32)
from uniprefill.models.layer_kinds import LayerKind, layer_kinds
drops = tuple(i for i, k in enumerate(layer_kinds(model.config)) if k == LayerKind.FULL)[:2] or "all"
twin = copy.deepcopy(model)
plain = torch.compile(twin, backend="uniprefill", options={"p": 1.0, "drop_layers": drops, **SETTINGS})
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
stats = {}
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 20):
    call = _random_inputs(rng, model, torch.float32)
    kw, spec = call["kwargs"], call["spec"]
    with torch.no_grad():
        try:
            ref = _call(model, model, kw, spec["positional"]).logits
        except Exception as e:
            stats["invalid"] = stats.get("invalid", 0) + 1; continue
        try:
            out = _call(plain, model, kw, spec["positional"]).logits
        except Exception as e:
            print(i, "ERROR", type(e).__name__, str(e)[:300], spec); stats["error"] = stats.get("error", 0) + 1; continue
    bad = _compare_logits(out, ref, call["mask"], kw.get("logits_to_keep"), torch.float32)
    b = _backend_of(plain)
    h = b.last_history
    status = "mismatch" if bad else ("accelerated" if h is not None and h.points else ("reason" if b.last_unaccelerated else ("short" if spec["length"] < 32 else "UNEXPLAINED")))
    stats[status] = stats.get(status, 0) + 1
    if status in ("mismatch", "UNEXPLAINED"):
        print(i, status, bad, spec, kw.keys())
    b.last_unaccelerated = None
print(arch, stats)
