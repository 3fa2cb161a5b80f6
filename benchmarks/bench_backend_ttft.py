"""TTFT of the uniprefill backend vs the uncompiled model, at forced retention (GPU).

Llama-3.1-8B-shaped model with random weights (bf16, SDPA, batch 1). One drop point
(layer 7, as the paper's first) with `keep_ratio` forced, so speed is judged apart from
attention patterns. Beside each measured speedup:

* `ideal_measured`: the same model's time decomposed as if the kept tokens had been chosen
  in advance: base(N) * f + base(K) * (1 - f), where f = (drop layer + 0.5) / layers is the
  share of the network that runs on all N tokens and base(K) is the uncompiled model on the
  K kept tokens;
* `ideal_flops`: the analytic FLOP ratio (attention counted as computed: causal N^2 / 2).

Usage: python benchmarks/bench_backend_ttft.py --lengths 8192,32768 --ratios 0.5,0.3,0.2 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch._dynamo


def build_llama8b(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.eval(), cfg


def timed(fn, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def flop_ratio(cfg, n: int, k: int, drop: int) -> float:
    d, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)

    def layer(tokens_attn_in, tokens_mlp):
        proj = 2 * tokens_attn_in * d * (2 * d + 2 * kv)
        attn = 2 * 2 * tokens_attn_in * tokens_attn_in / 2 * d
        mlp = 2 * tokens_mlp * 3 * d * f
        return proj + attn + mlp

    base = layers * layer(n, n)
    dropped = drop * layer(n, n) + layer(n, k) + (layers - drop - 1) * layer(k, k)
    return base / dropped


def main() -> None:
    import uniprefill

    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--ratios", default="0.5,0.3,0.2")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--drop", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="ttft.json")
    ap.add_argument("--compiled-baseline", action="store_true",
                    help="also time torch.compile(model) with the default backend (Inductor)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    model, cfg = build_llama8b(args.layers)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=gen)
        with torch.no_grad():
            torch.cuda.reset_peak_memory_stats()
            base = timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), 1, args.repeats)
            base_mem = torch.cuda.max_memory_allocated()
            compiled_base = None
            if args.compiled_baseline:
                torch._dynamo.reset()
                default = torch.compile(model)
                t0 = time.perf_counter()
                default(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                compiled_base = statistics.median(
                    timed(lambda: default(input_ids=ids, use_cache=False, logits_to_keep=1), 1, args.repeats))
                print(f"N={n:6d} torch.compile default: {compiled_base:8.1f} ms (eager {statistics.median(base):8.1f} ms), "
                      f"first call {compile_s:.1f}s", flush=True)
                del default
            for r in ratios:
                k = int(round(r * n))
                kept_ids = ids[:, :k]
                base_k = timed(lambda: model(input_ids=kept_ids, use_cache=False, logits_to_keep=1), 1, args.repeats)
                torch._dynamo.reset()
                compiled = uniprefill.compile(model, uniprefill.UniPrefillConfig(keep_ratio=r, drop_layers=(args.drop,)))
                t0 = time.perf_counter()
                compiled(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                first_call = time.perf_counter() - t0
                torch.cuda.reset_peak_memory_stats()
                ours = timed(lambda: compiled(input_ids=ids, use_cache=False, logits_to_keep=1), 1, args.repeats)
                ours_mem = torch.cuda.max_memory_allocated()
                hist = uniprefill.last_drop_report(compiled)
                if hist is None:
                    raise SystemExit(f"no drop happened: {uniprefill.graph_reports(compiled)}")
                f = (args.drop + 0.5) / args.layers
                ideal_time = statistics.median(base) * f + statistics.median(base_k) * (1 - f)
                row = {
                    "n": n, "keep_ratio": r, "kept": sum(hist.points[0].kept),
                    "base_ms": statistics.median(base), "base_ms_all": base,
                    "ours_ms": statistics.median(ours), "ours_ms_all": ours,
                    "base_on_kept_ms": statistics.median(base_k),
                    "speedup": statistics.median(base) / statistics.median(ours),
                    "ideal_measured": statistics.median(base) / ideal_time,
                    "ideal_flops": flop_ratio(cfg, n, k, args.drop),
                    "peak_gib_base": base_mem / 2**30, "peak_gib_ours": ours_mem / 2**30,
                    "first_call_s": first_call, "graphs": len(uniprefill.graph_reports(compiled)),
                }
                row["share_of_ideal"] = row["speedup"] / row["ideal_measured"]
                if compiled_base is not None:
                    row["compiled_default_ms"] = compiled_base
                    row["speedup_vs_faster_baseline"] = min(row["base_ms"], compiled_base) / row["ours_ms"]
                rows.append(row)
                print(f"N={n:6d} keep={r:.2f} base {row['base_ms']:8.1f} ms  ours {row['ours_ms']:8.1f} ms  "
                      f"speedup {row['speedup']:.2f}x  ideal(meas) {row['ideal_measured']:.2f}x  "
                      f"ideal(flops) {row['ideal_flops']:.2f}x  share {row['share_of_ideal']:.2f}  "
                      f"peak {row['peak_gib_base']:.1f}/{row['peak_gib_ours']:.1f} GiB  first call {first_call:.1f}s",
                      flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": " ".join(__import__("sys").argv), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
