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

A tied table is also the input embedding, whose rows enter the residual stream: its error costs there too.
With a backward pass (always, for a tied table's Hessian) the input use is measured as the mean square
loss gradient per hidden dimension at a looked-up row (`embedding`); the table's Hessian becomes the head's
Fisher E[|g|² h hᵀ] (g the logits' gradient) plus that diagonal (not the gradients' correlations), and
`allocate` adds the input use's cost ½ Σ_d e_d mean_v (E - Q(E))²_vd.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from pathlib import Path

import numpy as np

from fuselm import text as text_mod
from fuselm.errors import FuselmError

from .quant import Precision, Recipe, dequantize, quantize

CALIB_TOKENS = 2048  # for GPTQ's E[x xᵀ] and the gradients of mixed precision
IMPORTANCE_TOKENS = 256  # for the mean squares alone (the default 4-bit convert's): they settle in a few hundred
# What mixed precision chooses from, cheapest first (bits per weight: 4.28, 4.56, 5.13, 8.63, 9.25)
OPTIONS = (("q4", 128), ("q4", 64), ("q4", 32), ("q8", 64), ("q8", 32))


def calibrate(hf_dir: Path, text: str | None = None, tokens: int | None = None, hessians: bool = False,
              gradients: bool = False, quiet: bool = True) -> dict:
    """Run the checkpoint on the calibration text (default fuselm/data/botchan-2.txt, its first `tokens`
    tokens in windows of up to 512; default CALIB_TOKENS, IMPORTANCE_TOKENS for the mean squares alone) and return
    {"importance", "hessians", "gradients", "embedding", "weights", "text"}: per weight name the input columns'
    mean squares, E[x xᵀ] (memmaps in a temporary folder, when asked; a tied table's: module docstring), the
    output rows' mean squared loss gradients (when asked), a tied table's input use (with gradients) and the
    float32 weights (for `allocate`)."""
    import torch

    from fuselm.reference import hf_model
    from fuselm.tokenizer import load_tokenizer

    body, source = text_mod.read_text(text, text_mod.CALIB_TEXT)
    tok = load_tokenizer(Path(hf_dir), required=True)
    tokens = tokens or (CALIB_TOKENS if hessians or gradients else IMPORTANCE_TOKENS)
    pieces = text_mod.windows(tok.encode(body), min(text_mod.WINDOW, tokens), tokens)
    model = hf_model(hf_dir)
    linears = _quantized_linears(model)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if embed is not None:  # backward runs through the activations only, from the embedding's output (hook below)
        model.requires_grad_(False)
    table = linears.get(head) if head is not None and embed is not None and head.weight is embed.weight else None
    gradients = gradients or (hessians and table is not None)  # a tied table's Hessian weighs both uses by the loss
    if not quiet:
        print(f"fuselm convert: calibrating on {sum(map(len, pieces))} tokens of {source}"
              f"{' (forward and backward)' if gradients else ''}")
    folder = Path(tempfile.mkdtemp(prefix="fuselm-calib-")) if hessians else None
    stats = {name: {"n": 0, "sq": None, "g": None, "H": None} for name in linears.values()}
    fisher = {"x": None, "head": None, "input": None, "n": 0}  # the tied table's two uses (module docstring)
    hooks = []

    def forward_hook(module, args, output, name):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        d = stats[name]
        d["n"] += x.shape[0]
        sq = x.square().sum(0)
        d["sq"] = sq if d["sq"] is None else d["sq"] + sq
        if name == table and gradients:
            fisher["x"] = x  # weighted by each token's |g|² once its gradient arrives
        elif folder is not None:
            if d["H"] is None:
                d["H"] = np.lib.format.open_memmap(folder / f"{len(os.listdir(folder))}.npy", "w+", np.float32,
                                                   (x.shape[1], x.shape[1]))
            torch.from_numpy(d["H"]).add_(x.T @ x)

    def backward_hook(module, grad_input, grad_output, name):
        g = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1]).float().square()
        stats[name]["g"] = g.sum(0) if stats[name]["g"] is None else stats[name]["g"] + g.sum(0)
        if name == table:
            x = fisher["x"]
            h = (x * g.sum(1, keepdim=True)).T @ x
            fisher["head"] = h if fisher["head"] is None else fisher["head"] + h

    def embedding_hook(module, args, kwargs, output):
        ids = args[0] if args else kwargs["input_ids"]
        rows = module.weight[ids].detach()  # the output is the rows times a constant (Gemma: √hidden)
        scale = float((output.detach() * rows).sum() / rows.square().sum().clamp_min(1e-30))
        fisher["n"] += output.shape[:-1].numel()

        def grad_hook(g):
            e = (scale * g.detach().reshape(-1, g.shape[-1]).float()).square().sum(0)
            fisher["input"] = e if fisher["input"] is None else fisher["input"] + e
        output = output.requires_grad_()
        output.register_hook(grad_hook)
        return output

    base = model.base_model  # its output is the head's input: forward-only runs stop there (the head is a fifth)
    for module, name in linears.items():
        if module is head and not gradients:
            hooks.append(base.register_forward_hook(
                lambda m, a, o, name=name: forward_hook(m, (o.last_hidden_state,), None, name)))
            continue
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: forward_hook(m, a, o, name)))
        if gradients:
            hooks.append(module.register_full_backward_hook(lambda m, gi, go, name=name: backward_hook(m, gi, go, name)))
    if gradients and embed is not None:
        hooks.append(embed.register_forward_hook(embedding_hook if table else lambda m, a, k, o: o.requires_grad_(),
                                                 with_kwargs=True))
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
    out = {"importance": {}, "hessians": {}, "gradients": {}, "embedding": {}, "weights": {}, "folder": folder,
           "text": {"text": source, "tokens": int(sum(map(len, pieces)))}}
    if table is not None and fisher["input"] is not None:
        out["embedding"][table] = (fisher["input"] / fisher["n"]).numpy()
        if folder is not None:
            h = fisher["head"] / stats[table]["n"] + torch.diag(fisher["input"] / fisher["n"])
            out["hessians"][table] = h.numpy()
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
    if gradients:
        out["head"] = linears.get(head)
        out["kl"] = _kl_probe(model, linears, pieces[0])
    return out


def _kl_probe(model, linears: dict, ids):
    """kl(weights) -> the mean KL divergence from the model's next-token distributions on `ids` to theirs with the
    named weights replaced (float32 arrays in the HF layout): what mixed precision measures its estimates by."""
    import torch

    params = {name: module.weight for module, name in linears.items()}
    x = torch.from_numpy(np.asarray(ids, np.int64)[None])

    def log_probs():
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].float(), -1)
    ref = log_probs()

    def kl(weights: dict) -> float:
        saved = {name: params[name].data for name in weights}
        try:
            for name, w in weights.items():
                params[name].data = torch.from_numpy(np.asarray(w, np.float32))
            lp = log_probs()
        finally:
            for name, data in saved.items():
                params[name].data = data
        return float((ref.exp() * (ref - lp)).sum(-1).mean())
    return kl


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
    `budget`, greedily upgrading where the estimated loss falls most per added bit, from the cheapest up.

    With a model to measure (`cal["kl"]`), the estimates of each class of tensors (the head; the layers) are
    scaled to the KL divergence measured when the whole class goes from the cheapest option to the next: the
    Fisher estimate ranks tensors within a class, but its scale can differ between classes many times over
    (a second-order estimate of quantization noise that is not small), and that exchange rate decides where
    most of the budget goes."""
    weights, grads, imp, emb = cal["weights"], cal["gradients"], cal["importance"], cal.get("embedding", {})
    probe, head = cal.get("kl"), cal.get("head")
    classes = {"head": [n for n in weights if n == head], "layers": [n for n in weights if n != head]}
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in weights}  # name -> [(bits, estimated loss)] per option
    measured = {c: [] for c in classes}
    for k, (kind, block) in enumerate(OPTIONS):
        p = Precision(kind, block)
        for cls, names in classes.items():
            swap = {}
            for name in names:
                w = weights[name]
                # each tensor's blocks as its method picks their ranges (a tied table's gptq: min/max, quant.Plan)
                search = "rtn" if method == "rtn" or (method == "gptq" and name in emb) else "mse"
                q, s, z = quantize(w, p.bits, block, axis=1, method=search, importance=imp.get(name))
                dq = dequantize(q, s, z, block, axis=1)
                err2 = np.square(dq - w)
                loss = 0.5 * float((grads[name][:, None] * err2 * imp[name][None]).sum())
                if name in emb:  # a tied table's input use: any row may be looked up, each costs as the average one
                    loss += 0.5 * float(err2.mean(0) @ emb[name])
                rows[name].append((p.bits_per_weight() * w.size, loss))
                if probe is not None and names and k < 2:
                    swap[name] = dq
            if swap:
                measured[cls].append(probe(swap))
    rates = {}
    for cls, names in classes.items():
        kl = measured[cls]
        est = [sum(rows[n][k][1] for n in names) for k in range(len(kl))]
        if len(kl) == 2 and kl[0] > kl[1] and est[0] > est[1]:
            rates[cls] = (kl[0] - kl[1]) / (est[0] - est[1])
        elif kl and est[0] > 0:  # finer blocks measured no better: the level, not the slope
            rates[cls] = kl[0] / est[0]
        for n in names:
            rows[n] = [(bits, loss * rates.get(cls, 1.0)) for bits, loss in rows[n]]
    cal["rates"] = rates
    costs = {name: _hull(row) for name, row in rows.items()}
    total_weights = sum(w.size for w in weights.values())
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


def recipe(hf_dir: Path, method: str, text: str | None, budget: float | None, default: Precision,
           quiet: bool = True) -> Recipe:
    """The Recipe a convert quantizes by: calibration (gptq: with E[x xᵀ]; a budget: with gradients) and,
    with `budget`, each weight's precision."""
    cal = calibrate(hf_dir, text, hessians=method == "gptq", gradients=budget is not None, quiet=quiet)
    tensors = allocate(cal, budget, method, default) if budget is not None else {}
    text = {**cal["text"], **({"kl_per_estimate": cal["rates"]} if cal.get("rates") else {})}
    return Recipe(importance=cal["importance"], hessians=cal["hessians"], tensors=tensors,
                  describe={"calibration": text, "folder": cal["folder"]})
