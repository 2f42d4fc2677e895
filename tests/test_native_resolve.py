"""oplib.resolve_library: the on-by-default policy for the native ORT library
(enabled flag, $ATTNCAL_NATIVE, fallback notice once per process).  No build
needed: the library location is pointed at temporary files."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from attncal.runtime import oplib
from support.hooks import wait_until


@pytest.fixture()
def built(tmp_path, monkeypatch) -> Path:
    lib = tmp_path / oplib.ORT_LIBRARY
    lib.write_bytes(b"not really a library")
    monkeypatch.delenv("ATTNCAL_ORT_LIBRARY", raising=False)
    monkeypatch.delenv(oplib.NATIVE_ENV, raising=False)
    monkeypatch.setenv("ATTNCAL_PLUGIN_BUILD_DIR", str(tmp_path))
    return lib


@pytest.fixture()
def not_built(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("ATTNCAL_ORT_LIBRARY", raising=False)
    monkeypatch.delenv(oplib.NATIVE_ENV, raising=False)
    monkeypatch.setenv("ATTNCAL_PLUGIN_BUILD_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(oplib, "_fallback_said", False)
    return tmp_path / "empty" / oplib.ORT_LIBRARY


def test_default_uses_built_library(built):
    assert oplib.NATIVE_ENV == "ATTNCAL_NATIVE"
    assert oplib.resolve_library() == built
    assert oplib.resolve_library(True) == built
    assert oplib.resolve_library(False) is None


def _watch_shared_locks(monkeypatch) -> threading.Event:
    """An event set when oplib asks for a build's lock shared (its flock, seen through a wrapper)."""
    asking = threading.Event()

    def flock(fd, op):
        if op == fcntl.LOCK_SH:
            asking.set()
        return fcntl.flock(fd, op)

    monkeypatch.setattr(oplib, "fcntl", SimpleNamespace(flock=flock, LOCK_SH=fcntl.LOCK_SH, LOCK_EX=fcntl.LOCK_EX,
                                                         LOCK_UN=fcntl.LOCK_UN))
    return asking


def test_a_library_being_built_is_handed_out_only_when_the_build_ends(built, monkeypatch):
    """A parallel worker that resolves the library while another builds it waits for the build's lock: the
    linker writes the library in place, and one loaded mid-link has an invalid ELF header.  The resolver is
    let go only once it has asked for the lock (its shared flock, seen through a wrapper), so the check that
    it got nothing while the build ran does not depend on how soon the thread is scheduled."""
    asking = _watch_shared_locks(monkeypatch)
    got = []
    with oplib._locked(built.parent):  # a build of that directory is running
        t = threading.Thread(target=lambda: got.append(oplib.resolve_library()))
        t.start()
        wait_until(lambda: asking.is_set() or got, 60, "the resolver to ask for the build's lock, or return")
        assert asking.is_set() and not got, "resolved while the build was running"
    t.join(timeout=60)
    assert got == [built]


def test_a_library_missing_while_it_is_rebuilt_is_waited_for(built, monkeypatch):
    """The linker writes the library anew, so during another worker's rebuild it is missing: the resolver waits
    for the build's lock and then finds it, instead of falling back for good (an Encoder picking the split graph
    because a test on the other worker was relinking the library)."""
    asking = _watch_shared_locks(monkeypatch)
    got = []
    with oplib._locked(built.parent):  # the rebuild: the library is gone until it ends
        built.unlink()
        t = threading.Thread(target=lambda: got.append(oplib.resolve_library(notice=False)))
        t.start()
        wait_until(lambda: asking.is_set() or got, 60, "the resolver to ask for the build's lock, or return")
        assert asking.is_set() and not got, "resolved while the build was running"
        built.write_bytes(b"relinked")
    t.join(timeout=60)
    assert got == [built]


@pytest.mark.parametrize("value", ["0", "off", "false", "OFF", " False "])
def test_env_turns_it_off(built, monkeypatch, value):
    monkeypatch.setenv(oplib.NATIVE_ENV, value)
    assert oplib.resolve_library() is None
    assert oplib.resolve_library(True) == built  # an explicit request wins over the env


@pytest.mark.parametrize("value", ["1", "on", ""])
def test_env_other_values_keep_it_on(built, monkeypatch, value):
    monkeypatch.setenv(oplib.NATIVE_ENV, value)
    assert oplib.resolve_library() == built


def test_not_built_falls_back_and_says_so_once(not_built, capsys):
    assert oplib.resolve_library() is None
    assert oplib.resolve_library() is None
    err = capsys.readouterr().err
    assert err.count(oplib.FALLBACK_MESSAGE) == 1, err
    assert "make plugins" in err and "function body" in err


def test_not_built_disabled_is_silent(not_built, capsys, monkeypatch):
    assert oplib.resolve_library(False) is None
    monkeypatch.setenv(oplib.NATIVE_ENV, "0")
    assert oplib.resolve_library() is None
    assert capsys.readouterr().err == ""


def test_not_built_but_required_raises_with_path(not_built):
    with pytest.raises(FileNotFoundError, match=str(not_built)):
        oplib.resolve_library(True)


def test_explicit_library_env(tmp_path, monkeypatch, not_built):
    lib = tmp_path / "custom.so"
    monkeypatch.setenv("ATTNCAL_ORT_LIBRARY", str(lib))
    with pytest.raises(FileNotFoundError, match="custom.so"):
        oplib.resolve_library(True)
    lib.write_bytes(b"x")
    assert oplib.resolve_library() == lib


def _header_set(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "NvInferRuntime.h").write_text("// stand-in\n")
    return path


def test_tensorrt_headers_one_setting(tmp_path, monkeypatch):
    """$ATTNCAL_TENSORRT_HEADERS: unset -> None (tests skip); an include dir, its parent, or a root
    of <version>/include sets; a wrong path or a missing version is an error naming it."""
    monkeypatch.delenv(oplib.TENSORRT_HEADERS_ENV, raising=False)
    assert oplib.tensorrt_headers() is None and oplib.tensorrt_headers("10.5.0") is None
    inc = _header_set(tmp_path / "one" / "include")
    monkeypatch.setenv(oplib.TENSORRT_HEADERS_ENV, str(inc))
    assert oplib.tensorrt_headers() == inc
    monkeypatch.setenv(oplib.TENSORRT_HEADERS_ENV, str(inc.parent))
    assert oplib.tensorrt_headers() == inc
    root = tmp_path / "sets"
    old, new = _header_set(root / "10.5.0" / "include"), _header_set(root / "11.1" / "include")
    (root / "9.0").mkdir()  # not a header set: ignored
    monkeypatch.setenv(oplib.TENSORRT_HEADERS_ENV, str(root))
    assert oplib.tensorrt_headers() == new  # the newest, by version and not by string order
    assert oplib.tensorrt_headers("10.5.0") == old
    with pytest.raises(FileNotFoundError, match=r"no TensorRT 10\.6 headers .*found 10\.5\.0, 11\.1"):
        oplib.tensorrt_headers("10.6")
    monkeypatch.setenv(oplib.TENSORRT_HEADERS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="ATTNCAL_TENSORRT_HEADERS=.*nowhere: no NvInferRuntime.h"):
        oplib.tensorrt_headers()
    assert "ATTNCAL_TENSORRT_HEADERS" in oplib.TENSORRT_HEADERS_HELP


def test_package_library_comes_before_the_checkout_build(built, tmp_path, monkeypatch):
    """A platform wheel's attncal/lib wins over a source checkout's build/plugins; get_library_path and its
    siblings name both places when neither has the library."""
    import attncal
    from attncal import native

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    monkeypatch.setattr(native, "PACKAGE_LIB_DIR", pkg)
    assert oplib.resolve_library() == built and attncal.get_library_path() == str(built)
    (pkg / oplib.ORT_LIBRARY).write_bytes(b"packaged")
    (pkg / oplib.CUDA_LIBRARY).write_bytes(b"packaged")
    assert oplib.resolve_library() == pkg / oplib.ORT_LIBRARY
    assert attncal.get_library_path() == str(pkg / oplib.ORT_LIBRARY)
    assert attncal.get_cuda_library_path() == str(pkg / oplib.CUDA_LIBRARY)
    assert oplib.build_info() is None  # the packaged folder has no attncal_build.json here
    with pytest.raises(FileNotFoundError, match=r"TensorRT plugin \(libattncal_trt_plugin\.so\) is not installed: "
                                                r"it is neither in the package .*pkg\) nor in a source checkout's build"):
        attncal.get_tensorrt_plugin_path()
    (pkg / oplib.ORT_LIBRARY).unlink()
    built.unlink()
    with pytest.raises(FileNotFoundError, match=r"ONNX Runtime custom-op library .* with `pip install .`"):
        attncal.get_library_path()


def test_build_library_needs_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(oplib, "PLUGINS_DIR", tmp_path / "plugins")
    with pytest.raises(oplib.BuildError, match="building needs a source checkout"):
        oplib.build_library(tmp_path / "b")
