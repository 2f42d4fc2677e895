"""The serving environment: a separate virtualenv whose Python runs Triton.

Why separate: the `tritonserver` shipped in the `nvidia-pytriton` wheel (server
2.51) runs Python models in a stub built against numpy 1, while torch in the
main environment needs numpy 2.  So `.venv-triton` (pinned by
`requirements-triton.txt`: nvidia-pytriton, numpy<2, onnxruntime, transformers;
no torch) provides the server binary and the Python the stubs run.

What the bundled server needs, found by trying it (each missing piece fails in
a confusing way, so `check_env` names it instead):

- `LD_LIBRARY_PATH` with the wheel's `nvidia_pytriton.libs` (else the stub
  hangs at model load) and the directory of the env Python's `libpython` (else
  the stub loads the system libpython and its standard library mismatches);
- the Python-backend stub for the env's Python version, from
  `pytriton/tritonserver/python_backend_stubs/<ver>/`, inside the backend
  directory given with `--backend-directory`;
- the env's `bin` first on PATH (the stub finds its Python, hence its
  site-packages, there);
- numpy < 2 in that env.

Create it with `python -m attncal.serving.env` (or `make serving-env`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("requirements-triton.txt")
ENV_VAR = "ATTNCAL_TRITON_ENV"


class ServingEnvError(RuntimeError):
    """The serving environment is missing a piece; the message says what to fix."""


def default_env_dir() -> Path:
    """$ATTNCAL_TRITON_ENV, else `.venv-triton` at the root of this source tree."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    return Path(__file__).resolve().parents[2] / ".venv-triton"


@dataclass
class ServingEnv:
    """Resolved paths of a usable serving environment."""

    root: Path
    python: Path
    python_version: str  # "3.11"
    site_packages: Path
    tritonserver: Path
    libs_dir: Path  # nvidia_pytriton.libs
    libpython_dir: Path
    stub: Path
    python_backend: Path  # the wheel's backends/python

    def backend_dir(self) -> Path:
        """A backend directory holding the Python backend *and* the stub for this Python
        (the wheel keeps them apart); built once, inside the env."""
        dest = self.root / "attncal-triton-backends"
        py = dest / "python"
        stub = py / self.stub.name
        if not stub.exists() or stub.stat().st_size != self.stub.stat().st_size:
            tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "python").mkdir(parents=True)
            for f in self.python_backend.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / "python" / f.name)
            shutil.copy2(self.stub, tmp / "python" / self.stub.name)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        return dest

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        ld = [str(self.libs_dir), str(self.libpython_dir)]
        if env.get("LD_LIBRARY_PATH"):
            ld.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(ld)
        env["PATH"] = os.pathsep.join([str(self.root / "bin"), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(self.root)
        env.pop("PYTHONHOME", None)
        env.pop("PYTHONPATH", None)  # the main env's paths would shadow numpy<2
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        return env


_PROBE = """\
import sys, sysconfig, os, importlib.metadata as md
print(f"{sys.version_info[0]}.{sys.version_info[1]}")
print(sysconfig.get_paths()["purelib"])
print(sysconfig.get_config_var("LIBDIR") or "")
print(sysconfig.get_config_var("LDLIBRARY") or "")
print(sysconfig.get_config_var("INSTSONAME") or "")
for pkg in ("numpy", "nvidia-pytriton", "onnxruntime", "transformers"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "-")
"""

_FIX = "create it with `python -m attncal.serving.env` (or `make serving-env`)"


def check_env(root: str | os.PathLike | None = None) -> ServingEnv:
    """Resolve and check the serving env; raises ServingEnvError naming the missing piece."""
    root = Path(root) if root else default_env_dir()
    python = root / "bin" / "python"
    if not python.exists():
        raise ServingEnvError(f"no serving environment at {root} ({python} missing); {_FIX}")
    try:
        probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60,
                               env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")})
    except subprocess.TimeoutExpired:
        raise ServingEnvError(f"{python} did not answer within 60 s") from None
    if probe.returncode != 0:
        raise ServingEnvError(f"{python} failed: {probe.stderr.strip().splitlines()[-1:]}")
    lines = probe.stdout.splitlines()
    ver, purelib, libdir, ldlibrary, soname = lines[:5]
    pkgs = dict(line.split(" ", 1) for line in lines[5:])
    missing = [p for p, v in pkgs.items() if v == "-"]
    if missing:
        raise ServingEnvError(f"{root} lacks {', '.join(missing)}; install them with "
                              f"{python} -m pip install -r {REQUIREMENTS}")
    if int(pkgs["numpy"].split(".")[0]) >= 2:
        raise ServingEnvError(f"{root} has numpy {pkgs['numpy']}, but the Triton 2.51 Python stub needs numpy < 2: "
                              f"{python} -m pip install 'numpy<2'")
    site = Path(purelib)
    tri = site / "pytriton" / "tritonserver"
    server = tri / "bin" / "tritonserver"
    if not server.exists():
        raise ServingEnvError(f"{server} missing: the nvidia-pytriton wheel in {root} is incomplete; reinstall it")
    stub = tri / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        have = sorted(p.name for p in (tri / "python_backend_stubs").glob("*"))
        raise ServingEnvError(f"no Python-backend stub for Python {ver} in nvidia-pytriton (it ships {have}); "
                              f"recreate {root} with one of those Python versions")
    libs = site / "nvidia_pytriton.libs"
    if not libs.is_dir():
        raise ServingEnvError(f"{libs} missing: without it the stub hangs at model load; reinstall nvidia-pytriton")
    names = [n for n in (soname, ldlibrary, f"libpython{ver}.so.1.0") if n and n.endswith((".so", ".so.1.0"))]
    if not libdir or not any((Path(libdir) / n).exists() for n in names):
        raise ServingEnvError(f"the Python of {root} has no shared libpython{ver} in {libdir or '?'} "
                              "(the stub needs one: use a Python built with --enable-shared, e.g. Debian's "
                              "python3 or pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared)")
    return ServingEnv(root=root, python=python, python_version=ver, site_packages=site, tritonserver=server,
                      libs_dir=libs, libpython_dir=Path(libdir), stub=stub, python_backend=tri / "backends" / "python")


def create_env(root: str | os.PathLike | None = None, python: str | None = None, quiet: bool = False) -> ServingEnv:
    """Create (or complete) the serving env from the pinned requirements; returns it checked."""
    root = Path(root) if root else default_env_dir()
    python = python or sys.executable
    t0 = time.monotonic()
    if not (root / "bin" / "python").exists():
        # Base the env on the interpreter behind `python` (a venv's own python is fine too).
        subprocess.run([python, "-m", "venv", str(root)], check=True)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run(pip + (["-q"] if quiet else []) + ["-r", str(REQUIREMENTS)], check=True)
    env = check_env(root)
    if not quiet:
        print(f"serving env ready at {root} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return env


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Create the Triton serving environment (.venv-triton).")
    ap.add_argument("--env", default=None, help=f"where (default ${ENV_VAR} or .venv-triton)")
    ap.add_argument("--python", default=None, help="base interpreter (default: this one)")
    ap.add_argument("--check", action="store_true", help="only check an existing env")
    a = ap.parse_args()
    try:
        e = check_env(a.env) if a.check else create_env(a.env, a.python)
    except ServingEnvError as exc:
        print(f"attncal serving env: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"ok: {e.root} (Python {e.python_version}, tritonserver {e.tritonserver})")
