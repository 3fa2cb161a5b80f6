"""Replay round 58 up to case 127 with global-state fingerprints after each case; saves every case's rng state."""
import hashlib, json, pickle, random, sys, time, warnings
import torch
from uniprefill.testing.fuzz import _Pool, run_case, ARCHS, build_model

SEED = 1090001
def fp(probe_model):
    d = dict(threads=torch.get_num_threads(), interop=torch.get_num_interop_threads(), mm=torch.get_float32_matmul_precision(),
             flash=torch.backends.cuda.flash_sdp_enabled(), math=torch.backends.cuda.math_sdp_enabled(),
             mem=torch.backends.cuda.mem_efficient_sdp_enabled(), det=torch.are_deterministic_algorithms_enabled(),
             grad=torch.is_grad_enabled(), dtype=str(torch.get_default_dtype()), mkldnn=torch.backends.mkldnn.enabled,
             fp32p=str(getattr(torch.backends, "fp32_precision", None)),
             mkmm=str(getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)),
             inference=torch.is_inference_mode_enabled(), denorm=(torch.tensor([1e-39]) * 1).item() != 0)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g); q = torch.randn(2, 4, 120, 16, generator=g)
    m = torch.ones(2, 1, 120, 120, dtype=torch.bool).tril(); m[:, :, :, :34] = False; m[:, :, :34, :34] |= torch.eye(34, dtype=torch.bool)
    h = lambda t: hashlib.md5(t.detach().contiguous().numpy().tobytes()).hexdigest()[:8]
    d["mm"] += ":" + h(a @ a)
    d["sdpa"] = h(torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=m))
    ids = torch.randint(3, 128, (2, 120), generator=g); mask = torch.ones_like(ids); mask[:, :34] = 0
    with torch.no_grad():
        d["phi3"] = h(probe_model(input_ids=ids, attention_mask=mask).logits)
    return d

def main(upto):
    rng = random.Random(SEED); pool = _Pool(); probe = build_model("phi3", torch.float32)
    states, log = [], []
    warnings.simplefilter("ignore")
    prev = fp(probe); log.append({"before": 0, **prev}); print(0, prev, flush=True)
    for i in range(upto + 1):
        if i % 25 == 0:
            pool.clear()
        states.append(rng.getstate())
        t = time.time()
        r = run_case(rng, pool, SEED * 1_000_003 + i, ARCHS)
        cur = fp(probe)
        diff = {k: (prev[k], v) for k, v in cur.items() if prev[k] != v}
        print(i, r.arch, r.kind, r.status, f"{time.time()-t:.1f}s", diff, (r.detail[:200] if r.status != "equal" else ""), flush=True)
        log.append({"after": i, "arch": r.arch, "kind": r.kind, "status": r.status, "diff": {k: list(v) for k, v in diff.items()}})
        prev = cur
        pickle.dump(states, open("/tmp/replay59/states.pkl", "wb"))
    json.dump(log, open("/tmp/replay59/trace.json", "w"), indent=1)

main(int(sys.argv[1]) if len(sys.argv) > 1 else 127)
