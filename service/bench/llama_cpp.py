"""`moespec bench llamacpp`: llama.cpp beside moespec's engine on the shipped checkpoints.

llama.cpp comes from `scripts/setup_llama_cpp.sh` (built from the package registry's llama-cpp-python
source, the shipped target and dense draft converted to bf16 GGUF); without it the command exits 2
and names the script. Both sides run at the same thread count (`--threads`: llama.cpp's `-t`,
moespec's kernel threads) and each mode's two sides run back to back, the order swapped each round,
so load from elsewhere on the machine moves both sides of a pair. Modes:

- decode: one stream generating --tokens tokens after --depth tokens of context. llama.cpp:
  `llama-bench -p 0 -n N -d D`; moespec: plain greedy decoding after a D-token held-out prompt.
  Tokens/s of the decode steps alone (prefill excluded on both sides).
- prefill: a D-token prompt. llama.cpp: `llama-bench -p D -n 0`; moespec: the same prompts' prefill
  (time to the first token).
- speculative: greedy, the dense draft on both sides (`llama-speculative --spec-draft-n-max K`
  against moespec's model drafter at k=K with the dense draft), and moespec with its shipped draft
  head; tokens/s of the decode after the prompt.
- batched: --batch sequences of D + N tokens. llama.cpp: `llama-batched-bench` (a static batch:
  S_TG, generation only, and the whole run's tokens/s with its prefill); moespec: that many
  concurrent requests through the engine's continuous batching, generated tokens over the wall time
  (prefill included) and over the decode passes alone.
- server: each side's own server at its defaults (same threads) under --server-clients concurrent
  clients: `llama-server` with that many parallel slots against `moespec serve` over gRPC, generated
  tokens over the wall time (llama_cpp_server.py). Where the batched mode ran the same count
  in-process, moespec's server figure over its in-process one is the gRPC layer's share.
Writes llamacpp.json and llamacpp.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

from service.bench.engine import load_prompts
from service.bench.limit import fused_step_cost, measure_rates
from service.bench.llama_cpp_server import GREEDY, LlamaServer, ServerFailed, concurrent_load, moespec_send
from service.types import Drafter, DraftPolicy, GenerationRequest

DEFAULT_DIR = Path.home() / ".cache" / "moespec" / "llama.cpp"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-speculative", "llama-server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-cpp-dir", type=Path, default=DEFAULT_DIR,
                        help="where scripts/setup_llama_cpp.sh built llama.cpp (default ~/.cache/moespec/llama.cpp)")
    parser.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    parser.add_argument("--depth", type=int, default=96, help="context tokens before decoding (default 96)")
    parser.add_argument("--tokens", type=int, default=48, help="generated tokens per stream (default 48)")
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[1, 2, 4], help="speculative k (default 1 2 4)")
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16], help="batched sequences (default 4 16)")
    parser.add_argument("--server-clients", type=int, nargs="*", default=[1, 16],
                        help="server mode: concurrent clients, each side its own server (default 1 16; none: skip)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-llamacpp"))


def tools(root: Path) -> dict[str, Path]:
    """The built binaries and converted models -> paths; UsageError naming the setup script if absent."""
    from service.errors import UsageError

    found = {name: root / "src" / "build" / "bin" / name for name in TOOLS}
    found |= {"target": root / "models" / "target-bf16.gguf", "draft": root / "models" / "draft-bf16.gguf"}
    missing = [str(p) for p in found.values() if not p.exists()]
    if missing:
        raise UsageError(f"llama.cpp is not set up in {root} (missing {missing[0]}): run "
                         "`bash scripts/setup_llama_cpp.sh` first (it builds llama.cpp from the package registry)")
    return found


ATTEMPTS = 5


class ToolFailed(Exception):
    """A llama.cpp tool exited with an error, or printed no result in ATTEMPTS runs."""


def _run(cmd: list[str], result: str, timeout: float = 600) -> tuple[str, re.Match]:
    """Run a llama.cpp tool until its output matches the `result` pattern -> (output, match).

    Why more than once: the tools sometimes exit 0 having printed nothing after setting up the
    context (llama-batched-bench about 1 run in 20 here, llama-speculative too); a rerun measures."""
    name = Path(cmd[0]).name
    for _ in range(ATTEMPTS):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
            raise ToolFailed(f"{name} exited {done.returncode}: {last[0]}")
        out = done.stdout + done.stderr
        found = re.search(result, out)
        if found is not None:
            return out, found
    last = out.strip().splitlines()[-1:] if out.strip() else ["(nothing)"]
    raise ToolFailed(f"{name} printed no result in {ATTEMPTS} runs (its last line: {last[0]!r}): {' '.join(cmd)}")


# -- llama.cpp side ------------------------------------------------------------------------------

def llama_bench(t: dict[str, Path], threads: int, prompt: int, gen: int, depth: int) -> float:
    """Tokens/s of one llama-bench test (its average over its own 3 repetitions)."""
    _, found = _run([str(t["llama-bench"]), "-m", str(t["target"]), "-t", str(threads), "-p", str(prompt),
                     "-n", str(gen), "-d", str(depth), "-r", "3", "-o", "json"], r"(?s)\[\s*\{.*\}\s*\]")
    return float(json.loads(found[0])[0]["avg_ts"])


def llama_batched(t: dict[str, Path], threads: int, depth: int, gen: int, batch: int) -> dict[str, float]:
    # One JSON object per batch size; the tool's log lines (with their own prefixes) come around it.
    _, found = _run([str(t["llama-batched-bench"]), "-m", str(t["target"]), "-t", str(threads),
                     "-c", str(batch * (depth + gen)), "-b", "2048", "-ub", "512", "-npp", str(depth),
                     "-ntg", str(gen), "-npl", str(batch), "--output-format", "jsonl"], r'\{[^{}]*"speed_tg"[^{}]*\}')
    row = json.loads(found[0])
    return {"generation_tokens_per_second": float(row["speed_tg"]),
            "output_tokens_per_second": batch * gen / float(row["t"])}


def llama_speculative(t: dict[str, Path], threads: int, prompt: str, gen: int, k: int) -> dict[str, float]:
    out, decoded = _run([str(t["llama-speculative"]), "-m", str(t["target"]), "-md", str(t["draft"]),
                         "-t", str(threads), "-td", str(threads), "-p", prompt, "-n", str(gen),
                         "--spec-draft-n-max", str(k), "--temp", "0", "-c", "1024"],
                        r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")
    accept = re.search(r"accept\s*=\s*([\d.]+)%", out)
    return {"tokens_per_second": int(decoded[1]) / float(decoded[2]),
            "acceptance": float(accept[1]) / 100 if accept else float("nan")}


# -- moespec side --------------------------------------------------------------------------------

def prompt_windows(engine, depth: int, count: int) -> list[tuple[int, ...]]:
    """`count` prompts of exactly `depth` tokens, cut from the held-out prompts laid end to end."""
    ids: list[int] = []
    for prompt in load_prompts(64):
        ids += engine.tokenizer.encode(prompt).ids
    return [tuple(ids[i * depth:(i + 1) * depth]) for i in range(count)]


def moespec_stream(engine, prompts, gen: int, policy: DraftPolicy) -> dict[str, float]:
    steps, prefill, prompt_tokens = [], 0.0, 0
    for ids in prompts:
        r = engine.generate(GenerationRequest(prompt_token_ids=ids, max_new_tokens=gen, sampling=GREEDY), policy)
        steps += r.steps
        prefill += r.time_to_first_token
        prompt_tokens += r.prompt_tokens
    decode = sum(s.draft_seconds + s.verify_seconds for s in steps)
    drafted = sum(s.drafted for s in steps)
    return {"tokens_per_second": sum(s.committed for s in steps) / decode,
            "prefill_tokens_per_second": prompt_tokens / prefill,
            "acceptance": sum(s.accepted for s in steps) / drafted if drafted else float("nan")}


def moespec_batched(engine, prompts, gen: int) -> dict[str, float]:
    results, start = [], time.perf_counter()

    def one(ids):
        results.append(engine.generate(GenerationRequest(prompt_token_ids=ids, max_new_tokens=gen, sampling=GREEDY),
                                       DraftPolicy()))

    threads = [threading.Thread(target=one, args=(ids,)) for ids in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    tokens = sum(r.completion_tokens for r in results)
    # A step's seconds are its pass's: each pass counted once.
    passes = {s.batch.pass_id: s.batch.draft_seconds + s.batch.verify_seconds
              for r in results for s in r.steps if s.batch is not None}
    return {"output_tokens_per_second": tokens / wall,
            "generation_tokens_per_second": sum(s.committed for r in results for s in r.steps) / sum(passes.values())}


# -- the run -------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    try:
        return _measure(args)
    except (ToolFailed, ServerFailed) as e:
        print(f"moespec bench llamacpp: error: {e}", file=sys.stderr)
        return 1


def _measure(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as servers:
        return _measure_with(args, servers)


def _measure_with(args: argparse.Namespace, servers: contextlib.ExitStack) -> int:
    from service.bench.server import ServeProcess
    from service.engine import Engine, EngineConfig
    from service.engine.model.weights import DEFAULT_DRAFT_DIR
    from service.server.client import MoespecClient

    t = tools(args.llama_cpp_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    head = Engine(EngineConfig(threads=1, kernel_threads=args.threads, max_batch=max(args.batch)))
    dense = Engine(EngineConfig(threads=1, kernel_threads=args.threads, draft_dir=DEFAULT_DRAFT_DIR))
    stream_prompts = prompt_windows(head, args.depth, 4)
    text_prompt = head.tokenizer.decode(list(stream_prompts[0]))
    for engine in (head, dense):  # warm-up: one-off allocations and the kernels' first build
        moespec_stream(engine, stream_prompts[:1], 8, DraftPolicy(Drafter.MODEL, 2, 0.0))
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    def decode(side: str) -> None:
        if side == "llama.cpp":
            add("decode llama.cpp", llama_bench(t, args.threads, 0, args.tokens, args.depth))
        else:
            add("decode moespec", moespec_stream(head, stream_prompts, args.tokens, DraftPolicy())["tokens_per_second"])

    def prefill(side: str) -> None:
        if side == "llama.cpp":
            add("prefill llama.cpp", llama_bench(t, args.threads, args.depth, 0, 0))
        else:
            add("prefill moespec", moespec_stream(head, stream_prompts, 1, DraftPolicy())["prefill_tokens_per_second"])

    def speculative(k: int, side: str) -> None:
        if side == "llama.cpp":
            spec = llama_speculative(t, args.threads, text_prompt, args.tokens, k)
            add(f"speculative k={k} llama.cpp", spec["tokens_per_second"])
            add(f"speculative k={k} llama.cpp acceptance", spec["acceptance"])
            return
        for label, engine in (("dense draft", dense), ("draft head", head)):
            spec = moespec_stream(engine, stream_prompts, args.tokens, DraftPolicy(Drafter.MODEL, k, 0.0))
            add(f"speculative k={k} moespec {label}", spec["tokens_per_second"])
            add(f"speculative k={k} moespec {label} acceptance", spec["acceptance"])

    def batched(b: int, side: str) -> None:
        if side == "llama.cpp":
            figures = llama_batched(t, args.threads, args.depth, args.tokens, b)
        else:
            figures = moespec_batched(head, prompt_windows(head, args.depth, b), args.tokens)
        for key, value in figures.items():
            add(f"batch {b} {key} {side}", value)

    if args.server_clients:  # both servers live for the whole run, idle while other modes measure
        most = max(args.server_clients)
        llama = servers.enter_context(LlamaServer(t["llama-server"], t["target"], args.threads, most,
                                                  args.depth + args.tokens + 16))
        address = servers.enter_context(ServeProcess(["--port", "0", "--kernel-threads", str(args.threads),
                                                        "--max-queue", str(2 * most)]))
        client = servers.enter_context(MoespecClient(address))
        client.wait_ready(timeout=120)
        server_prompts = prompt_windows(head, args.depth, most)
        for send in (llama.complete, moespec_send(client)):  # warm-up: first requests pay one-off costs
            concurrent_load(send, server_prompts[:2], 8)

    def server(clients: int, side: str) -> None:
        send = llama.complete if side == "llama.cpp" else moespec_send(client)
        add(f"server {clients} {side}", concurrent_load(send, server_prompts[:clients], args.tokens))

    modes = [decode, prefill, *(partial(speculative, k) for k in args.draft_lengths),
             *(partial(batched, b) for b in args.batch), *(partial(server, c) for c in args.server_clients)]
    # The step limit (limit.py) at the decode's middle context; llama.cpp's GGUF holds the same bf16 weights.
    cost, bf16_math = fused_step_cost(head.target, context=args.depth + args.tokens // 2)
    for rnd in range(args.rounds):
        rates = measure_rates(cost.weight_bytes, head.kernel_threads.threads)
        add("decode limit", cost.limit_tokens_per_second(rates, bf16_math))
        # Each mode's two sides back to back, the order swapped every round: a pair is seconds apart,
        # so drift of the shared machine moves both sides of it alike.
        for mode in modes:
            for side in ("llama.cpp", "moespec") if rnd % 2 == 0 else ("moespec", "llama.cpp"):
                mode(side)
    result = summarise(args, samples)
    (args.out / "llamacpp.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "llamacpp.md").write_text(text)
    print(text)
    return 0


def summarise(args: argparse.Namespace, samples: dict[str, list[float]]) -> dict:
    """Medians and ranges per figure, and moespec over llama.cpp round by round for each pair."""
    pairs = {"decode": ("decode moespec", "decode llama.cpp"), "prefill": ("prefill moespec", "prefill llama.cpp")}
    for k in args.draft_lengths:
        for label in ("dense draft", "draft head"):
            pairs[f"speculative k={k} ({label})"] = (f"speculative k={k} moespec {label}",
                                                     f"speculative k={k} llama.cpp")
    for b in args.batch:
        for key in ("generation_tokens_per_second", "output_tokens_per_second"):
            pairs[f"batch {b} {key.removesuffix('_tokens_per_second')}"] = (f"batch {b} {key} moespec",
                                                                             f"batch {b} {key} llama.cpp")
    for c in args.server_clients:
        pairs[f"server {c} clients"] = (f"server {c} moespec", f"server {c} llama.cpp")
    ratios = {name: [a / b for a, b in zip(samples[ours], samples[theirs], strict=True)]
              for name, (ours, theirs) in pairs.items()}
    result = {"threads": args.threads, "depth": args.depth, "tokens": args.tokens, "rounds": args.rounds,
              "samples": samples, "pairs": {n: list(p) for n, p in pairs.items()},
              "moespec_over_llama_cpp": {n: _spread(r) for n, r in ratios.items()}}
    # moespec through its server over the same load in-process (same round): the gRPC layer's share.
    grpc = {c: [a / b for a, b in zip(samples[f"server {c} moespec"],
                                      samples[f"batch {c} output_tokens_per_second moespec"], strict=True)]
            for c in args.server_clients if c in args.batch}
    if grpc:
        result["moespec_server_over_in_process"] = {str(c): _spread(r) for c, r in grpc.items()}
    if "decode limit" in samples:  # each side's decode over the same round's step limit
        result["decode_share_of_limit"] = {
            side: _spread([v / limit for v, limit in zip(samples[f"decode {side}"], samples["decode limit"],
                                                          strict=True)])
            for side in ("moespec", "llama.cpp")}
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def markdown(result: dict) -> str:
    s = result["samples"]
    rows = [f"llama.cpp vs moespec, {result['threads']} threads, {result['tokens']} tokens after {result['depth']} "
            f"of context, {result['rounds']} interleaved rounds (medians; ratio range over rounds)", "",
            "| mode | llama.cpp tokens/s | moespec tokens/s | moespec / llama.cpp |", "|---|---:|---:|---:|"]
    for name, (ours, theirs) in result["pairs"].items():
        r = result["moespec_over_llama_cpp"][name]
        rows.append(f"| {name} | {statistics.median(s[theirs]):,.0f} | {statistics.median(s[ours]):,.0f} | "
                    f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |")
    for c, r in result.get("moespec_server_over_in_process", {}).items():
        rows.append(f"\nmoespec at {c} clients through `moespec serve` (gRPC) over the same load in-process: "
                    f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    if "decode_share_of_limit" in result:
        shares = ", ".join(f"{side} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})"
                           for side, v in result["decode_share_of_limit"].items())
        limit = statistics.median(s["decode limit"])
        rows += ["", f"decode as a share of the step limit (service/bench/limit.py: the step's bytes and flops at "
                     f"this machine's cache-resident read and FMA rates, measured each round; median {limit:,.0f} "
                     f"tokens/s): {shares}"]
    return "\n".join(rows) + "\n"
