"""Bad input to `fuselm run` / `fuselm validate`: a clear message, exit 2, no traceback."""

import os
import shutil
import subprocess
import sys

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from fuselm import cli


@pytest.fixture
def model_copy(exported, tmp_path):
    """A private copy of the exported f32 qwen3 model directory (tests edit it)."""
    dst = tmp_path / "model"
    shutil.copytree(exported("qwen3", "f32"), dst)
    return dst


def _run(capsys, *args) -> tuple[int, str]:
    rc = cli.main(["run", *map(str, args), "--prompt-ids", "1,2,3", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def _set_location(model_dir, location: str) -> None:
    m = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(m, str(model_dir / "model.onnx"))


def test_external_data_outside_the_directory_is_refused(model_copy, tmp_path, capsys):
    outside = tmp_path / "outside.data"
    shutil.copyfile(model_copy / "model.onnx.data", outside)
    for location in (str(outside), "../outside.data"):
        _set_location(model_copy, location)
        rc, err = _run(capsys, model_copy)
        assert rc == 2 and "leaves the model directory" in err, err


def test_external_data_symlink_outside_is_refused(model_copy, tmp_path, capsys):
    outside = tmp_path / "elsewhere" / "model.onnx.data"
    outside.parent.mkdir()
    shutil.move(model_copy / "model.onnx.data", outside)
    os.symlink(outside, model_copy / "model.onnx.data")
    rc, err = _run(capsys, model_copy)
    assert rc == 2 and "outside the model directory" in err, err


def test_missing_data_file(model_copy, capsys):
    (model_copy / "model.onnx.data").unlink()
    rc, err = _run(capsys, model_copy)
    assert rc == 2 and "is missing" in err and "model.onnx.data" in err, err


def test_truncated_data_file(model_copy, capsys):
    data = model_copy / "model.onnx.data"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    rc, err = _run(capsys, model_copy)
    assert rc == 2 and "truncated" in err, err


def test_graph_without_the_contract_io(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(path))
    rc, err = _run(capsys, path)
    assert rc == 2 and "graph contract" in err and "input_ids" in err and "logits" in err, err


def test_unknown_op_names_op_node_and_opset(model_copy, capsys):
    m = onnx.load(str(model_copy / "model.onnx"), load_external_data=False)
    node = next(n for n in m.graph.node if n.op_type == "Sigmoid")
    node.op_type, node.domain = "FancySigmoid", "com.example"
    m.opset_import.append(helper.make_opsetid("com.example", 3))
    onnx.save(m, str(model_copy / "model.onnx"))
    rc, err = _run(capsys, model_copy)
    assert rc == 2, err
    assert "com.example::FancySigmoid" in err and node.name in err and "opset 3" in err, err


def test_not_a_model(tmp_path, capsys):
    rc, err = _run(capsys, tmp_path)
    assert rc == 2 and "model.onnx" in err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    rc, err = _run(capsys, bad)
    assert rc == 2 and "not a readable ONNX model" in err


def test_validate_bad_reference_and_backend(exported, tmp_path, capsys):
    rc = cli.main(["validate", str(exported("qwen3", "f32")), "--reference", str(tmp_path)])
    assert rc == 2 and "not a HF checkpoint" in capsys.readouterr().err
    if not torch.cuda.is_available():
        rc = cli.main(["run", str(exported("qwen3", "f32")), "--prompt-ids", "1", "--device", "cuda"])
        assert rc == 2 and "CUDA" in capsys.readouterr().err


def test_cli_subprocess_exit_code(model_copy):
    """The installed entry point: exit 2, one line on stderr, no traceback."""
    (model_copy / "model.onnx.data").unlink()
    r = subprocess.run([sys.executable, "-m", "fuselm.cli", "run", str(model_copy), "--prompt-ids", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is missing" in r.stderr


def test_prompt_ids_outside_the_vocabulary(exported, capsys):
    rc = cli.main(["run", str(exported("qwen3", "f32")), "--prompt-ids", "1,99999"])
    assert rc == 2 and "prompt ids must lie in" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_attention_3d_checks_its_head_counts(backend):
    """Attention-23's 3-D form (what the AttentionTo3D pass writes): head counts that do not split
    the widths into one head size are a clear error, not a reshape the backend fails at."""
    import numpy as np
    from fuselm.runtime_metal.backends import make_backend
    from fuselm.runtime_metal.ops_nn import _attention

    from fuselm.errors import FuselmError

    b = make_backend(backend, "cpu")
    rng = np.random.default_rng(0)
    q, k = (b.asarray(rng.standard_normal((1, 3, w)).astype(np.float32)) for w in (32, 16))
    y, *_ = _attention(b, q, k, k, q_num_heads=4, kv_num_heads=2, _n_outputs=1)
    assert tuple(b.shape(y)) == (1, 3, 32)
    for heads in ((3, 1), (4, 3), (2, 2), (0, 2)):
        with pytest.raises(FuselmError, match="do not split its 3-D inputs"):
            _attention(b, q, k, k, q_num_heads=heads[0], kv_num_heads=heads[1], _n_outputs=1)
