"""Speculative decoding on real text: plain decode against n-gram (prompt lookup) and draft-model drafts, on prompts
grounded in a passage they give (rewrite, summarise, extract, a code edit) and open-ended ones, side by side with
mlx-lm's speculative decoding (a draft model) on the same prompts where mlx-lm is installed, and llama.cpp's prompt
lookup (llama-cpp-python's LlamaPromptLookupDecoding, on the checkpoint's own GGUF file) where it is.

    python bench/speculative.py --model Q8_DIR [--draft Q4_DIR] [--mlx-lm MLX_DIR --mlx-lm-draft MLX_Q4_DIR]
        [--llama-cpp GGUF [--llama-cpp-python PYTHON]] [--backend auto] [--num-draft 4] [--tokens 128] [--runs 3]
        [--out FILE]

Each (engine, method) runs in its own process over every prompt, greedy, stopping at the end-of-turn token (the
chat template applied): `runs` rounds, interleaved, medians per prompt. Decode tok/s excludes the first token (its
time is the prompt's). Greedy speculation must give plain decode's tokens: a row whose tokens differ is marked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _child import run_child  # noqa: E402

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
           "great lens until it shone, and wound the clockwork that turned the light. Ships passing the rocky point "
           "at night counted the flashes, three short and one long, and knew where they were. In winter the storms "
           "came in from the north, and the keeper kept a log of every vessel he saw, its name, its course and the "
           "hour it passed.")
CODE = ("def total(items):\n    t = 0\n    for x in items:\n        if x > 0:\n            t = t + x\n    return t\n")
WARM = 16  # warm-up tokens per prompt and engine (compiles; a verification step of k + 1 rows where drafts come)
PROMPTS = {
    "grounded": [
        f"Rewrite this passage in the present tense, keeping every detail:\n\n{PASSAGE}",
        f"Copy out every sentence of this passage that mentions the light or the lens:\n\n{PASSAGE}",
        f"Summarise this passage in two sentences, reusing its own words:\n\n{PASSAGE}",
        f"Rename the variable `t` to `running_total` in this function and return the whole function:\n\n{CODE}",
        # the same edit asked for as code only (SmolLM2-135M answers the one above in prose)
        f"Rewrite this function with the variable `t` renamed to `total_sum`. Reply with the code only:\n\n{CODE}",
    ],
    "open": [
        "Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "List five ideas for a weekend trip and say why each is fun.",
    ],
}

FUSELM = """
import json, sys, time
from pathlib import Path
import fuselm
args = json.loads(sys.argv[1])
engine = fuselm.load(args["model"], backend=args["backend"])
opts = dict(max_tokens=args["tokens"], chat=True)
if args["method"] != "plain":
    opts.update(speculative=args["method"], num_draft=args["k"])
if args["method"] == "draft":
    opts["draft_model"] = args["draft"]
out = []
from fuselm.tokenizer import encode_prompt, load_tokenizer
tok = load_tokenizer(Path(args["model"]), required=True, chat=True)
for prompt in args["prompts"]:
    # warm-up: compiles, allocations (16 tokens: a verification step of k + 1 rows is built where drafts come)
    list(fuselm.stream_generate(engine, prompt, **{**opts, "max_tokens": args["warm"]}))
    toks, t_first, t_last = [], None, None
    for r in fuselm.stream_generate(engine, prompt, **opts):
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
        toks.append(r.token)
    spec = engine.speculation.as_dict() if engine.speculation else None
    out.append({"tokens": toks, "decode_tok_s": (len(toks) - 1) / (t_last - t_first) if len(toks) > 1 else None,
                "speculative": spec, "prompt_ids": encode_prompt(tok, prompt, chat=True)})
print("RESULT " + json.dumps({"what": engine.describe(), "rows": out}))
"""

MLX_LM = """
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
args = json.loads(sys.argv[1])
model, tok = load(args["model"])
draft = load(args["draft"])[0] if args["method"] == "draft" else None
out = []
for prompt in args["prompts"]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    kw = {"draft_model": draft, "num_draft_tokens": args["k"]} if draft is not None else {}
    for _ in stream_generate(model, tok, text, max_tokens=args["warm"], **kw):
        pass
    toks, t_first, t_last, drafted = [], None, None, 0
    for r in stream_generate(model, tok, text, max_tokens=args["tokens"], **kw):
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
        toks.append(int(r.token))
        drafted += bool(getattr(r, "from_draft", False))
        if r.finish_reason:
            break
    out.append({"tokens": toks, "decode_tok_s": (len(toks) - 1) / (t_last - t_first) if len(toks) > 1 else None,
                "speculative": {"accepted": drafted} if draft is not None else None})
print("RESULT " + json.dumps({"what": f"mlx-lm on {mx.default_device()}", "rows": out}))
"""

LLAMA_CPP = """
import json, os, sys, time
from llama_cpp import Llama, __version__
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
args = json.loads(sys.argv[1])
draft = LlamaPromptLookupDecoding(num_pred_tokens=args["k"]) if args["method"] == "ngram" else None
llm = Llama(model_path=args["model"], n_ctx=2048, n_threads=os.cpu_count(), verbose=False, draft_model=draft)
out = []
for prompt in args["prompts"]:
    msgs = [{"role": "user", "content": prompt}]
    list(llm.create_chat_completion(msgs, max_tokens=args["warm"], temperature=0.0, stream=True))
    text, n, t_first, t_last = [], 0, None, None
    for chunk in llm.create_chat_completion(msgs, max_tokens=args["tokens"], temperature=0.0, stream=True):
        piece = chunk["choices"][0]["delta"].get("content")
        if piece is None:
            continue
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
        n += 1
        text.append(piece)
    out.append({"tokens": "".join(text), "decode_tok_s": (n - 1) / (t_last - t_first) if n > 1 else None,
                "speculative": None})
print("RESULT " + json.dumps({"what": f"llama-cpp-python {__version__}, CPU", "rows": out}))
"""


def child(code: str, args: dict, python: str = sys.executable) -> dict:
    c = run_child([python, "-c", code, json.dumps(args)])
    line = next((ln for ln in c.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if c.returncode != 0 or line is None:
        return {"error": c.tail()}
    return {**json.loads(line[7:]), "wall_s": round(c.wall_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the fuselm model directory to speed up")
    ap.add_argument("--draft", default=None, help="a fuselm draft model directory (e.g. the same checkpoint at q4)")
    ap.add_argument("--mlx-lm", default=None, help="the same checkpoint as mlx_lm.convert wrote it (the peer)")
    ap.add_argument("--mlx-lm-draft", default=None, help="the peer's draft model")
    ap.add_argument("--llama-cpp", default=None, help="the checkpoint's GGUF file, for llama.cpp's prompt lookup "
                    "(llama-cpp-python's LlamaPromptLookupDecoding) against its plain decode")
    ap.add_argument("--llama-cpp-python", default=sys.executable, help="a Python that has llama_cpp installed")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from first_token import processor, versions

    prompts = [p for kind in PROMPTS.values() for p in kind]
    kinds = [kind for kind, ps in PROMPTS.items() for _ in ps]
    engines = [("fuselm", "plain"), ("fuselm", "ngram")] + ([("fuselm", "draft")] if args.draft else [])
    if args.mlx_lm:
        engines += [("mlx-lm", "plain")] + ([("mlx-lm", "draft")] if args.mlx_lm_draft else [])
    if args.llama_cpp:
        engines += [("llama.cpp", "plain"), ("llama.cpp", "ngram")]
    runs: dict[str, list] = {f"{e}:{m}": [] for e, m in engines}
    for r in range(args.runs):
        for e, m in engines if r % 2 == 0 else engines[::-1]:
            common = {"method": m, "k": args.num_draft, "tokens": args.tokens, "prompts": prompts, "warm": WARM}
            if e == "fuselm":
                got = child(FUSELM, {**common, "model": args.model, "backend": args.backend, "draft": args.draft})
            elif e == "llama.cpp":
                got = child(LLAMA_CPP, {**common, "model": args.llama_cpp}, args.llama_cpp_python)
            else:
                got = child(MLX_LM, {**common, "model": args.mlx_lm, "draft": args.mlx_lm_draft})
            runs[f"{e}:{m}"].append(got)
            print(f"{e}:{m} round {r}: {got.get('error') or got['what']}", flush=True)
            table = summarise(runs, kinds, prompts)  # written after every child: a run cut off keeps what it has
            if args.out:
                args.out.write_text(json.dumps({
                    "bench": "speculative", "command": " ".join(["python", "bench/speculative.py", *sys.argv[1:]]),
                    "date": time.strftime("%Y-%m-%d"), "machine": processor(), "versions": versions(),
                    "rounds_done": r + 1, "table": table, "runs": runs}, indent=1) + "\n")
    for row in table:
        print(json.dumps(row), flush=True)


def lookup_share(prompt: list[int], tokens: list[int], n: int = 3) -> float | None:
    """The share of plain decode's tokens that prompt lookup could have drafted: the token follows an n-gram that
    occurred before (in the prompt or the output) followed by that same token. A model that rewrites rather than
    copies its input leaves prompt lookup little to find, whatever the prompt asks."""
    ids, hits = list(prompt), 0
    for t in tokens:
        tail = tuple(ids[-n:])
        hits += any(tuple(ids[j:j + n]) == tail and ids[j + n] == t for j in range(len(ids) - n))
        ids.append(t)
    return round(hits / len(tokens), 3) if tokens else None


def summarise(runs: dict[str, list], kinds: list[str], prompts: list[str]) -> list[dict]:
    """Per prompt: each engine's median tok/s over the runs so far, acceptance, ratios to plain, same tokens."""

    def median(name: str, i: int) -> float | None:
        got = [x["rows"][i]["decode_tok_s"] for x in runs[name] if "rows" in x and x["rows"][i]["decode_tok_s"]]
        return statistics.median(got) if got else None

    table = []
    for i, (kind, prompt) in enumerate(zip(kinds, prompts, strict=True)):
        row = {"kind": kind, "prompt": prompt[:60]}
        for name in runs:
            row[name] = median(name, i)
            first = next((x for x in runs[name] if "rows" in x), None)
            if first and first["rows"][i]["speculative"]:
                row[f"{name}:acceptance"] = first["rows"][i]["speculative"].get("acceptance")
                row[f"{name}:tokens_per_step"] = first["rows"][i]["speculative"].get("tokens_per_target_step")
        for e in ("fuselm", "mlx-lm", "llama.cpp"):
            base = row.get(f"{e}:plain")
            for m in ("ngram", "draft"):
                if row.get(f"{e}:{m}") and base:
                    row[f"{e}:{m}/plain"] = round(row[f"{e}:{m}"] / base, 3)
        lp, ln = (next((x for x in runs.get(f"llama.cpp:{m}", []) if "rows" in x), None) for m in ("plain", "ngram"))
        if lp and ln:  # (llama.cpp's rows are the streamed text)
            row["llama.cpp:ngram:same_tokens"] = ln["rows"][i]["tokens"] == lp["rows"][i]["tokens"]
        plain = next((x for x in runs["fuselm:plain"] if "rows" in x), None)
        if plain and "prompt_ids" in plain["rows"][i]:
            row["lookup_share"] = lookup_share(plain["rows"][i]["prompt_ids"], plain["rows"][i]["tokens"])
        for m in ("ngram", "draft"):
            spec = next((x for x in runs.get(f"fuselm:{m}", []) if "rows" in x), None)
            if plain and spec:
                row[f"fuselm:{m}:same_tokens"] = spec["rows"][i]["tokens"] == plain["rows"][i]["tokens"]
        table.append(row)
    return table

if __name__ == "__main__":
    main()
