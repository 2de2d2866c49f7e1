"""The MLX path and the generation loop: device-side token picks, the pipelined generator,
fuselm.stream_generate, decode modes, half-precision compute against HF in the same dtype and the profile's
kernel count (the benchmark against mlx-lm: tests/test_bench_mlx_peer.py)."""

import json

import numpy as np
import pytest
from fuselm.runtime_metal.sampling import Sampler
from fuselm.runtime_metal.session import Decode, Session

import fuselm
from fuselm import cli

FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]


def _host_greedy(sess, ids, n):
    """The reference loop: logits to the host, argmax there, one step at a time."""
    sess.reset(len(ids) + n)
    tok = int(np.argmax(sess.logits_to_numpy(sess.prefill(ids))))
    out = [tok]
    for _ in range(n - 1):
        tok = int(np.argmax(sess.logits_to_numpy(sess.decode(tok))))
        out.append(tok)
    return out


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_generate_picks_on_device_as_the_host_loop(optimized, backend):
    sess = Session(optimized("qwen3", "q4"), backend=backend)
    ids = [5, 9, 2, 7]
    want = _host_greedy(sess, ids, 10)
    sess.reset(len(ids) + 10)
    assert list(sess.generate(ids, 10, Sampler())) == want
    if backend == "mlx":  # compiled after the checked step, fed positions from the device
        assert sess.mode is Decode.COMPILED and sess.compiled is not None
        # its pieces take the cache buffers as they are: a longer cache decodes on the same compiled step at once
        step = sess.compiled
        sess.reset(600)
        assert sess.max_len > len(ids) + 10
        assert [int(np.argmax(sess.logits_to_numpy(sess.prefill(ids))))] == want[:1]
        assert int(np.argmax(sess.logits_to_numpy(sess.decode(want[0])))) == want[1]
        assert sess.mode is Decode.COMPILED and sess.compiled is step


@pytest.mark.parametrize("precision,kv", [("q4", {}), ("f32", {"kv_bits": 8})])
def test_build_thread_gives_the_same_tokens(optimized, monkeypatch, precision, kv):
    """Steps built by the second host thread (mlx_backend.ThreadedSteps, a GPU's default; forced on here, on
    MLX's CPU backend): the same greedy and seeded tokens as the one-thread loop, host reads in between too."""
    import threading

    from fuselm.runtime_metal.backends import mlx_backend

    model = optimized("mistral", precision, sliding_window=5, head_dim=32)  # 16 tokens: past the window
    built_on = []
    build = mlx_backend.ThreadedSteps._build
    monkeypatch.setattr(mlx_backend.ThreadedSteps, "_build",
                        lambda self, step, y: built_on.append(threading.current_thread().name) or build(self, step, y))
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUSELM_BUILD_THREAD", flag)
        sess = Session(model, backend="mlx", **kv)
        assert ("second host thread" in sess.describe()) == (flag == "1")
        ids, got = [5, 9, 2, 7], []
        for sampler in (Sampler(), Sampler(temperature=1.2, top_p=0.9, seed=4)):
            sess.reset(len(ids) + 12)
            got.append(list(sess.generate(ids, 12, sampler)))
        sess.reset(len(ids) + 12)
        it = sess.generate(ids, 12, Sampler())
        got.append([next(it), next(it)])  # left early: the queued step is waited for, the next run is clean
        it.close()
        got.append(_host_greedy(sess, ids, 6))
        runs[flag] = got
    assert runs["1"] == runs["0"]
    assert runs["1"][0][:6] == runs["1"][3]
    assert len(built_on) >= 16 and all(name.startswith("fuselm-mlx-build") for name in built_on)  # the compiled steps


def test_device_sampling(optimized):
    sess = Session(optimized("qwen2", "f32"), backend="mlx")
    ids = [3, 4, 5]
    greedy = _host_greedy(sess, ids, 8)
    sess.reset(len(ids) + 8)  # top-k 1 is greedy whatever the temperature
    assert list(sess.generate(ids, 8, Sampler(temperature=0.9, top_k=1, seed=3))) == greedy
    runs = []
    for _ in range(2):
        sess.reset(len(ids) + 8)
        runs.append(list(sess.generate(ids, 8, Sampler(temperature=1.5, top_p=0.9, seed=11))))
    assert runs[0] == runs[1]  # seeded
    vocab = sess.meta["dims"]["vocab"]
    assert all(0 <= t < vocab for t in runs[0])


def test_stream_generate(optimized):
    model = optimized("qwen3", "f32")
    out = list(fuselm.stream_generate(model, prompt=[1, 2, 3], max_tokens=5, ignore_eos=True, backend="mlx"))
    assert [r.generation_tokens for r in out] == [1, 2, 3, 4, 5]
    assert out[-1].finish_reason == "length" and all(r.finish_reason is None for r in out[:-1])
    assert out[0].prompt_tokens == 3 and out[0].prompt_tps > 0 and out[-1].generation_tps > 0
    ran = fuselm.run(model, prompt=[1, 2, 3], max_tokens=5, ignore_eos=True, backend="mlx", quiet=True)
    assert ran["tokens"] == [r.token for r in out]


def test_nan_logits_stop_on_device_pick(optimized, tmp_path):
    """The device pick flags NaN logits (-1) and generation stops with exit 2, as the host check did."""
    sess = Session(optimized("qwen3", "f32"), backend="mlx")
    import mlx.core as mx

    bad = mx.array(np.array([0.0, np.nan, 1.0], np.float32))
    assert sess.backend.item(sess.backend.pick_token(bad, Sampler())) == -1
    assert sess.backend.item(sess.backend.pick_token(mx.array(np.array([0.0, 3.0, 1.0], np.float32)), Sampler())) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_validate_bf16_within_hf_bf16_drift(optimized, make_ckpt, family):
    """bf16 compute on MLX: every step's logits stay within twice HF's own bf16 drift from the f32 reference
    plus one bf16 rounding of the largest logit (validate's HALF_FLOOR), teacher-forced on the reference tokens."""
    r = fuselm.validate(optimized(family, "f32"), make_ckpt(family), tokens=6, backend="mlx", dtype="bf16",
                        quiet=True)
    assert r["dtype"] == "bf16" and len(r["drift"]) == 6
    assert all(d <= a for d, a in zip(r["drift"], r["allowed"], strict=True))
    assert max(r["drift"]) > 0  # it did run in half precision


def test_validate_bf16_quantized(optimized, make_ckpt):
    r = fuselm.validate(optimized("llama", "q4"), make_ckpt("llama"), tokens=4, backend="mlx", dtype="bf16",
                        quiet=True)
    assert r["quantized"] and r["reference"].startswith("onnxruntime")


def test_dtype_errors(exported, capsys):
    model = str(exported("qwen3", "f32"))
    assert cli.main(["run", model, "--prompt-ids", "1", "--backend", "torch", "--dtype", "bf16"]) == 2
    assert "--dtype bf16 runs on the MLX backend" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["run", model, "--prompt-ids", "1", "--dtype", "f8"])
    assert e.value.code == 2


def test_profile_counts_kernels_on_mlx(optimized, capsys):
    r = fuselm.run(optimized("qwen3", "q4"), prompt=[1, 2, 3], max_tokens=9, ignore_eos=True, profile=True,
                   backend="mlx")
    err = capsys.readouterr().err
    assert "synchronised timings" in err and "kernels per decode token" in err
    k = r["profile"]["kernels"]
    assert k["what"] == "mx.compile fused graph" and 0 < k["kernels"] <= k["primitives"]
    assert any(name == "QuantizedMatmul" for name, _ in k["top"])


def test_prompt_matmuls_on_a_dequantized_weight_give_the_same_logits(optimized, monkeypatch):
    """A prompt chunk's quantized matmul may run as dequantize + GEMM (mlx_forms.choose: the faster of the two
    on this device, measured once per weight shape and row count): the same logits and greedy tokens either way; the
    measured choice is made once per shape and describe() says what ran."""
    from fuselm.runtime_metal.backends import mlx_forms

    model = optimized("qwen3", "q4")
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 200, 80)]  # 80 rows: past WIDE_ROWS
    assert len(ids) >= mlx_forms.WIDE_ROWS
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUSELM_WIDE_DEQUANT", flag)
        sess = Session(model, backend="mlx")
        sess.reset(len(ids) + 8)
        logits = sess.logits_to_numpy(sess.prefill(ids))
        sess.reset(len(ids) + 8)
        runs[flag] = logits, list(sess.generate(ids, 8, Sampler()))
    np.testing.assert_allclose(runs["1"][0], runs["0"][0], atol=1e-4, rtol=1e-4)
    assert runs["1"][1] == runs["0"][1]

    monkeypatch.delenv("FUSELM_WIDE_DEQUANT")
    monkeypatch.setattr(mlx_forms, "_WIDE", {})  # as in a fresh process
    probes = []
    faster = mlx_forms._faster_form
    monkeypatch.setattr(mlx_forms, "_faster_form", lambda w, rows, dtype: probes.append((w.out_features, rows)) or
                        faster(w, rows, dtype))
    sess = Session(model, backend="mlx")
    assert "prompt matmuls" not in sess.describe()  # nothing measured before a prompt of WIDE_ROWS rows
    for _ in range(2):
        sess.reset(len(ids) + 8)
        np.testing.assert_allclose(sess.logits_to_numpy(sess.prefill(ids)), runs["0"][0], atol=1e-4, rtol=1e-4)
    assert probes and len(probes) == len(set(probes))  # once per weight shape (layers share them), not per call
    assert {rows for _, rows in probes} == {128}  # 80 rows: measured at the next power of two
    assert "prompt matmuls at 128 rows dequantized for " in sess.describe()
    measured = len(probes)
    again = Session(model, backend="mlx")  # a second session in the process: the choices made, no new probe
    again.reset(len(ids) + 8)
    again.prefill(ids)
    assert len(probes) == measured and "prompt matmuls at 128 rows" in again.describe()


def test_measured_matmul_forms_are_kept_for_the_next_process(optimized, monkeypatch, tmp_path):
    """The choices _faster_form measured are written to fuselm's cache folder (FORMS_FILE) and read by a later
    process instead of measuring again; a damaged file is measured over and rewritten."""
    from fuselm.runtime_metal.backends import mlx_forms

    monkeypatch.setenv("FUSELM_MATMUL_FORMS_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = optimized("qwen3", "q4")
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 200, 70)]

    def fresh_process():
        monkeypatch.setattr(mlx_forms, "_WIDE", {})
        monkeypatch.setattr(mlx_forms, "_STORED", None)
        sess = Session(model, backend="mlx")
        sess.reset(len(ids) + 2)
        return sess.logits_to_numpy(sess.prefill(ids))

    first = fresh_process()
    path = tmp_path / "fuselm" / "mlx" / mlx_forms.FORMS_FILE
    stored = json.loads(path.read_text())
    assert stored and set(stored.values()) <= {"quantized", "dequantize"} and all(k.endswith(" 128 rows") for k in stored)

    def no_probe(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(mlx_forms, "_faster_form", no_probe)
    np.testing.assert_array_equal(fresh_process(), first)  # the same choices, read back

    path.write_text("{not json")
    monkeypatch.setattr(mlx_forms, "_faster_form", lambda w, rows, dtype: "quantized")
    fresh_process()
    assert json.loads(path.read_text()) and set(json.loads(path.read_text()).values()) == {"quantized"}
