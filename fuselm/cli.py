"""The fuselm command line: a thin dispatcher over the functions in `fuselm`."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

import fuselm
from fuselm.errors import CheckFailed, FuselmError
from fuselm.options import BACKENDS, DTYPES, Options


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fuselm", description=fuselm.__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"fuselm {fuselm.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="HF checkpoint directory -> ONNX model directory")
    c.add_argument("hf_dir")
    c.add_argument("-o", "--out", required=True)
    c.add_argument("--quant", choices=["f32", "f16", "q8", "q4"], default="f32")
    c.add_argument("--block-size", type=int, choices=[32, 64, 128], default=32)
    c.add_argument("--lm-head", choices=["f32", "f16", "q8", "q4"], default=None,
                   help="lm_head precision (default: q8 when quantizing, else as --quant)")
    c.add_argument("--embed", choices=["f32", "f16", "q8", "q4"], default=None,
                   help="embedding precision (default: tied checkpoints as the lm_head, one tensor for both; "
                        "untied f16 when quantizing, else as --quant)")
    c.add_argument("--method", choices=["rtn", "mse", "gptq"], default="mse",
                   help="how each block's scale and zero point are chosen: rtn (min/max), mse (default: the range "
                        "with the least error, weighted by the input's importance measured on a text, see --calib, or "
                        "by magnitude), gptq (errors spread over later columns; calibrates)")
    c.add_argument("--calib", nargs="?", const=True, default=None, metavar="FILE",
                   help="measure the weights' importance on a text first (default text: the bundled chapter, "
                        "fuselm/data/botchan-2.txt); gptq and --bits-per-weight always do, and so does a q4 mse "
                        "convert whose float32 model fits in a third of the free memory")
    c.add_argument("--no-calib", dest="calib", action="store_false",
                   help="data-free: weigh errors by magnitude, reading the weights as a stream")
    c.add_argument("--bits-per-weight", type=float, default=None, metavar="B",
                   help="mixed precision: each quantized tensor stored as q4 or q8 in blocks of 32-128, chosen by its "
                        "measured sensitivity so that data, scales and zero points average B bits per weight")
    c.add_argument("--exporter", choices=["auto", "builder", "torch"], default="auto",
                   help="builder: the hand-written families; torch: trace transformers' modeling code; "
                        "auto (default): the builder where it has the family, else torch")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--check", action="store_true", help="compare onnxruntime against HF transformers after writing")
    c.add_argument("--quiet", action="store_true")

    o = sub.add_parser("optimize", help="run the graph passes")
    o.add_argument("in_path")
    o.add_argument("-o", "--out", required=True)
    o.add_argument("--skip", nargs="*", default=[], metavar="PASS")
    o.add_argument("--force", action="store_true")
    o.add_argument("--quiet", action="store_true")

    d = sub.add_parser("diff", help="show pass by pass what the pipeline changes")
    d.add_argument("in_path")
    d.add_argument("--html", default=None, metavar="FILE")
    d.add_argument("--json", dest="json_path", default=None, metavar="FILE")
    d.add_argument("--skip", nargs="*", default=[], metavar="PASS")
    d.add_argument("--reference", default=None, metavar="HF_DIR",
                   help="add each stage's KL divergence from HF on a text (onnxruntime scoring)")
    d.add_argument("--text", default=None, metavar="FILE", help="--reference's text (default: the bundled chapter)")
    d.add_argument("--max-tokens", type=int, default=None, help="--reference: score only the text's first N tokens")
    for sp, targets in ((o, ["onnxruntime"]), (d, ["onnxruntime", "mlx", "torch", "numpy"])):
        sp.add_argument("--target", choices=targets, default=None,
                        help="after the portable passes, lower to a runtime's own ops (onnxruntime: its com.microsoft "
                             "contrib ops and a genai_config.json with a shared past/present buffer)"
                             + ("; mlx / torch / numpy: that fuselm backend's load-time rewrites, each with its drift "
                                "(--skip takes their names too)" if sp is d else "") + "; default: standard ONNX only")
        sp.add_argument("--accuracy-level", type=int, choices=range(5), default=4, metavar="{0..4}",
                        help="--target onnxruntime: MatMulNBits' accuracy level (4, onnxruntime-genai's CPU default: "
                             "int8 activations; 1: float32)")

    sp = sub.add_parser("split", help="cut the graph into pipeline stages (one per machine) at layer boundaries")
    sp.add_argument("in_path")
    sp.add_argument("-o", "--out", required=True)
    how = sp.add_mutually_exclusive_group(required=True)
    how.add_argument("--stages", type=int, help="N stages balanced by weight bytes")
    how.add_argument("--layers", help="explicit layer ranges, e.g. 0-13,14-27")
    sp.add_argument("--force", action="store_true")
    sp.add_argument("--quiet", action="store_true")

    for name, helptext in (("run", "generate text"), ("validate", "check greedy tokens against HF"),
                           ("eval", "perplexity, KL divergence and top-1 agreement with HF on a text")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("model_dir")
        r.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="auto (default): onnxruntime for a graph lowered for it, and on a CPU for a 4-/8-bit graph "
                            "(lowered once, kept in fuselm's cache folder), else MLX on Metal, torch elsewhere (the f32 "
                            "reference on CPU); onnxruntime: onnxruntime's CPU engine (a 4-/8-bit graph on its lowered copy)"
                            + ("; for eval, the graph as written in plain onnxruntime (f32 activations)" if name == "eval"
                               else ""))
        r.add_argument("--device", default=None, help="torch device (cpu, cuda, cuda:1, mps) or mlx device (gpu, cpu)")
        r.add_argument("--no-fused-kernels", action="store_true",
                       help="run fused ops through their ONNX function bodies (A/B check)")
        r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="compile the static-shape decode step (default: on for MLX and CUDA, off on CPU)")
        r.add_argument("--threads", type=int, default=None,
                       help="CPU threads: torch's, or onnxruntime's intra-op threads (default: the engine's own)")
        r.add_argument("--kv-bits", type=int, default=None, metavar="{8,16,32}",
                       help="KV cache storage: 8 (int8, per-group f16 scales), 16 (float16), 32 (float32); "
                            "default: the graph's dtype")
        r.add_argument("--kv-bits-k", type=int, default=None, metavar="{8,16,32}", help="keys only (overrides --kv-bits)")
        r.add_argument("--kv-bits-v", type=int, default=None, metavar="{8,16,32}", help="values only (overrides --kv-bits)")
        r.add_argument("--kv-group-size", type=int, default=None, metavar="N",
                       help="channels per int8 scale (32, 64, 128; default 64, or head_dim when smaller)")
        r.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="compute type of the graph's float32 values (auto: bf16 on an MLX GPU, else f32)")
        r.add_argument("--skip", nargs="*", default=[], metavar="REWRITE",
                       help="runtime rewrites not to apply at load, an A/B (`fuselm diff --target mlx` lists them)")
        if name == "run":
            g = r.add_mutually_exclusive_group(required=True)
            g.add_argument("--prompt")
            g.add_argument("--prompt-ids", type=_ids)
            r.add_argument("--max-tokens", type=int, default=64)
            r.add_argument("--ignore-eos", action="store_true")
            r.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template")
            r.add_argument("--temperature", type=float, default=0.0)
            r.add_argument("--top-k", type=int, default=0)
            r.add_argument("--top-p", type=float, default=1.0)
            r.add_argument("--seed", type=int, default=None)
            r.add_argument("--profile", action="store_true", help="per-op time table")
            r.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                           help="speculative decoding: draft tokens and check them in one step of the model; ngram: "
                                "from the prompt and the text so far (prompt lookup), draft: from --draft-model")
            r.add_argument("--num-draft", type=int, default=4, metavar="K", help="tokens drafted per step (default 4)")
            r.add_argument("--draft-model", default=None, metavar="DIR",
                           help="draft with this fuselm model directory (same tokenizer; e.g. a q4 graph drafting "
                                "for a q8 one): implies --speculative draft")
            r.add_argument("--pipe-timeout", type=float, default=60.0, metavar="S",
                           help="a `fuselm split` output: seconds a rank waits for its neighbour")
        elif name == "validate":
            r.add_argument("--reference", required=True, metavar="HF_DIR")
            r.add_argument("--tokens", type=int, default=16)
            r.add_argument("--prompt-ids", type=_ids, default=None)
            r.add_argument("--standard", default=None, metavar="DIR",
                           help="the onnxruntime engine on a lowered graph: the un-lowered model directory to compare "
                                "with (default: --reference converted again as DIR's fuselm.json records, then optimized)")
        else:
            r.add_argument("--reference", default=None, metavar="HF_DIR",
                           help="the HF checkpoint to compare with (KL divergence, top-1 agreement); without it, "
                                "perplexity only")
            r.add_argument("--text", default=None, metavar="FILE",
                           help="a UTF-8 text (default: the bundled public-domain chapter, fuselm/data/botchan-1.txt)")
            r.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window (default 512)")
            r.add_argument("--max-tokens", type=int, default=None, metavar="N", help="score only the text's first N tokens")
            r.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the record as JSON")
            r.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        with _unwinding_signals() as signals:
            return _main(argv, signals)
    except KeyboardInterrupt:  # a signal in _main's own handlers or while the handlers are put back
        return _interrupted("fuselm")


def _main(argv: list[str] | None, signals: list[int]) -> int:
    command = "fuselm"
    try:
        args = vars(build_parser().parse_args(argv))
        command = f"fuselm {args.pop('command')}"
        positional = {"fuselm convert": ("hf_dir", "out"), "fuselm optimize": ("in_path", "out"),
                      "fuselm diff": ("in_path",), "fuselm split": ("in_path", "out"), "fuselm run": ("model_dir",),
                      "fuselm validate": ("model_dir", "reference"), "fuselm eval": ("model_dir",)}[command]
        pos = [args.pop(k) for k in positional]
        # fuselm never downloads: transformers (reference, tokenizer, chat template) reads local files only.
        os.environ["HF_HUB_OFFLINE"] = "1"
        if command in OWN:
            _run_command(command, pos, args)
        else:
            getattr(fuselm, command.split()[1])(*pos, **args)
    except FuselmError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except CheckFailed as e:
        print(f"{command}: check failed: {e}", file=sys.stderr)
        return e.exit_code
    except Exception:
        if not signals:
            raise
        # A KeyboardInterrupt raised inside a library's callback can come back as another
        # exception (torch turns it into a ValueError): it is still the interrupt.
        return _interrupted(command)
    except KeyboardInterrupt:
        return _interrupted(command)
    return _interrupted(command) if signals else 0


# run's / validate's own arguments; every other one is a field of fuselm.Options
OWN = {"fuselm run": ("prompt", "prompt_ids", "chat"), "fuselm validate": ("tokens", "prompt_ids", "standard"),
       "fuselm eval": ("reference", "text", "window", "max_tokens", "json_path", "quiet")}


def _run_command(command: str, pos: list, args: dict) -> None:
    """`fuselm run` / `validate` / `eval`: their own arguments, and the rest built once into Options."""
    own = {k: args.pop(k) for k in OWN[command]}
    options = Options.of(**args)
    if command == "fuselm run":
        ids = own.pop("prompt_ids")
        fuselm.run(*pos, own["prompt"] if ids is None else ids, options, chat=own["chat"])
    elif command == "fuselm validate":
        fuselm.validate(*pos, options, tokens=own["tokens"], prompt=own["prompt_ids"], standard=own["standard"])
    else:
        json_path = own.pop("json_path")
        record = fuselm.eval(*pos, own.pop("reference"), options, **own)
        if json_path:
            from fuselm.passes.report import write_json

            write_json(record, json_path)


@contextlib.contextmanager
def _unwinding_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so temporary outputs are removed on the way out.
    Yields the signals received, also those a finalizer swallowed (Python would print them as an
    ignored exception and carry on). Handlers are restored afterwards (main() may be called in-process)."""
    signals: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return

    def on_signal(signum, frame):
        signals.append(signum)
        signal.default_int_handler(signum, frame)

    def unraisable(info, previous=sys.unraisablehook):
        if not isinstance(info.exc_value, KeyboardInterrupt):
            previous(info)

    saved = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield signals
    finally:
        sys.unraisablehook = saved_hook
        for s, handler in saved.items():
            signal.signal(s, handler)


def _interrupted(command: str) -> int:
    # Outputs are atomic: OUT is as it was, or complete if the run had just finished writing it.
    print(f"{command}: interrupted; nothing half-written was left", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
