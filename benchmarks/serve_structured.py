"""What structured outputs and tool calls cost `tpkit serve`, through the `openai` client,
on one server (its real CLI). Not part of `make test`.

    .venv/bin/python benchmarks/serve_structured.py --hf SMOLLM2 [--tp 1] [--rounds 5]
        [--clients 1,8] [--max-tokens 64]

- tokens/s at each client count, chat completions of `--max-tokens` new tokens with a
  JSON schema (`response_format`, a string of at least 400 characters: every request
  runs to max_tokens) against the same requests without one (`ignore_eos`: the same
  length); the two alternate within each round, and the table gives the median of the
  rounds and the median of the rounds' ratios;
- time to first token of a streamed request with a schema never seen before (cold: the
  grammar is compiled) and with the same schema again (cached), and without a schema;
- a tool call's round trip (a forced call, the tool's answer, the model's next turn of
  16 tokens) in seconds.
The load average is read before and after. SMOLLM2: `benchmarks/smollm2_folder.py`'s
folder (docs/benchmarks.md says how to make it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import PROMPTS, TPKIT, Contender, loadavg, start, stop  # noqa: E402

LONG = {"type": "json_schema", "json_schema": {"name": "essay", "schema": {
    "type": "object", "properties": {"essay": {"type": "string", "minLength": 400}},
    "required": ["essay"], "additionalProperties": False}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def ask(client, prompt: str, max_tokens: int, schema: bool) -> int:
    kw = {"response_format": LONG} if schema else {"extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, **kw)
    return r.usage.completion_tokens


def tokens_per_s(client, clients: int, max_tokens: int, schema: bool) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(2, clients))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        n = sum(pool.map(lambda p: ask(client, p, max_tokens, schema), prompts))
    return n / (time.perf_counter() - t0)


def first_token_s(client, fmt: dict | None) -> float:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2,
        temperature=0, stream=True, **({"response_format": fmt} if fmt else {}))
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            took = time.perf_counter() - t0
            break
    else:
        took = time.perf_counter() - t0
    for _ in stream:
        pass
    return took


def fresh_schema(i: int) -> dict:
    """A schema no earlier request sent (its property's name is new): compiled cold."""
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": {
        "type": "object", "properties": {f"field_{i}_{time.time_ns()}": {"type": "string"}},
        "additionalProperties": False}}}


def round_trip_s(client) -> float:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="m", messages=msgs, tools=[TOOL],
                                       tool_choice="required", temperature=0)
    call = r.choices[0].message
    msgs += [call.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny, 21 C"}]
    client.chat.completions.create(model="m", messages=msgs, tools=[TOOL], max_tokens=16,
                                   temperature=0)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    c = Contender("tpkit", [*TPKIT, "serve", "--checkpoint", args.hf, "--tp", str(args.tp),
                            "--port", "{port}", "--max-batch", "8", "--max-len", "1024",
                            "--served-model-name", "m"], "m", 0)
    load0 = loadavg()
    proc, port = start(c, Path("serve_structured.log"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=600)
        ask(client, PROMPTS[0], 8, True)  # warm-up (the tokenizer's grammar side too)
        rows = {(n, s): [] for n in levels for s in (False, True)}
        for r in range(args.rounds):
            for n in levels:
                for schema in ((False, True) if r % 2 == 0 else (True, False)):
                    rows[n, schema].append(tokens_per_s(client, n, args.max_tokens, schema))
        ttft = {"none": [], "cold": [], "cached": []}
        for i in range(args.rounds):
            ttft["none"].append(first_token_s(client, None))
            ttft["cold"].append(first_token_s(client, fresh_schema(i)))
            ttft["cached"].append(first_token_s(client, LONG))
        trips = [round_trip_s(client) for _ in range(args.rounds)]
    finally:
        stop(proc)
    med = statistics.median
    print(f"tpkit serve {args.hf} tp={args.tp}, {args.rounds} rounds, load {load0:.2f} -> "
          f"{loadavg():.2f}")
    print("| clients | without schema tok/s | with schema tok/s | ratio (medians) | "
          "median of rounds' ratios |\n|---|---|---|---|---|")
    for n in levels:
        a, b = rows[n, False], rows[n, True]
        print(f"| {n} | {med(a):.1f} | {med(b):.1f} | {med(b) / med(a):.2f}x | "
              f"{med([y / x for x, y in zip(a, b)]):.2f}x |")
    print(f"time to first token, median: no schema {med(ttft['none']) * 1e3:.0f} ms, cold "
          f"schema {med(ttft['cold']) * 1e3:.0f} ms, cached {med(ttft['cached']) * 1e3:.0f} ms")
    print(f"tool-call round trip (call, answer, 16 tokens): {med(trips):.2f} s median")


if __name__ == "__main__":
    main()
