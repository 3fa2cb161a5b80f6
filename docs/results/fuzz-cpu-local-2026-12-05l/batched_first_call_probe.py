import warnings, copy, sys; warnings.filterwarnings("ignore")
import torch
from uniprefill.testing import fuzz
from uniprefill.backend import _backend_of
for arch in sys.argv[1].split(","):
    model = fuzz.build_model(arch, torch.float32)
    opts = {"p": 1.0, "drop_layers": fuzz._first_full_layers(model), **fuzz.SETTINGS}
    for rows in (2, 3):
        torch._dynamo.reset()
        c = torch.compile(copy.deepcopy(model), backend="uniprefill", options=opts)
        ids = torch.randint(3, 100, (rows, 150))
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits; out = c(ids, use_cache=False).logits
        b = _backend_of(c)
        h = b.recorder.last
        print(arch, rows, f"{(out-ref).abs().max().item():.2g}", "acc" if h is not None and h.points else "", str(b.last_unaccelerated)[:150])
