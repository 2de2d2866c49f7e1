"""The node loop, and the per-shape plans that keep shape work off the device.

The first run for a given input signature (shapes and dtypes of every input) walks the graph:
a node whose inputs are all host constants (initializers, folded values, results of Shape) runs
on the host in numpy; every other node runs on the backend and becomes a step of the plan for
that signature. Later runs with the same signature execute only the plan's steps, with the host
results already converted to device arrays. Static-shape decode therefore runs the same plan
every token and never touches Shape/Gather/Concat-on-shapes again.

Debugging: FUSELM_DEBUG=1 prints every node with its input and output shapes and
value statistics; FUSELM_LIMIT=N stops after node N and returns what has been computed.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from fuselm import contract, switches
from fuselm.errors import FuselmError

from .backends.numpy_backend import NumpyBackend
from .graph import Graph, Node, call, reads
from .kvcache import CacheView
from .ops import OPS

_MAX_PLANS = 16


@dataclass
class Step:
    node: Node
    spec: object
    args: list  # constants in place; None where `slots` fills in a run value
    slots: list[tuple[int, str, bool]]  # (arg position, value name, convert to host)
    free: list[str] = field(default_factory=list)  # names dead after this step


@dataclass
class Plan:
    steps: list[Step]
    outputs: list[tuple[str, object]]  # (output name, constant value or None)
    reusable: bool = True


class Executor:
    """Runs a `Graph` on a backend; `run(feeds)` returns the graph outputs by name."""

    def __init__(self, graph: Graph, backend):
        self.graph = graph
        self.b = backend
        self.host = NumpyBackend()
        self.ctx: dict = {}  # run-wide hints for ops that want them (rope offset)
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._device_consts: dict[str, object] = {}
        self.debug = switches.on("FUSELM_DEBUG")
        self.limit = switches.number("FUSELM_LIMIT")
        self.profiler = None  # set to a Profiler to time every step
        self.layer_marks = _layer_marks(graph.nodes)  # where a long lazy run may wait (InFlight)

    # --- public -----------------------------------------------------------------------------
    def run(self, feeds: dict, outputs: list[str] | None = None) -> dict:
        missing = [n for n in self.graph.inputs if n not in feeds]
        if missing:
            raise FuselmError(f"missing graph inputs {missing}; the graph needs {self.graph.inputs}")
        sig = self.signature(feeds)
        plan = self.plans.get(sig)
        if plan is None or self.debug or self.limit is not None:
            try:
                plan, values = self._trace(feeds)
            except Exception as e:  # a graph the checker accepts can still fail here (shapes that do not fit)
                if isinstance(e, FuselmError):
                    raise
                at = getattr(self, "_at", None)
                where = f"node {at.name!r} ({at.op_type})" if at is not None else "the graph"
                raise FuselmError(f"{where} failed on this input ({type(e).__name__}: {str(e)[:300]}); the graph is "
                                  "invalid, or uses the op in a form the runtime does not support (FUSELM_DEBUG=1 "
                                  "shows every node)") from e
            if plan.reusable and not self.debug and self.limit is None:
                self.plans[sig] = plan
                if len(self.plans) > _MAX_PLANS:
                    self.plans.popitem(last=False)
            return values
        self.plans.move_to_end(sig)
        return self._execute(plan, feeds)

    def signature(self, feeds: dict) -> tuple:
        sig = []
        for name in self.graph.inputs:
            v = feeds[name]
            if isinstance(v, CacheView):
                sig.append((name, v.shape, "cache", v.static))
            else:
                sig.append((name, tuple(self.b.shape(v)), self.b.dtype(v)))
        return tuple(sig)

    def plan_for(self, feeds: dict) -> Plan | None:
        return self.plans.get(self.signature(feeds))

    # --- tracing: one walk that runs the graph and records the device steps --------------------
    def _trace(self, feeds: dict) -> tuple[Plan, dict]:
        g, b = self.graph, self.b
        b.new_step()
        env: dict[str, object] = dict(feeds)
        static: dict[str, np.ndarray] = dict(g.constants)
        steps: list[Step] = []
        state = {"reusable": True, "count": 0}
        self._walk(g.nodes, env, static, steps, state, release=_release_before(g.nodes, g.outputs))
        outputs, values = [], {}
        for name in g.outputs:
            if name in env:
                outputs.append((name, None))
                values[name] = env[name]
            elif name in static:
                const = b.asarray(static[name])
                outputs.append((name, const))
                values[name] = const
        _liveness(steps, [n for n, c in outputs if c is None])
        return Plan(steps, outputs, state["reusable"]), values

    def _walk(self, nodes, env, static, steps, state, release: dict | None = None) -> None:
        """`release`: node index -> values dead before it (the trace of a long prompt would otherwise
        hold every layer's activations at once)."""
        for i, node in enumerate(nodes):
            for name in (release or {}).get(i, ()):
                env.pop(name, None)
            if self.limit is not None and state["count"] >= self.limit:
                return
            state["count"] += 1
            self._at = node  # named in the error if the node fails
            if node.op_type == "If" and not node.domain:
                self._trace_if(node, env, static, steps, state)
                continue
            spec = OPS[node.key]
            present = [x for x in node.inputs if x]
            if all(x in static for x in present) and not spec.wants_context and node.domain != "fuselm.runtime":
                try:
                    outs = call(spec, self.host, node, [static[x] if x else None for x in node.inputs])
                    for name, v in zip(node.outputs, outs, strict=False):
                        if name:
                            static[name] = np.asarray(v)
                    self._debug(node, [static[x] if x else None for x in node.inputs], outs, "host")
                    continue
                except NotImplementedError:
                    pass
            args, slots = [], []
            for pos, x in enumerate(node.inputs):
                host = pos in spec.host_inputs
                if not x:
                    args.append(None)
                elif x in static:
                    args.append(static[x] if host else self._to_device(x, static[x]))
                else:
                    if x not in env:
                        raise FuselmError(f"node {node.name!r}: input {x!r} is never produced; the graph is invalid")
                    args.append(None)
                    slots.append((pos, x, host))
            run_args = list(args)
            for pos, x, host in slots:
                run_args[pos] = self.b.to_numpy(env[x]) if host else env[x]
            outs = call(spec, self.b, node, run_args, self.ctx)
            if spec.shape_only:
                for name, v in zip(node.outputs, outs, strict=False):
                    if name:
                        static[name] = np.asarray(v)
            else:
                for name, v in zip(node.outputs, outs, strict=False):
                    if name:
                        env[name] = v
                steps.append(Step(node, spec, args, slots))
                if self.ctx.get("inflight") is not None and node.name in self.layer_marks:
                    self.ctx["inflight"].mark(outs)
            self._debug(node, run_args, outs, self.b.name)

    def _trace_if(self, node, env, static, steps, state) -> None:
        cond = node.inputs[0]
        if cond in static:
            value = bool(np.asarray(static[cond]).reshape(-1)[0])
        else:  # data-dependent branch: the plan cannot be reused for another run
            value = bool(self.b.to_numpy(env[cond]).reshape(-1)[0])
            state["reusable"] = False
        branch = node.branches["then_branch" if value else "else_branch"]
        static.update(branch.constants)
        self._walk(branch.nodes, env, static, steps, state)
        for out, src in zip(node.outputs, branch.outputs, strict=True):
            if src in static:
                static[out] = static[src]
            else:
                env[out] = env[src]
                steps.append(Step(Node("Identity", "", node.name, [src], [out]), OPS[("", "Identity")], [None],
                                  [(0, src, False)]))

    def _to_device(self, name: str, value: np.ndarray):
        if name in self.graph.constants:  # weights: converted once for every plan
            if name not in self._device_consts:
                self._device_consts[name] = self.b.asarray(value)
            return self._device_consts[name]
        return self.b.asarray(value)

    # --- replay -------------------------------------------------------------------------------
    def _execute(self, plan: Plan, feeds: dict) -> dict:
        env = dict(feeds)
        self.b.new_step()
        self.run_steps(plan.steps, env)
        return {name: (env[name] if const is None else const) for name, const in plan.outputs}

    def run_steps(self, steps: list[Step], env: dict) -> None:
        """Run plan steps on the values in `env`, which they update (compiled.py runs a plan in pieces)."""
        b, ctx, prof = self.b, self.ctx, self.profiler
        inflight = ctx.get("inflight")
        for step in steps:
            args = list(step.args)
            for pos, x, host in step.slots:
                args[pos] = b.to_numpy(env[x]) if host else env[x]
            if prof is not None:
                t0 = prof.start(b)
            outs = call(step.spec, b, step.node, args, ctx)
            if prof is not None:
                prof.stop(b, step.node.op_type, outs, t0)
            for name, v in zip(step.node.outputs, outs, strict=False):
                if name:
                    env[name] = v
            for name in step.free:
                env.pop(name, None)
            if inflight is not None and step.node.name in self.layer_marks:
                inflight.mark(outs)

    def _debug(self, node: Node, ins, outs, where: str) -> None:
        if not self.debug:
            return
        desc = lambda vs: ", ".join(_describe(self.b, v) for v in vs)  # noqa: E731
        print(f"[fuselm] {node.op_type:<18} {node.name}  ({where})\n    in:  {desc(ins)}\n    out: {desc(outs)}",
              file=sys.stderr)


class InFlight:
    """A long run on a lazy backend, queued at most `depth` layers ahead of the device: after each layer's
    attention its output starts computing (async_eval) and the host waits for the layer `depth` back. A
    GPU holds the buffers of every kernel queued until it has run it, so a prompt queued whole keeps all
    its layers' activations alive at once; bounded, the peak is a few layers' worth while the device never
    waits for the host (the next layers are queued while it runs these)."""

    def __init__(self, b, depth: int):
        self.b, self.depth, self.queued = b, depth, deque()

    def mark(self, outs) -> None:
        outs = [o for o in outs if o is not None and not isinstance(o, (np.ndarray, CacheView))]
        self.b.async_eval(*outs)
        self.queued.append(outs)
        if len(self.queued) > self.depth:
            self.b.sync(self.queued.popleft())


def _layer_marks(nodes: list[Node]) -> set[str]:
    """The node that first reads each layer's past key (its attention, or the append into its cache) or recurrent
    state (its convolution or scan): one per decoder layer that has either, after that layer's input is made."""
    seen, out = set(), set()
    for n in nodes:
        for x in n.inputs:
            layer = contract.layer_of(x) if contract.is_step_past(x) and not x.endswith(".value") else None
            if layer is not None and layer not in seen:
                seen.add(layer)
                out.add(n.name)
    return out


def _release_before(nodes: list[Node], keep: list[str]) -> dict[int, list[str]]:
    """Node index -> the values whose last reader (an If reads what its branches read) came before it."""
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in reads(n):
            last[x] = i
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            out.setdefault(i + 1, []).append(name)
    return out


def _liveness(steps: list[Step], keep: list[str]) -> None:
    """Mark each intermediate value free after its last use, so a plan's peak memory stays low."""
    last: dict[str, int] = {}
    for i, s in enumerate(steps):
        for _, x, _ in s.slots:
            last[x] = i
        for o in s.node.outputs:
            last.setdefault(o, i)
    keep = set(keep)
    for name, i in last.items():
        if name not in keep:
            steps[i].free.append(name)


def _describe(b, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, CacheView):
        return f"cache{list(v.shape)}@{v.pos}"
    try:
        a = np.asarray(v) if isinstance(v, np.ndarray) else b.to_numpy(v)
    except Exception:  # noqa: BLE001 - debugging output must never fail the run
        return type(v).__name__
    if a.size == 0 or a.dtype.kind not in "fiub":
        return f"{a.dtype}{list(a.shape)}"
    f = a.astype(np.float64)
    return f"{a.dtype}{list(a.shape)} min={f.min():.4g} max={f.max():.4g} mean={f.mean():.4g}"


class Profiler:
    """Per-op-type wall time of plan steps; each step is synchronized so its time is its own."""

    def __init__(self):
        self.enabled = False
        self.times: dict[str, list] = {}

    def start(self, b):
        return time.perf_counter() if self.enabled else None

    def stop(self, b, op_type: str, outs, t0) -> None:
        if t0 is None:
            return
        for o in outs:
            if o is not None and not isinstance(o, (np.ndarray, CacheView)):
                b.sync(o)
        entry = self.times.setdefault(op_type, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
