"""Installed versions of the libraries attncal depends on, against the ranges it declares and the releases
whose internals it copies.

The tested ranges are read from one place, attncal's installed package metadata (the `dependencies` and
extras of pyproject.toml), so `attncal doctor` reports what the package promises.  Code that reproduces
another library's internals (the int8 quantizer, the fp16 converter's patch, the optimizer's stages) names the
release it was written for and calls `warn_if_not_mirrored`: with another release installed it says so once,
in one line, since the copied behaviour may have changed.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
import warnings
from typing import Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "attncal"


class MirroredVersionWarning(UserWarning):
    """The installed library is not the release whose internals attncal copies."""


def installed(package: str) -> str | None:
    """The installed version of distribution `package`, or None."""
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def declared_ranges() -> dict[str, str]:
    """Each dependency attncal declares (extras included) -> its version range ("" for any), from the installed
    package metadata; the first declaration of a name wins (its extras repeat it, e.g. attncal[export])."""
    out: dict[str, str] = {}
    for text in md.requires(DISTRIBUTION) or []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if name != DISTRIBUTION:
            out.setdefault(name, str(req.specifier))
    return out


def in_range(version: str | None, spec: str | None) -> bool | None:
    """Whether `version` satisfies the range `spec`; None when either is unknown."""
    if version is None or spec is None:
        return None
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return None


def release(version: str) -> tuple[int, ...]:
    """major.minor of a version string ("1.32.0+cpu" -> (1, 32))."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def warn_if_not_mirrored(package: str, mirrored: str, what: str) -> None:
    """One MirroredVersionWarning when the installed `package`'s major.minor differs from `mirrored`, the
    release whose internals `what` copies."""
    version = installed(package)
    if version is not None and release(version) != release(mirrored):
        warnings.warn(f"{what} of {package} {mirrored}; {package} {version} is installed, whose internals may "
                      "differ (results unverified with it)", MirroredVersionWarning, stacklevel=3)


def library_versions(packages: Iterable[str], *, python: bool = False,
                     omit_missing: bool = False) -> dict[str, str | None]:
    """The installed version of each of `packages` (None where it is not installed, or left out with
    `omit_missing`), after Python's own with `python`: what a result or an export records to be reproduced."""
    out: dict[str, str | None] = {"python": platform.python_version()} if python else {}
    for pkg in packages:
        version = installed(pkg)
        if version is not None or not omit_missing:
            out[pkg] = version
    return out


def without_torch_advice() -> None:
    """No "PyTorch was not found" advice from transformers where torch is absent on purpose (the runtime install):
    its tokenizers need none, and only an environment variable turns that advisory warning off."""
    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
