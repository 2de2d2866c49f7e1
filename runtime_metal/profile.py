"""`fuselm run --profile`: where decode time goes, per op type, and dispatches per decode token."""

from __future__ import annotations


def report(sess, tokens: int, console, what: str | None = None) -> dict:
    """Print the per-op-type table of the profiled decode steps (`what` they were, where not plain decode steps);
    returns the same data."""
    from rich.table import Table

    prof = sess.profiler
    prof.enabled = False
    rows = sorted(((op, calls, secs) for op, (calls, secs) in prof.times.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows) or 1e-12
    calls = sum(r[1] for r in rows)
    per_token = calls / tokens if tokens > 0 else None
    title = f"decode profile: {tokens} tokens after {sess.backend.name} warm-up"
    table = Table(title=f"{title} ({what})" if what else title)
    for col in ("op", "calls", "total ms", "avg µs", "share"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for op, n, secs in rows:
        table.add_row(op, str(n), f"{secs * 1e3:.2f}", f"{secs / n * 1e6:.1f}", f"{secs / total:.1%}")
    if tokens <= 0:
        console.print("[yellow]--profile: generate more tokens (--max-tokens > 4, --ignore-eos) to profile decode[/yellow]")
        return {"tokens": 0, "ops": []}
    console.print(table)
    layers = (sess.meta.get("dims") or {}).get("layers")
    console.print(f"ops dispatched per decode token: {per_token:.0f}"
                  + (f" ({per_token / layers:.1f} per layer)" if layers else ""))
    kernels = sess.backend.count_kernels(sess)
    if kernels:
        console.print(f"kernels per decode token ({kernels['what']}): {kernels['kernels']}"
                      + (f" ({kernels['kernels'] / layers:.1f} per layer)" if layers else "")
                      + f"; most frequent: {', '.join(f'{k} {n}' for k, n in kernels['top'][:6])}")
    if sess.backend.lazy:
        console.print("[yellow]synchronised timings: the backend evaluates lazily, so each op was forced (and waited "
                      "for) on its own to time it; absolute times are inflated, read the ordering, not the totals. The "
                      "compiled step fuses ops (see kernels per token).[/yellow]")
    return {"tokens": tokens, "what": what or "decode steps", "ops_per_token": per_token, "kernels": kernels,
            "ops": [{"op": op, "calls": n, "total_ms": secs * 1e3, "avg_us": secs / n * 1e6, "share": secs / total}
                    for op, n, secs in rows]}
