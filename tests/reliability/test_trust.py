"""Trust: fuselm never runs code from its inputs and never reaches the network.

- The source of the package (fuselm/, exporter/, passes/, runtime_metal/) has no unpickling call, and
  every transformers `from_pretrained` is offline, says trust_remote_code=False (transformers would
  otherwise *prompt* a user to run a checkpoint's code) and, for models, reads safetensors only.
- A checkpoint or reference with only pickle weights is refused without the file being opened; a
  pickle that would leave a marker file if it were ever unpickled proves it.
- Every command (convert --check, optimize, diff, run --chat, validate) runs under a guard that
  refuses and records network connections, opens of pickle files and unpickling, with the fork
  server started *without* HF_HUB_OFFLINE: what keeps fuselm offline is its own code. (Every other
  reliability test runs under the same guard too.)
- Chat templates render in transformers' jinja2 sandbox: templates that reach for Python internals,
  files or huge loops are refused with exit 2, and the code they try never runs; a tokenizer or a
  reference whose config asks for remote code is refused or loaded without it.
"""

from __future__ import annotations

import ast
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ["fuselm", "exporter", "passes", "runtime_metal"]
FORBIDDEN = {
    r"\btorch\.load\(": "torch.load unpickles",
    r"\bpickle\.(load|loads|Unpickler)\b": "unpickling",
    r"\b(cPickle|dill|joblib|cloudpickle)\b": "a pickle library",
    r"allow_pickle\s*=\s*True": "numpy unpickling",
    r"\bmarshal\.loads?\(": "unmarshalling code",
    r"trust_remote_code\s*=\s*(?!False\b)": "remote code from a checkpoint (only trust_remote_code=False)",
    r"\bweights_only\s*=\s*False": "torch.load without its restrictions",
}


def _sources() -> list[Path]:
    return sorted(p for d in PACKAGE for p in (ROOT / d).rglob("*.py"))


def _from_pretrained_calls(path: Path) -> list[tuple[str, dict]]:
    """(receiver, {keyword: constant}) for every `X.from_pretrained(...)` call in a source file."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
            receiver = ast.unparse(node.func.value)
            calls.append((receiver, {k.arg: getattr(k.value, "value", None) for k in node.keywords}))
    return calls


def test_no_unpickling_and_no_remote_code_in_the_source():
    sources = _sources()
    assert len(sources) > 30 and any(p.name == "weights.py" for p in sources)
    hits = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {why}"
            for p in sources for text in [p.read_text()] for pattern, why in FORBIDDEN.items()
            for m in re.finditer(pattern, text)]
    assert not hits, hits


def test_every_from_pretrained_is_offline_and_safetensors_only():
    calls = [(p, receiver, kw) for p in _sources() for receiver, kw in _from_pretrained_calls(p)]
    assert len(calls) >= 4, calls  # check, validate, the tokenizer, torch_export
    bad = [f"{p.relative_to(ROOT)}: {receiver}.from_pretrained" for p, receiver, kw in calls
           if kw.get("local_files_only") is not True or kw.get("trust_remote_code") is not False
           or ("Model" in receiver and kw.get("use_safetensors") is not True and "gguf_file" not in kw)]  # GGUF: no pickle
    assert not bad, bad


def _evil_pickle(marker: Path) -> bytes:
    """Bytes that create `marker` when unpickled (never when merely refused)."""
    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))
    return pickle.dumps(Evil())


def _checkpoint_with_pickle(make_ckpt, tmp_path: Path, index: bool) -> Path:
    hf = shutil.copytree(make_ckpt("qwen3"), tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_bytes(_evil_pickle(tmp_path / "UNPICKLED"))
    if index:
        (hf / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model.bin"}}))
    return hf


@pytest.mark.parametrize("index", [False, True])
def test_pickle_only_checkpoint_is_refused_unread(index, make_ckpt, sandbox, tally, tmp_path):
    hf = _checkpoint_with_pickle(make_ckpt, tmp_path, index)
    answer = sandbox.run(["convert", hf, "-o", tmp_path / "out", "--check"])  # the guard refuses opening *.bin
    ok = answer["rc"] == 2 and "pickle weights (pytorch_model.bin)" in answer["stderr"] and \
        "never unpickles" in answer["stderr"] and not (tmp_path / "UNPICKLED").exists() and \
        not (tmp_path / "out").exists()
    assert tally.record("malformed", "pickle-only checkpoint", ok), answer["stderr"]


def test_pickle_only_reference_is_refused_unread(make_ckpt, exported, sandbox, tally, tmp_path):
    hf = _checkpoint_with_pickle(make_ckpt, tmp_path, index=False)
    answer = sandbox.run(["validate", exported("qwen3"), "--reference", hf, "--tokens", "2"])
    ok = answer["rc"] == 2 and "model.safetensors" in answer["stderr"] and not (tmp_path / "UNPICKLED").exists()
    assert tally.record("malformed", "pickle-only reference", ok), answer["stderr"]


def test_every_command_runs_without_network(make_ckpt, sandbox, tmp_path):
    """Under the guard, from a server without HF_HUB_OFFLINE: the whole tool chain, Python API too."""
    hf = make_ckpt("llama")
    exported, optimized = tmp_path / "exported", tmp_path / "optimized"
    commands = [
        ["convert", hf, "-o", exported, "--quant", "q4", "--check"],
        ["optimize", exported, "-o", optimized],
        ["diff", exported, "--json", tmp_path / "diff.json", "--html", tmp_path / "diff.html"],
        ["run", optimized, "--prompt", "hello world", "--chat", "--max-tokens", "3"],
        ["validate", optimized, "--reference", hf, "--tokens", "3"],
    ]
    for argv in commands:
        answer = sandbox.run(argv, timeout=300)  # the guard fails this test on any connection
        assert answer["rc"] == 0, (argv[0], answer["stderr"][-500:])
        assert answer["events"] is not None
    api = sandbox.run(python=f"fuselm.validate({str(optimized)!r}, {str(hf)!r}, tokens=2, quiet=True)",
                      env={"HF_HUB_OFFLINE": "0"}, timeout=300)
    assert api["rc"] == 0, api["stderr"][-500:]


EVIL_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', '{marker}']) }}{% endif %}{% endfor %}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os.system('touch {marker}') }}",
    "{{ self.__init__.__globals__ }}",
    "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "{{ raise_exception('refused by the template itself') }}",
]


@pytest.mark.parametrize("template", EVIL_TEMPLATES, ids=range(len(EVIL_TEMPLATES)))
def test_chat_templates_render_in_the_sandbox(template, exported, sandbox, tally, tmp_path):
    model = shutil.copytree(exported("qwen3"), tmp_path / "model")
    marker = tmp_path / "TEMPLATE_RAN_CODE"
    (model / "chat_template.jinja").write_text(template.replace("{marker}", str(marker)))
    answer = sandbox.run(["run", model, "--prompt", "hi", "--chat", "--max-tokens", "2"], timeout=120)
    ok = answer["rc"] == 2 and "chat template" in answer["stderr"] and "Traceback" not in answer["stderr"] \
        and not marker.exists()
    assert tally.record("malformed", "chat template (unsafe)", ok), answer["stderr"][-400:]


def test_remote_code_is_never_run(make_ckpt, exported, sandbox, tally, tmp_path):
    """A tokenizer config and a reference config.json that point at Python files in the directory."""
    marker = tmp_path / "REMOTE_CODE_RAN"
    code = f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
    model = shutil.copytree(exported("qwen3"), tmp_path / "model")
    (model / "evil_tok.py").write_text(code + "class EvilTokenizer: pass\n")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}, tokenizer_class="EvilTokenizer")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    run = sandbox.run(["run", model, "--prompt", "hi", "--max-tokens", "2"], timeout=120)

    hf = shutil.copytree(make_ckpt("qwen3"), tmp_path / "hf")
    (hf / "evil_model.py").write_text(code + "class EvilModel: pass\n")
    config = json.loads((hf / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil_model.EvilModel", "AutoModelForCausalLM": "evil_model.EvilModel"}
    (hf / "config.json").write_text(json.dumps(config))
    validate = sandbox.run(["validate", exported("qwen3"), "--reference", hf, "--tokens", "2"], timeout=120)
    convert = sandbox.run(["convert", hf, "-o", tmp_path / "out", "--check"], timeout=120)
    ok = run["rc"] == 2 and "trust_remote_code" in run["stderr"] and validate["rc"] in (0, 2) \
        and convert["rc"] in (0, 2) and not marker.exists() \
        and all("Traceback" not in a["stderr"] for a in (run, validate, convert))
    assert tally.record("malformed", "remote code in a checkpoint", ok), \
        (run["stderr"][-300:], validate["stderr"][-300:], convert["stderr"][-300:])
