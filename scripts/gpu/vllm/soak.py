"""A bounded soak client for `vllm serve` on loopback, and the comparison of two of its runs.

    python3 -P scripts/gpu/vllm/soak.py run --url http://127.0.0.1:8000 --model MODEL --requests 300 \\
        --concurrency 8 --min-len 1000 --max-len 32000 --cancel 0.1 --opt-out 0.1 --vocab 32000 --out run.jsonl
    python3 -P scripts/gpu/vllm/soak.py compare standard.jsonl uniprefill.jsonl [--out summary.json]

`run`: REQUESTS completions, at most CONCURRENCY in flight (threads, the standard library's HTTP
client: nothing to install), each a prompt of random token ids (seeded per request, so two runs send
the same prompts) of a length drawn log-uniformly from [MIN_LEN, MAX_LEN], greedy, streamed. About
CANCEL of them are cancelled mid-stream (the connection closed after their first chunks, which vLLM
turns into an abort), about OPT_OUT carry `"vllm_xargs": {"uniprefill": "off"}` (keep every row). One
JSON line per request (prompt length, flags, status, text, time to first chunk, end-to-end time),
a progress line every 10 requests, GPU memory (nvidia-smi, where present) sampled every 2 s into the
summary, and, where the server runs with `VLLM_SERVER_DEV_MODE=1`, uniprefill's drop totals read after
the last request through `/collective_rpc`, polled until no drop history is held (up to 15 s: aborts of
cancelled streams arrive late). Exit status 1 if a request failed or histories are still held.

`compare`: requests completed (not cancelled, no error) in both runs; how many have the same text.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse


def plan(args) -> list[dict]:
    """The requests of a run: the same for every run with the same seed and sizes."""
    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        length = int(round(math.exp(rng.uniform(math.log(args.min_len), math.log(args.max_len)))))
        out.append({"id": i, "prompt_len": length, "cancel_after": rng.randint(1, 3) if rng.random() < args.cancel else 0,
                    "opted_out": rng.random() < args.opt_out, "prompt_seed": rng.randrange(1 << 30)})
    return out


def prompt_ids(item: dict, vocab: int) -> list[int]:
    rng = random.Random(item["prompt_seed"])
    return [rng.randrange(10, vocab) for _ in range(item["prompt_len"])]


def one_request(url, model: str, item: dict, vocab: int, max_tokens: int, timeout: float) -> dict:
    """POST /v1/completions, streamed; the record of what came back."""
    body = {"model": model, "prompt": prompt_ids(item, vocab), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    if item["opted_out"]:
        body["vllm_xargs"] = {"uniprefill": "off"}
    record = {k: item[k] for k in ("id", "prompt_len", "opted_out")} | {"cancelled": False, "text": "", "chunks": 0}
    start = time.perf_counter()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        record["status"] = response.status
        if response.status != 200:
            record["error"] = response.read().decode(errors="replace")[:500]
            return record
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if record["chunks"] == 0:
                record["ttft_s"] = round(time.perf_counter() - start, 4)
            record["chunks"] += 1
            record["text"] += "".join(c.get("text", "") for c in chunk.get("choices", []))
            if item["cancel_after"] and record["chunks"] >= item["cancel_after"]:
                record["cancelled"] = True
                break
    except Exception as exc:  # noqa: BLE001 - recorded, the soak goes on
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        conn.close()  # mid-stream: the server sees the client go and aborts the request
        record["e2e_s"] = round(time.perf_counter() - start, 4)
    return record


class GpuMemory:
    """`nvidia-smi` memory.used (MiB) every `period` s in a thread; nothing where it is absent."""

    def __init__(self, period: float = 2.0) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True)

    def _loop(self, period: float) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                self.samples.append((round(time.perf_counter() - start, 1), int(out.split()[0])))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            self._stop.wait(period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def live_histories(totals) -> int | None:
    """Drop histories still held, summed over workers and graphs; None when the totals are not a list."""
    if not isinstance(totals, list):
        return None
    return sum(t.get("live_drop_histories", 0) for worker in totals if isinstance(worker, list) for t in worker)


def settled_totals(url, seconds: float = 15.0) -> object:
    """The drop totals once no drop history is held any more (a cancelled stream's abort reaches the engine
    after its client has gone), polled for up to `seconds`; the last totals read otherwise."""
    deadline = time.perf_counter() + seconds
    while True:
        totals = drop_totals(url)
        if live_histories(totals) in (0, None) or time.perf_counter() > deadline:
            return totals
        time.sleep(1.0)


def drop_totals(url) -> object:
    """uniprefill's drop totals per worker through vLLM's developer endpoint, or why not."""
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", "/collective_rpc", json.dumps({"method": "uniprefill_drop_totals"}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        return json.loads(text)["results"] if response.status == 200 else f"HTTP {response.status}: {text[:300]}"
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {type(exc).__name__}: {exc}"[:300]
    finally:
        conn.close()


def run(args) -> int:
    url = urlparse(args.url)
    items = plan(args)
    records, lock, started = [], threading.Lock(), time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as sink, GpuMemory() as memory, ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(one_request, url, args.model, item, args.vocab, args.max_tokens, args.timeout)
                   for item in items]
        for future in futures:
            record = future.result()
            with lock:
                records.append(record)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                if len(records) % 10 == 0 or len(records) == len(items):
                    errors = sum("error" in r for r in records)
                    print(f"[{time.perf_counter() - started:7.1f} s] {len(records)}/{len(items)} requests, "
                          f"{errors} errors", flush=True)
    summary = summarize(records, memory.samples)
    summary["drop_totals"] = settled_totals(url, args.settle_seconds) if args.totals else "not asked (--totals)"
    summary["live_drop_histories"] = live_histories(summary["drop_totals"])
    summary["seconds"] = round(time.perf_counter() - started, 1)
    args.out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "gpu_memory_mib"}, indent=1))
    leaked = bool(summary["live_drop_histories"])  # histories held after the last request: a leak
    return 0 if summary["errors"] == 0 and not leaked else 1


def summarize(records: list[dict], memory: list) -> dict:
    ttft = sorted(r["ttft_s"] for r in records if "ttft_s" in r and not r["cancelled"])
    at = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else None  # noqa: E731
    used = [m for _, m in memory]
    half = len(used) // 2
    return {"requests": len(records), "errors": sum("error" in r for r in records),
            "cancelled": sum(r["cancelled"] for r in records), "opted_out": sum(r["opted_out"] for r in records),
            "completed": sum(not r["cancelled"] and "error" not in r for r in records),
            "ttft_p50_s": at(0.5), "ttft_p99_s": at(0.99),
            "gpu_memory_mib": {"first": used[0] if used else None, "max_first_half": max(used[:half], default=None),
                               "max_second_half": max(used[half:], default=None), "last": used[-1] if used else None,
                               "samples": memory}}


def load(path: Path) -> dict[int, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def compare(args) -> int:
    a, b = load(args.a), load(args.b)
    done = lambda r: not r["cancelled"] and "error" not in r  # noqa: E731
    both = sorted(i for i in a.keys() & b.keys() if done(a[i]) and done(b[i]))
    differ = [{"id": i, "prompt_len": a[i]["prompt_len"], "opted_out": a[i]["opted_out"]}
              for i in both if a[i]["text"] != b[i]["text"]]
    summary = {"a": str(args.a), "b": str(args.b), "completed_in_both": len(both), "same_text": len(both) - len(differ),
               "differ": differ}
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--model", required=True)
    r.add_argument("--requests", type=int, default=300)
    r.add_argument("--concurrency", type=int, default=8)
    r.add_argument("--min-len", type=int, default=1000)
    r.add_argument("--max-len", type=int, default=32000)
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--cancel", type=float, default=0.1)
    r.add_argument("--opt-out", type=float, default=0.1)
    r.add_argument("--vocab", type=int, default=32000)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=600.0)
    r.add_argument("--totals", action="store_true", help="read uniprefill's drop totals (server in dev mode)")
    r.add_argument("--settle-seconds", type=float, default=15.0,
                   help="how long to wait for the drop histories to empty after the last request")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
