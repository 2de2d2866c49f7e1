"""What a speculative verification step costs on this device, against a one-token decode step.

A verification feeds the target k + 1 tokens at once (runtime_metal/speculative.py). Where drafting is to pay, that
step must cost little more than a one-token step. This times both on a fuselm engine after a prompt, splitting each
step into the host's time to queue it and the wait for the device, on the path the session takes (the compiled
pieces Decoding.rows builds, when it keeps them) and on the dynamic step; it also counts the executor walks a step
makes (a compiled piece that traces again walks its ops on every call).

    python bench/verify_step.py MODEL --backend mlx --device gpu --rows 2 5 --out verify-step.json

--vector-rows N: MLX on CUDA, the verification's causal rows per sdpa call (an A/B of the backend's choice).
--advance: each step at a new position (kept, not rolled back), so that every step meets a new key length.
--loop: the same split for each verification inside n-gram speculation on bench/speculative.py's first grounded
prompt (a warm-up generation, then the timed one), with the key it ran under and whether it was built before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import fuselm

sys.path.insert(0, str(Path(__file__).parent))  # bench/speculative.py's prompts


def timed(engine, step, rows: int, repeats: int, walks: list, advance: bool = False) -> dict:
    """Host and wait milliseconds (medians) of `step(ids)` at the session's position, rolled back after each
    (`advance`: kept, so that each step runs at a new position over more keys, as inside the loop)."""
    s = engine.session
    host, wait, walked = [], [], []
    for i in range(repeats):
        ids = [100 + i + j for j in range(rows)]
        before = len(walks)
        t0 = time.perf_counter()
        out = step(ids)
        t1 = time.perf_counter()
        s.backend.to_numpy(out)
        t2 = time.perf_counter()
        walked.append(len(walks) - before)
        if not advance:
            engine.rollback(rows)
        host.append((t1 - t0) * 1e3)
        wait.append((t2 - t1) * 1e3)
    return {"first_ms": round(host[0] + wait[0], 3), "host_ms": round(statistics.median(host[1:]), 3),
            "wait_ms": round(statistics.median(wait[1:]), 3), "walks": walked}


def loop(engine, walks: list, tokens: int) -> list:
    """Each verification of an n-gram speculative generation: host and wait milliseconds, executor walks, its key."""
    from speculative import PROMPTS

    s, seen = engine.session, []
    verify, engine_verify = s.verify, engine.verify

    def traced_verify(ids):
        key = (s.max_len, len(ids))
        built = s.decoding.verifier(len(ids)) is not None
        pd = s.decoding.pos_dev
        before, t0 = len(walks), time.perf_counter()
        out = verify(ids)
        seen.append({"key": list(key), "built_before": built, "pos_dev_current": bool(pd and pd[0] == s.pos - len(ids)),
                     "host_ms": round((time.perf_counter() - t0) * 1e3, 3), "walks": len(walks) - before,
                     "t": time.perf_counter()})
        return out

    def traced_engine_verify(ids, greedy):
        out = engine_verify(ids, greedy)  # (its result read back: the device has run the step)
        if seen and "wait_ms" not in seen[-1]:
            seen[-1]["wait_ms"] = round((time.perf_counter() - seen[-1].pop("t")) * 1e3, 3)
        return out

    s.verify, engine.verify = traced_verify, traced_engine_verify
    for n in (4, tokens):
        seen.clear()
        list(fuselm.stream_generate(engine, PROMPTS["grounded"][0], max_tokens=n, chat=True, speculative="ngram"))
    for v in seen:
        print("verification", v, flush=True)
    print("summary", engine.speculation.as_dict(), flush=True)
    return list(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="mlx")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 5])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before the steps")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--loop", type=int, default=0, help="tokens of n-gram speculation to trace (0: none)")
    ap.add_argument("--advance", action="store_true", help="each step at a new position (its rows kept), not rolled "
                    "back to one: what a new key length costs")
    ap.add_argument("--vector-rows", type=int, help="MLX on CUDA: causal query rows per sdpa call in a verification "
                    "(the backend's own choice otherwise; 3 in half precision is what cuDNN takes)")
    ap.add_argument("--out")
    args = ap.parse_args()
    engine = fuselm.load(args.model, backend=args.backend, **({"device": args.device} if args.device else {}))
    s = engine.session
    if args.vector_rows:
        s.backend.vector_rows = args.vector_rows
    walks: list = []
    run_steps = s.executor.run_steps
    s.executor.run_steps = lambda *a, **k: (walks.append(1), run_steps(*a, **k))[1]
    engine.reset(args.prompt + 64 + (2 * args.repeats * sum(args.rows) + args.repeats if args.advance else 0))
    engine.forward([100 + i % 500 for i in range(args.prompt)])
    for _ in range(4):  # the static / compiled decode step is checked and built in the first steps
        s.backend.to_numpy(s.decode(7))
    one = timed(engine, lambda ids: s.decode(ids[0]), 1, args.repeats, walks, args.advance)
    result = {"model": args.model, "what": engine.describe(), "vector_rows": getattr(s.backend, "vector_rows", None),
              "advance": args.advance, "decode": one, "verify": {}, "dynamic": {}}
    for rows in args.rows:
        v = timed(engine, s.verify, rows, args.repeats, walks, args.advance)
        v["path"] = "compiled pieces" if s.decoding.verifier(rows) else "dynamic step"
        result["verify"][rows] = v
        result["dynamic"][rows] = timed(engine, lambda ids: s._step_dynamic(ids, len(ids)), rows, args.repeats, walks,
                                        args.advance)
        print(f"{rows} rows: verify {v}  dynamic {result['dynamic'][rows]}  (decode {one})", flush=True)
    if args.loop:
        result["loop"] = loop(engine, walks, args.loop)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
