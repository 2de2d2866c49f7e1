"""Calibration for activation-aware quantization and mixed precision: HF transformers (float32, CPU) reads a
text, and hooks on its linear layers measure what the quantizer weighs errors by.

Per quantized weight (HF names; a tied head under the embedding's name):
- `importance`: the mean square of each input column (what a weight's error is multiplied by): the `mse`
  search weighs errors by it (llama.cpp's importance matrix);
- `hessians` (method gptq): E[x xᵀ] of the input, accumulated in float32 arrays on disk, so memory holds
  the model and one layer's activations, not every layer's matrix;
- `sensitivity` (mixed precision): also the mean square of the loss gradient at each output row, from a
  backward pass; quantizing W to Q(W) then costs about ½ Σ_ji g²_j x²_i (W - Q(W))²_ji of the loss (the
  Fisher information's diagonal, factored by rows and columns). `allocate` spends a bits-per-weight budget
  where that estimate falls most per stored bit.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from pathlib import Path

import numpy as np

from fuselm import text as text_mod
from fuselm.errors import FuselmError

from .quant import Precision, Recipe, quantize

CALIB_TOKENS = 2048  # for GPTQ's E[x xᵀ] and the gradients of mixed precision
IMPORTANCE_TOKENS = 256  # for the mean squares alone (the default 4-bit convert's): they settle in a few hundred
# What mixed precision chooses from, cheapest first (bits per weight: 4.28, 4.56, 5.13, 8.63, 9.25)
OPTIONS = (("q4", 128), ("q4", 64), ("q4", 32), ("q8", 64), ("q8", 32))


def calibrate(hf_dir: Path, text: str | None = None, tokens: int | None = None, hessians: bool = False,
              gradients: bool = False, quiet: bool = True) -> dict:
    """Run the checkpoint on the calibration text (default fuselm/data/botchan-2.txt, its first `tokens`
    tokens in windows of up to 512; default CALIB_TOKENS, IMPORTANCE_TOKENS for the mean squares alone) and return {"importance", "hessians", "gradients", "weights", "text"}:
    per weight name the input columns' mean squares, E[x xᵀ] (memmaps in a temporary folder, when asked),
    the output rows' mean squared loss gradients (when asked), and the float32 weights (for `allocate`)."""
    import torch

    from fuselm.reference import hf_model
    from fuselm.tokenizer import load_tokenizer

    body, source = text_mod.read_text(text, text_mod.CALIB_TEXT)
    tok = load_tokenizer(Path(hf_dir), required=True)
    tokens = tokens or (CALIB_TOKENS if hessians or gradients else IMPORTANCE_TOKENS)
    pieces = text_mod.windows(tok.encode(body), min(text_mod.WINDOW, tokens), tokens)
    if not quiet:
        print(f"fuselm convert: calibrating on {sum(map(len, pieces))} tokens of {source}"
              f"{' (forward and backward)' if gradients else ''}")
    model = hf_model(hf_dir)
    linears = _quantized_linears(model)
    folder = Path(tempfile.mkdtemp(prefix="fuselm-calib-")) if hessians else None
    stats = {name: {"n": 0, "sq": None, "g": None, "H": None} for name in linears.values()}
    hooks = []

    def forward_hook(module, args, output, name):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        d = stats[name]
        d["n"] += x.shape[0]
        sq = x.square().sum(0)
        d["sq"] = sq if d["sq"] is None else d["sq"] + sq
        if folder is not None:
            if d["H"] is None:
                d["H"] = np.lib.format.open_memmap(folder / f"{len(os.listdir(folder))}.npy", "w+", np.float32,
                                                   (x.shape[1], x.shape[1]))
            torch.from_numpy(d["H"]).add_(x.T @ x)

    def backward_hook(module, grad_input, grad_output, name):
        g = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1]).float().square().sum(0)
        stats[name]["g"] = g if stats[name]["g"] is None else stats[name]["g"] + g

    head = model.get_output_embeddings()
    base = model.base_model  # its output is the head's input: forward-only runs stop there (the head is a fifth)
    for module, name in linears.items():
        if module is head and not gradients:
            hooks.append(base.register_forward_hook(
                lambda m, a, o, name=name: forward_hook(m, (o.last_hidden_state,), None, name)))
            continue
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: forward_hook(m, a, o, name)))
        if gradients:
            hooks.append(module.register_full_backward_hook(lambda m, gi, go, name=name: backward_hook(m, gi, go, name)))
    try:
        for ids in pieces:
            x = torch.from_numpy(np.asarray(ids, np.int64)[None])
            if gradients:
                model.zero_grad(set_to_none=True)
                logits = model(input_ids=x, use_cache=False).logits[0, :-1]
                # summed over the text's tokens, so each token's gradient counts once
                torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").backward()
            else:
                with torch.no_grad():
                    base(input_ids=x, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {"importance": {}, "hessians": {}, "gradients": {}, "weights": {}, "folder": folder,
           "text": {"text": source, "tokens": int(sum(map(len, pieces)))}}
    for module, name in linears.items():
        d = stats[name]
        if not d["n"]:
            continue
        out["importance"][name] = (d["sq"] / d["n"]).numpy()
        if d["H"] is not None:
            d["H"] /= d["n"]
            d["H"].flush()
            out["hessians"][name] = d["H"]
        if d["g"] is not None:
            out["gradients"][name] = (d["g"] / d["n"]).numpy()
        out["weights"][name] = module.weight.detach().float().numpy()
    return out


def _quantized_linears(model) -> dict:
    """module -> the checkpoint name of its weight, for every 2-D linear weight a convert quantizes: the
    layers' linears and the head (a tied head under the embedding's name)."""
    import torch

    embed = model.get_input_embeddings()
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dim() == 2:
            tied = embed is not None and module.weight is embed.weight
            out[module] = names.get(id(embed.weight)) if tied else f"{mod_name}.weight"
    return out


def allocate(cal: dict, budget: float, method: str, default: Precision) -> dict[str, Precision]:
    """The precision of each measured weight (OPTIONS) so that their stored bits per weight stay within
    `budget`, greedily upgrading where the estimated loss falls most per added bit, from the cheapest up."""
    weights, grads, imp = cal["weights"], cal["gradients"], cal["importance"]
    search = "mse" if method in ("mse", "gptq") else "rtn"
    costs: dict[str, list[tuple[float, float]]] = {}  # name -> [(bits, estimated loss)] per option
    total_weights = sum(w.size for w in weights.values())
    for name, w in weights.items():
        row = []
        for kind, block in OPTIONS:
            p = Precision(kind, block)
            q, s, z = quantize(w, p.bits, block, axis=1, method=search, importance=imp.get(name))
            err = _dequantized(q, s, z, block) - w
            loss = 0.5 * float((grads[name][:, None] * np.square(err) * imp[name][None]).sum())
            row.append((p.bits_per_weight() * w.size, loss))
        costs[name] = _hull(row)
    floor = sum(c[0][0] for c in costs.values())
    if budget * total_weights < floor:
        raise FuselmError(f"--bits-per-weight {budget} is below the cheapest mixture ({floor / total_weights:.3f} bits "
                          f"per weight: every tensor q4 in blocks of {OPTIONS[0][1]}); pass a larger budget")
    level = {name: 0 for name in costs}
    spent = floor
    heap = [(-_gain(costs[n], 0), n) for n in costs if len(costs[n]) > 1]
    heapq.heapify(heap)
    while heap:
        _, name = heapq.heappop(heap)
        i = level[name]
        extra = costs[name][i + 1][0] - costs[name][i][0]
        if spent + extra > budget * total_weights:
            continue  # too dear now; a cheaper step elsewhere may still fit
        spent += extra
        level[name] = i + 1
        if i + 2 < len(costs[name]):
            heapq.heappush(heap, (-_gain(costs[name], i + 1), name))
    chosen = {}
    for name, row in costs.items():
        bits = row[level[name]][0] / weights[name].size
        kind, block = next((k, b) for k, b in OPTIONS if abs(Precision(k, b).bits_per_weight() - bits) < 1e-9)
        chosen[name] = Precision(kind, block, method)
    return chosen


def _hull(row: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The options worth taking in order: bits rising, loss falling, each step cheaper per bit saved than
    the one before (the lower convex hull), so greedy upgrades stay optimal."""
    pts = []
    for bits, loss in sorted(row):
        if pts and loss >= pts[-1][1]:
            continue
        while len(pts) >= 2 and _slope(pts[-2], pts[-1]) <= _slope(pts[-1], (bits, loss)):
            pts.pop()
        pts.append((bits, loss))
    return pts


def _slope(a, b) -> float:
    return (a[1] - b[1]) / (b[0] - a[0])


def _gain(row, i) -> float:
    return _slope(row[i], row[i + 1])


def _dequantized(q, s, z, block) -> np.ndarray:
    n = q.shape[1]
    scale = np.repeat(s, block, axis=1)[:, :n]
    zero = np.repeat(z.astype(np.float32), block, axis=1)[:, :n]
    return (q.astype(np.float32) - zero) * scale


def recipe(hf_dir: Path, method: str, text: str | None, budget: float | None, default: Precision,
           quiet: bool = True) -> Recipe:
    """The Recipe a convert quantizes by: calibration (gptq: with E[x xᵀ]; a budget: with gradients) and,
    with `budget`, each weight's precision."""
    cal = calibrate(hf_dir, text, hessians=method == "gptq", gradients=budget is not None, quiet=quiet)
    tensors = allocate(cal, budget, method, default) if budget is not None else {}
    return Recipe(importance=cal["importance"], hessians=cal["hessians"], tensors=tensors,
                  describe={"calibration": cal["text"], "folder": cal["folder"]})
