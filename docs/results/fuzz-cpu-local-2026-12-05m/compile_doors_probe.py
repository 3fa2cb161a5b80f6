import warnings, sys, torch, traceback; warnings.filterwarnings("ignore")
import uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS
arch = sys.argv[1]
which = sys.argv[2]
model = fuzz.build_model(arch, torch.float32)
ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0))
ids2 = torch.randint(3, 100, (2, 260), generator=torch.Generator().manual_seed(1))
opts = {"p": 1.0, **SETTINGS}
def report(tag, got, ref, target):
    b = uniprefill.backend._backend_of(target)
    h = b.last_history
    print(arch, which, tag, "diff", f"{(got-ref).abs().max().item():.2e}", "dropped" if h is not None and h.points else f"unacc: {str(b.last_unaccelerated)[:150]}", flush=True)
try:
    if which == "inference_mode":
        fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(**opts))
        plain = torch.compile(fuzz.build_model(arch, torch.float32), backend="uniprefill", options=opts)
        for t, m in (("wrapper", fast), ("plain compile", plain)):
            with torch.inference_mode():
                for x in (ids, ids2):
                    got = m(input_ids=x, use_cache=False).logits; ref = (model if t == "wrapper" else m._orig_mod)(input_ids=x, use_cache=False).logits
                    report(t + f" rows{x.shape[0]}", got, ref, m)
    elif which.startswith("flags"):
        for flags in (dict(dynamic=False), dict(dynamic=True), dict(fullgraph=True), dict(dynamic=False, fullgraph=True)):
            torch._dynamo.reset()
            m2 = fuzz.build_model(arch, torch.float32)
            try:
                plain = torch.compile(m2, backend="uniprefill", options=opts, **flags)
                with torch.no_grad():
                    for x in (ids, ids2, ids[:, :280]):
                        got = plain(input_ids=x, use_cache=False).logits; ref = m2(input_ids=x, use_cache=False).logits
                        report(f"{flags} rows{x.shape[0]} len{x.shape[1]}", got, ref, plain)
            except Exception as e:
                print(arch, which, flags, "RAISED", type(e).__name__, str(e)[:300])
    elif which == "autocast":
        fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(**opts))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got = fast(input_ids=ids, use_cache=False).logits; ref = model(input_ids=ids, use_cache=False).logits
            report("wrapper autocast bf16", got.float(), ref.float(), fast)
            out = fast.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            r2 = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            print(arch, which, "generate equal", torch.equal(out, r2))
    elif which in ("flex_attention", "eager", "sdpa"):
        m = fuzz.build_model(arch, torch.float32)
        m.set_attn_implementation(which)
        fast = uniprefill.compile(m, uniprefill.UniPrefillConfig(**opts))
        with torch.no_grad():
            for x in (ids, ids2):
                got = fast(input_ids=x, use_cache=False).logits; ref = m(input_ids=x, use_cache=False).logits
                report(f"wrapper {which} rows{x.shape[0]}", got, ref, fast)
            out = fast.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            r2 = m.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            print(arch, which, "generate equal", torch.equal(out, r2), fast.backend.last_unaccelerated)
except Exception as e:
    traceback.print_exc()
    print(arch, which, "RAISED", type(e).__name__, str(e)[:400])
