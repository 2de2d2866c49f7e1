"""A `fuselm split` output run by `mlx.launch` over MLX's ring backend, one stage per process on this
machine (MLX's CPU backend): the greedy tokens equal the single-process run on the unsplit graph."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
from fuselm.runtime_metal.pipeline_launch import cause, loopback_ports

import fuselm
from fuselm import contract
from fuselm.errors import FuselmError

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available():
    pytest.skip("this MLX build has no distributed backend", allow_module_level=True)

PROMPT = [5, 6, 7, 40, 41, 42, 9, 300, 12, 77]
TOKENS = 6
# One process per rank runs every case (startup is most of the time): fuselm.run on each split, its
# result written per rank; the last case goes through the command line, whose last rank prints the ids.
DRIVER = textwrap.dedent("""
    import json, os, sys
    import fuselm
    from fuselm.cli import main
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    rank = os.environ["MLX_RANK"]
    for i, (path, kw) in enumerate(cases[:-1]):
        r = fuselm.run(path, quiet=True, stream=open(os.devnull, "w"), **kw)
        json.dump(r, open(os.path.join(out, f"{i}-rank{rank}.json"), "w"))
    sys.exit(main(cases[-1]))
""")


def free_ports(n: int) -> int:
    """A base port with n free ports after it, for mlx.launch's -p (it gives rank r the port base + r;
    fuselm's launcher and a hostfile take any n ports: pipeline_launch.loopback_ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launch(n: int, *command, timeout: float = 120) -> subprocess.CompletedProcess:
    """`mlx.launch -n N --backend ring -- python COMMAND...` on this machine."""
    launcher = "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", launcher, "-n", str(n), "--backend", "ring", "-p", str(free_ports(n)),
                           "--", sys.executable, *command], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def models(optimized, tmp_path_factory):
    """Untied 4-layer models (a tied random model just repeats the prompt's last token), f32 and q4, copied
    without tokenizer files so `fuselm run` prints token ids; each split into 2 and 3 stages."""
    root = tmp_path_factory.mktemp("pipe")
    out = {}
    for quant in ("f32", "q4"):
        src = optimized("qwen3", quant, num_hidden_layers=4, tie_word_embeddings=False)
        plain = root / quant
        plain.mkdir()
        for name in (contract.MODEL_NAME, contract.DATA_NAME, contract.META_NAME):
            shutil.copy(src / name, plain / name)
        out[quant] = plain
        for n in (2, 3):
            fuselm.split(plain, root / f"{quant}-{n}", stages=n, quiet=True)
    # the same f32 model whose generation_config names a token of its greedy run (not the first) as eos:
    # every rank must stop there
    eos = root / "eos"
    shutil.copytree(out["f32"], eos)
    tokens = single(out["f32"])
    stop = next(t for t in tokens if t != tokens[0])
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    out["eos"] = eos
    for n in (2, 3):
        fuselm.split(eos, root / f"eos-{n}", stages=n, quiet=True)
    return root, out


def single(path, **kw) -> list[int]:
    kw = {"ignore_eos": True, **kw}
    return fuselm.run(path, prompt=PROMPT, max_tokens=TOKENS, backend="mlx", device="cpu", quiet=True,
                      stream=open(os.devnull, "w"), **kw)["tokens"]


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_tokens_equal_single_process(models, tmp_path, n):
    root, plain = models
    base = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "device": "cpu", "pipe_timeout": 60}
    cases = [(str(root / f"f32-{n}"), base),
             (str(root / f"q4-{n}"), {**base, "prefill_chunk": 4}),  # 3 chunks, overlapping across stages
             (str(root / f"f32-{n}"), {**base, "temperature": 1.0, "seed": 3}),
             (str(root / f"eos-{n}"), {**base, "ignore_eos": False})]
    cli = ["run", str(root / f"q4-{n}"), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(TOKENS),
           "--ignore-eos", "--device", "cpu"]
    p = launch(n, "-c", DRIVER, str(tmp_path), json.dumps([*cases, cli]))
    assert "error" not in p.stderr.lower(), p.stderr[-3000:]
    got = [json.loads((tmp_path / f"{i}-rank{n - 1}.json").read_text())["tokens"] for i in range(len(cases))]
    want = [single(plain["f32"]), single(plain["q4"]), single(plain["f32"], temperature=1.0, seed=3),
            single(plain["eos"], ignore_eos=False)]
    assert got == want
    assert 1 < len(want[3]) < TOKENS  # stopped at eos, on every rank (else the launch would not have ended)
    assert len(set(sum(want, []))) > 3  # the tokens vary: equality says something
    assert p.stdout.split() == [str(t) for t in want[1]]  # the last rank streamed the CLI run's ids
    for r in range(n - 1):  # the other ranks generate nothing themselves
        assert json.loads((tmp_path / f"0-rank{r}.json").read_text())["tokens"] == []


def test_wrong_process_count(models, tmp_path):
    root, _ = models
    p = launch(3, "-m", "fuselm.cli", "run", str(root / "f32-2"), "--prompt-ids", "5,6", "--device", "cpu",
               "--pipe-timeout", "20")
    assert "lists 3 ranks but the model is split into 2 stages" in p.stderr
    with pytest.raises(FuselmError, match="is stage 1 of the split"):
        fuselm.run(root / "f32-2" / "stage1", prompt=[5], quiet=True)


def test_no_launcher_starts_the_ranks_itself(models, tmp_path, monkeypatch):
    """`fuselm.run(SPLIT)` in a process no launcher started runs one local rank per stage
    (runtime_metal/pipeline_launch.py): the last rank's tokens stream through, equal to the unsplit
    run (with the doorbells, whatever this host's core count); a rank that fails ends the others and
    its error is the caller's."""
    import io

    root, plain = models
    monkeypatch.setenv("FUSELM_PIPE_BELLS", "on")
    stream = io.StringIO()
    r = fuselm.run(root / "q4-3", prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, device="cpu",
                   prefill_chunk=4, quiet=True, stream=stream)
    assert r["tokens"] == single(plain["q4"])
    assert stream.getvalue().split() == [str(t) for t in r["tokens"]]
    assert len(r["ranks"]) == 3 and all(m["mlx_peak_bytes"] > 0 for m in r["ranks"])
    shutil.copytree(root / "f32-2", tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "stage1")
    with pytest.raises(FuselmError, match=r"^rank 1: .*stage1 is missing"):
        fuselm.run(tmp_path / "broken", prompt=[5], device="cpu", quiet=True, pipe_timeout=20)


def test_the_rank_that_went_is_blamed_not_its_peer():
    """Rank 1 fails (its stage is missing) and rank 0 then loses its connection: whichever watcher woke first,
    rank 1's own error is the one reported; a rank ended with no error file falls back to the first seen."""
    lost = {"error": "rank 0: the connection to rank 1 broke", "peer_lost": True}
    own = {"error": "rank 1: stage1 is missing", "peer_lost": False}
    assert cause([lost, own, None], first=0) == 1
    assert cause([lost, own, None], first=1) == 1
    assert cause([None, lost, None], first=2) == 2


def test_missing_peer_times_out_with_a_message(models, tmp_path):
    """Rank 0 of 2 started alone (a hostfile naming a peer that never comes): a clear error, not a hang; a
    hostfile that is no JSON, or lists the wrong number of ranks: exit 2 at once."""
    root, _ = models
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in loopback_ports(2)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": "0", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "fuselm.cli", "run", str(root / "f32-2"), "--prompt-ids", "5",
                        "--device", "cpu", "--pipe-timeout", "3"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == -9  # the watchdog ends the blocked rank (SIGKILL)
    assert "rank 0:" in p.stderr and "did not come within 3 s" in p.stderr
    for text, message in (("not json", "mx.distributed.init failed"), (json.dumps([["127.0.0.1:1"]]), "lists 1 ranks")):
        hostfile.write_text(text)
        p = subprocess.run([sys.executable, "-m", "fuselm.cli", "run", str(root / "f32-2"), "--prompt-ids", "5",
                            "--device", "cpu", "--pipe-timeout", "3"], capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 2 and message in p.stderr, p.stderr[-500:]


def test_stages_of_different_splits_are_refused(models, tmp_path):
    """stage0 of one split with stage1 of another: the handshake names the mismatch before any work."""
    root, plain = models
    fuselm.split(plain["f32"], tmp_path / "a", layers="0-0,1-3", quiet=True)
    fuselm.split(plain["f32"], tmp_path / "b", layers="0-2,3-3", quiet=True)
    shutil.rmtree(tmp_path / "a" / "stage1")
    shutil.copytree(tmp_path / "b" / "stage1", tmp_path / "a" / "stage1")
    p = launch(2, "-m", "fuselm.cli", "run", str(tmp_path / "a"), "--prompt-ids", "5,6", "--device", "cpu",
               "--pipe-timeout", "20")
    assert "rank 1: rank 0 runs a stage that does not fit: last layer 0 (expected 2)" in p.stderr, p.stderr[-2000:]


def test_doorbells_only_where_ranks_outnumber_the_cores(tmp_path, monkeypatch):
    """Bells.open's rule: all ranks on one host and more busy processes (ranks, + mlx.launch's spinning
    launcher unless fuselm started them) than cores; ranks on several hosts never; the switch overrides."""
    from fuselm.runtime_metal import pipeline_run
    from fuselm.runtime_metal.pipeline_launch import LAUNCHED

    def opened(hosts, cores, launched=False, switch=None):
        (tmp_path / "h.json").write_text(json.dumps([[f"{h}:1"] for h in hosts]))
        monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "h.json"))
        monkeypatch.setattr(pipeline_run.os, "cpu_count", lambda: cores)
        for name, value in ((LAUNCHED, "1" if launched else None), ("FUSELM_PIPE_BELLS", switch)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        bells = pipeline_run.Bells.open(0, len(hosts))
        if bells is not None:
            bells.listener.close()
        return bells is not None

    local2 = ["127.0.0.1"] * 2
    assert not opened(local2, cores=2, launched=True)  # a core per rank: MLX's poll
    assert opened(local2, cores=2)  # mlx.launch's launcher takes one of them
    assert opened(["127.0.0.1"] * 3, cores=2, launched=True)
    assert not opened(local2, cores=16)
    assert not opened(["127.0.0.1", "127.0.0.2"], cores=1)  # two hosts: each decides alike only by the hostfile
    assert opened(local2, cores=16, switch="on") and not opened(local2, cores=1, switch="off")
