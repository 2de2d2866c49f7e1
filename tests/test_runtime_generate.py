"""`fuselm run` and the runtime's pieces: generation, sampling, chat, eos, profile, A/B switch,
debug switches, KV-cache modes, the fused kernels against references, foreign graphs."""

import json
import shutil

import numpy as np
import pytest
from fuselm.runtime_metal.backends import make_backend
from fuselm.runtime_metal.backends.numpy_backend import NumpyBackend
from fuselm.runtime_metal.session import Session

import fuselm
from fuselm import cli


def _greedy(sess, ids, n):
    sess.reset(len(ids) + n)
    out = [sess.logits_to_numpy(sess.prefill(ids))]
    for _ in range(n - 1):
        out.append(sess.logits_to_numpy(sess.decode(int(np.argmax(out[-1])))))
    return np.stack(out)


def test_cli_run_streams_text_and_reports_speed(optimized, capsys):
    rc = cli.main(["run", str(optimized("qwen2", "q4")), "--prompt", "the quick brown fox", "--max-tokens", "6",
                   "--ignore-eos"])
    cap = capsys.readouterr()
    assert rc == 0
    assert cap.out.strip()  # the generated text
    assert "torch on cpu" in cap.err and "prefill" in cap.err and "tok/s" in cap.err


def test_eos_stops_unless_ignored(exported, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(exported("qwen2", "f32"), model)
    free = fuselm.run(model, prompt=[5, 6, 7], max_tokens=6, ignore_eos=True, quiet=True)
    assert len(free["tokens"]) == 6
    stop = free["tokens"][2]
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [stop, 99999]}))
    r = fuselm.run(model, prompt=[5, 6, 7], max_tokens=6, quiet=True)
    assert r["tokens"] == free["tokens"][: free["tokens"].index(stop) + 1] and r["stopped_at_eos"]
    assert fuselm.run(model, prompt=[5, 6, 7], max_tokens=6, ignore_eos=True, quiet=True)["tokens"] == free["tokens"]


def test_sampling_is_seeded_and_top_k_1_is_greedy(exported):
    model = exported("qwen2", "f32")
    kw = dict(prompt=[5, 6, 7], max_tokens=8, ignore_eos=True, quiet=True)
    greedy = fuselm.run(model, **kw)["tokens"]
    a = fuselm.run(model, temperature=1.5, seed=3, **kw)["tokens"]
    assert a == fuselm.run(model, temperature=1.5, seed=3, **kw)["tokens"]
    assert a != greedy  # temperature 1.5 over a 384-token vocabulary: 8 greedy picks in a row are unlikely
    assert fuselm.run(model, temperature=1.5, top_k=1, seed=4, **kw)["tokens"] == greedy
    assert fuselm.run(model, temperature=1.0, top_p=1e-6, seed=5, **kw)["tokens"] == greedy


def test_chat_template(exported, make_ckpt):
    from transformers import AutoTokenizer

    model = exported("qwen3", "f32")
    tok = AutoTokenizer.from_pretrained(str(make_ckpt("qwen3")))
    want = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    r = fuselm.run(model, prompt="hello", chat=True, max_tokens=2, quiet=True)
    assert r["prompt_tokens"] == len(want) and len(want) > len(tok.encode("hello"))


def test_profile_table(optimized, capsys):
    model = optimized("qwen3", "q4")
    r = fuselm.run(model, prompt=[1, 2, 3], max_tokens=9, ignore_eos=True, profile=True)
    err = capsys.readouterr().err
    assert "decode profile" in err and "ops dispatched per decode token" in err and "Attention" in err
    prof = r["profile"]
    sess = Session(model)
    sess.reset(8)
    sess.prefill([1, 2, 3])
    for _ in range(3):
        sess.decode(4)
    steps = len(sess.executor.plan_for(_static_feeds(sess)).steps)
    assert prof["tokens"] == 5 and prof["ops_per_token"] == steps
    assert abs(sum(o["share"] for o in prof["ops"]) - 1) < 1e-6
    assert prof["ops"] == sorted(prof["ops"], key=lambda o: -o["total_ms"])


def _static_feeds(sess):
    """The feed signature of a static decode step (to look its plan up)."""
    from fuselm.runtime_metal.kvcache import CacheView

    b = sess.backend
    feeds = {"input_ids": sess._ids([0]), "attention_mask": sess._ids(np.zeros(sess.max_len)),
             "position_ids": sess._ids([0])}
    for c in sess.caches:
        feeds[c.name] = CacheView(sess.buffers[c.name], b.asarray(np.array(0)), 1, static=True)
    return feeds


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_no_fused_kernels_matches_fused(optimized, backend):
    """A/B: FusedRoPE through its function body, RMSNorm/Attention decomposed, vs the fused kernels.
    llama: llama3 rope scaling and a single kv head."""
    model = optimized("llama", "f32")
    fused = _greedy(Session(model, backend=backend), [3, 4, 5, 6], 4)
    plain = _greedy(Session(model, backend=backend, fused_kernels=False), [3, 4, 5, 6], 4)
    np.testing.assert_allclose(fused, plain, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_static_decode_match(exported):
    """Prefill in chunks of 2 == one chunk; static-shape decode == dynamic decode."""
    model = exported("mistral", "f32")
    ids = [7, 8, 9, 10, 11]
    a = Session(model)
    a.reset(12)
    whole = a.logits_to_numpy(a.prefill(ids))
    b = Session(model)
    b.reset(12)
    chunked = b.logits_to_numpy(b.prefill(ids, chunk=2))
    np.testing.assert_allclose(whole, chunked, atol=1e-5)
    static = _greedy(Session(model), ids, 5)
    dynamic = _greedy(Session(model, static_decode=False), ids, 5)
    np.testing.assert_allclose(static, dynamic, atol=1e-5)


def test_sliding_window_uses_dynamic_decode_past_the_window(make_ckpt, tmp_path):
    """A sliding-window mask is computed from the cache index, so static shapes would shift it."""
    ckpt = make_ckpt("mistral", sliding_window=4)
    out = tmp_path / "m"
    fuselm.convert(ckpt, out, quiet=True)
    r = fuselm.validate(out, ckpt, tokens=6, prompt=[3, 4, 5], backend="torch", quiet=True)
    assert r["tokens"] == r["hf"] and not r["static_decode"]


def test_debug_switches(exported, monkeypatch, capsys):
    model = exported("qwen3", "f32")
    monkeypatch.setenv("FUSELM_DEBUG", "1")
    monkeypatch.setenv("FUSELM_LIMIT", "5")
    sess = Session(model)
    sess.reset(4)
    feeds = {"input_ids": sess._ids([1, 2]), "attention_mask": sess._ids([1, 1]), "position_ids": sess._ids([0, 1])}
    for c in sess.caches:
        feeds[c.name] = sess.backend.full((1, c.heads, 0, c.head_dim), 0, c.dtype)
    out = sess.executor.run(feeds)
    err = capsys.readouterr().err
    assert err.count("[fuselm] ") == 5 and "min=" in err and "/model/embed_tokens/Gather" in err
    assert "logits" not in out  # stopped before the end


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rope_kernel_matches_reference(backend, interleaved):
    """mx.fast.rope (periods = 1/inv_freq, start offset) and torch vs numpy: partial rotary,
    attention_scaling, S == H."""
    b = make_backend(backend, "cpu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 4, 32)).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, 24, 2) / 24)).astype(np.float32)  # rotary_dim 24 < head_dim 32
    pos = np.arange(7, 11)[None]
    want = NumpyBackend().rope(x, pos, inv, 1.25, bool(interleaved))
    got = b.to_numpy(b.rope(b.asarray(x), b.asarray(pos), inv, 1.25, bool(interleaved), offset=b.asarray(np.array(7))))
    np.testing.assert_allclose(got, want, atol=1e-5)
    got = b.to_numpy(b.rope(b.asarray(x), b.asarray(pos), inv, 1.25, bool(interleaved)))
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("bits,block", [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_quantized_matmul_matches_dequantized(backend, bits, block):
    b = make_backend(backend, "cpu")
    rng = np.random.default_rng(1)
    k, n = 256, 96
    q = rng.integers(0, 2**bits, (k, n)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (k // block, n)).astype(np.float32)
    zp = rng.integers(0, 2**bits, (k // block, n)).astype(np.uint8)
    w = (q.astype(np.float32) - np.repeat(zp, block, 0)) * np.repeat(scale, block, 0)
    qw = b.prepare_quantized(q, scale, zp, block, bits)
    # the CPU kernels round x per 32 values: to int8 (kind *-int8, 1/254 of the largest; their error is held
    # against onnxruntime's int8 activations in tests/test_cpu_kernels.py) or int16
    tol = 1e-2 if qw.kind.endswith("-int8") else 1e-4
    for rows in (3, 40):  # decode (GEMV) and prefill (GEMM)
        xr = rng.standard_normal((rows, k)).astype(np.float32)
        got = b.to_numpy(b.quantized_matmul(b.asarray(xr), qw))
        want = xr.astype(np.float64) @ w
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), (rows, np.abs(got - want).max())
    if backend == "mlx":
        assert qw.kind == "mlx"


def test_graph_from_another_exporter(make_ckpt, tmp_path):
    """torch.onnx.export(dynamo=True) of a plain HF model (eager attention, decomposed) runs and
    matches HF, as written and after `fuselm optimize`."""
    from torch_export import export_hf

    ckpt = make_ckpt("qwen2")
    path = export_hf(ckpt, tmp_path / "hf" / "model.onnx")
    for model in (path, fuselm.optimize(path, tmp_path / "opt", quiet=True)):
        for backend in ("torch", "mlx"):
            r = fuselm.validate(model, ckpt, tokens=4, prompt=[3, 4, 5], backend=backend, quiet=True)
            assert r["tokens"] == r["hf"] and max(r["max_logit_diff_hf"]) < 1e-3 and r["static_decode"]
