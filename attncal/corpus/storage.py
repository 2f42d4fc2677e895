"""Where `attncal encode` reads and writes: local paths and object-storage URIs, through `pyarrow.fs`.

A `Location` is a local path or a URI (`s3://`, `gs://`, `abfs://`, `hdfs://`, `file://`, whatever
`pyarrow.fs.FileSystem.from_uri` opens) plus the S3 endpoint override, held as plain strings: it
travels to Ray workers as it is and each process opens the filesystem itself, so every node uses its
own credential chain (environment, profile, instance role) and no secret passes through the driver.
A URI's own query options (`?region=...`) are kept for opening its filesystem.  Filesystems are
opened once per process and bucket: opening an S3 one may ask AWS for the bucket's region.

Object stores have no rename, so nothing is written in place: a file is written under a hidden
temporary name beside its final one and then moved (`FileSystem.move`: a rename on a local disk, a
server-side copy and delete on S3 and GCS), so a final name only ever holds a whole file.  What a
storage error means is said in one line (`explain`): a missing bucket, refused credentials, an
unreachable endpoint.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..messages import first_line

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BUCKET_SCHEMES = ("s3", "gs", "gcs")  # URI netloc = bucket; path inside the filesystem = bucket/key
GLOB_CHARS = "*?["
TEMP_SUFFIX = ".tmp"
CACHE_ENV = "ATTNCAL_CACHE_DIR"
# AWS SDK error codes (as pyarrow names them) that mean the request was refused for its credentials
_DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN",
           "INVALID_CLIENT_TOKEN_ID", "UNRECOGNIZED_CLIENT", "MISSING_AUTHENTICATION_TOKEN", "INVALID_SIGNATURE")


class StorageError(ValueError):
    """A location cannot be read or written (missing bucket, refused credentials, no endpoint); one line."""


def is_uri(text: str | os.PathLike) -> bool:
    return bool(_URI.match(str(text)))


def _endpoint_options(endpoint: str) -> str:
    """`endpoint_override` and `scheme` query options of an S3 URI for `endpoint` (`http://host:port`,
    or `host:port` for https)."""
    parts = urlsplit(endpoint if "://" in endpoint else "https://" + endpoint)
    if not parts.hostname or parts.scheme not in ("http", "https") or parts.path not in ("", "/"):
        raise StorageError(f"S3 endpoint {endpoint!r} is not an address like http://HOST:PORT")
    return f"endpoint_override={parts.netloc}&scheme={parts.scheme}"


def _open_filesystem(root: str, query: str, endpoint: str | None) -> "pafs.FileSystem":
    # the credentials a filesystem resolved when opened stay with it: another identity, another one
    identity = tuple(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                                                  "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_CLIENT_ID"))
    return _cached_filesystem(root, query, endpoint, identity)


@functools.lru_cache(maxsize=64)
def _cached_filesystem(root: str, query: str, endpoint: str | None, identity: tuple) -> "pafs.FileSystem":
    import pyarrow.fs as pafs

    options = [q for q in (query, _endpoint_options(endpoint) if endpoint and root.startswith("s3://") else "") if q]
    uri = root + ("?" + "&".join(options) if options else "")
    try:
        return pafs.FileSystem.from_uri(uri)[0]
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot open {root}: {first_line(exc)}") from None


@dataclass(frozen=True)
class Location:
    """A local path (absolute) or a URI (without its query), the URI's query, and the S3 endpoint."""

    url: str
    query: str = ""
    endpoint: str | None = None

    @classmethod
    def parse(cls, text: "str | os.PathLike | Location", endpoint: str | None = None) -> "Location":
        if isinstance(text, Location):
            return text if endpoint is None or text.endpoint == endpoint else cls(text.url, text.query, endpoint)
        text = os.fspath(text)
        if not is_uri(text):
            return cls(str(Path(text).expanduser().resolve()), "", endpoint)
        url, _, query = text.partition("?")
        scheme = url.split("://", 1)[0].lower()
        if scheme == "file":
            return cls(str(Path(urlsplit(url).path).resolve()), "", endpoint)
        return cls(scheme + url[len(scheme):].rstrip("/"), query, endpoint)

    @property
    def is_local(self) -> bool:
        return not is_uri(self.url)

    @property
    def scheme(self) -> str:
        return "file" if self.is_local else self.url.split("://", 1)[0]

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def bucket(self) -> str | None:
        return urlsplit(self.url).netloc if self.scheme in _BUCKET_SCHEMES else None

    def child(self, name: str) -> "Location":
        return Location(self.url.rstrip("/") + "/" + name, self.query, self.endpoint)

    def parent(self) -> "Location":
        return Location(self.url.rstrip("/").rsplit("/", 1)[0], self.query, self.endpoint)

    def __str__(self) -> str:
        return self.url

    def resolve(self) -> "tuple[pafs.FileSystem, str]":
        """(filesystem, path inside it), the filesystem opened once per process and bucket."""
        if self.is_local:
            import pyarrow.fs as pafs

            return pafs.LocalFileSystem(), self.url
        parts = urlsplit(self.url)
        if parts.scheme in _BUCKET_SCHEMES:
            fs = _open_filesystem(f"{parts.scheme}://{parts.netloc}", self.query, self.endpoint)
            return fs, (parts.netloc + parts.path).rstrip("/")
        fs = _open_filesystem(f"{parts.scheme}://{parts.netloc}", self.query, self.endpoint)
        import pyarrow.fs as pafs

        return fs, pafs.FileSystem.from_uri(self.url + ("?" + self.query if self.query else ""))[1]

    # -- reading --------------------------------------------------------------------------------

    def info(self) -> "pafs.FileInfo":
        fs, path = self.resolve()
        return fs.get_file_info(path)

    def listing(self, recursive: bool = False) -> list["pafs.FileInfo"]:
        """Entries under this directory (none when it does not exist)."""
        import pyarrow.fs as pafs

        fs, path = self.resolve()
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))

    def names(self) -> dict[str, int]:
        """{name: size} of the files directly under this directory."""
        import pyarrow.fs as pafs

        return {i.base_name: i.size for i in self.listing() if i.type == pafs.FileType.File}

    def open_input_stream(self):
        fs, path = self.resolve()
        return fs.open_input_stream(path)

    def open_input_file(self):
        fs, path = self.resolve()
        return fs.open_input_file(path)

    def read_bytes(self) -> bytes:
        with self.open_input_stream() as f:
            return f.read()

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return self.info().type != pafs.FileType.NotFound

    # -- writing --------------------------------------------------------------------------------

    def temporary(self) -> "Location":
        """A hidden name beside this one, unique to the caller, for a file that is moved here when whole."""
        return self.parent().child(f".{self.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")

    def ensure_parent(self) -> None:
        """Create the parent directory where directories exist (a local disk, HDFS); object stores
        have none to create (pyarrow would write an empty marker object)."""
        if self.scheme in _BUCKET_SCHEMES:
            return
        fs, path = self.resolve()
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)

    def open_output_stream(self):
        fs, path = self.resolve()
        return fs.open_output_stream(path)

    def move_to(self, dest: "Location") -> None:
        fs, path = self.resolve()
        fs.move(path, dest.resolve()[1])

    def write_bytes(self, data: bytes) -> None:
        """Write `data` whole under a temporary name, then move it here: a reader sees the old file or
        the new one, never a part."""
        self.ensure_parent()
        tmp = self.temporary()
        with tmp.open_output_stream() as f:
            f.write(data)
        if self.is_local:
            with open(tmp.url, "rb") as f:
                os.fsync(f.fileno())
        tmp.move_to(self)

    def delete(self) -> None:
        fs, path = self.resolve()
        fs.delete_file(path)

    def delete_contents(self) -> None:
        """Delete everything under this directory, keeping the directory.  By listing, then deleting what is
        listed: on an object store that needs the list and delete permissions only, where pyarrow's delete_file
        reads each object's head first (a Ray driver may delete the shards it may not read)."""
        fs, path = self.resolve()
        fs.delete_dir_contents(path, missing_dir_ok=True)

    def delete_dir_if_empty(self) -> None:
        """Remove a local directory this run created and left empty (object stores have none)."""
        if self.is_local and os.path.isdir(self.url) and not os.listdir(self.url):
            os.rmdir(self.url)


def expand(text: str | os.PathLike | Location, endpoint: str | None = None) -> list[tuple[Location, "pafs.FileInfo"]]:
    """The files a URI names: the file itself, the files directly under a directory (prefix), or the
    files a glob in its path matches (`*`, `?`, `[...]` within one path segment), sorted by name.
    Only listings and `get_file_info` are used: no file is opened."""
    import pyarrow.fs as pafs

    loc = Location.parse(text, endpoint)
    if any(ch in loc.url for ch in GLOB_CHARS):
        head, _, _ = loc.url.partition(next(ch for ch in loc.url if ch in GLOB_CHARS))
        base = Location(head.rsplit("/", 1)[0], loc.query, loc.endpoint)
        fs, base_path = base.resolve()
        pattern = (base_path + loc.url[len(base.url):]).split("/")
        found = [i for i in base.listing(recursive=True) if i.type == pafs.FileType.File
                 and len(i.path.split("/")) == len(pattern)
                 and all(fnmatchcase(s, p) for s, p in zip(i.path.split("/"), pattern))]
        return [(_child_of(base, base_path, i), i) for i in sorted(found, key=lambda i: i.path)]
    info = loc.info()
    if info.type == pafs.FileType.File:
        return [(loc, info)]
    if info.type == pafs.FileType.Directory:
        fs, base_path = loc.resolve()
        found = [i for i in loc.listing() if i.type == pafs.FileType.File]
        return [(_child_of(loc, base_path, i), i) for i in sorted(found, key=lambda i: i.path)]
    return []


def _child_of(base: Location, base_path: str, info: "pafs.FileInfo") -> Location:
    return Location(base.url.rstrip("/") + info.path[len(base_path.rstrip("/")):], base.query, base.endpoint)


def check_bucket(loc: Location, what: str) -> None:
    """Refuse a URI whose bucket does not exist, and surface refused credentials, before anything is
    written: pyarrow reports a missing bucket as an empty directory when listing."""
    import pyarrow.fs as pafs

    if loc.bucket is None:
        return
    fs, _ = loc.resolve()
    try:
        missing = fs.get_file_info(loc.bucket).type == pafs.FileType.NotFound
    except OSError as exc:
        raise explain(exc, what, loc) from None
    if missing:
        raise StorageError(f"{what} {loc}: bucket {loc.bucket!r} does not exist (or these credentials cannot see it)")


def explain(exc: BaseException, what: str, loc: Location | str) -> StorageError:
    """One line for a storage error: what was being done, where, and what the store said."""
    text = first_line(exc)
    m = re.search(r"AWS Error (\w+) during (\w+) operation(?:: (.*))?", text)
    if m:
        code, op, detail = m.group(1), m.group(2), re.sub(r"\s*\(Request ID: [^)]*\)", "", m.group(3) or "")
        detail = detail.strip().rstrip(".")
        if code == "NO_SUCH_BUCKET":
            bucket = loc.bucket if isinstance(loc, Location) else None
            return StorageError(f"{what} {loc}: bucket {bucket!r} does not exist")
        if code in _DENIED:
            return StorageError(f"{what} {loc}: access denied ({code} during {op}); check the credentials "
                                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role) and "
                                "the bucket's policy")
        if code == "NETWORK_CONNECTION":
            endpoint = getattr(loc, "endpoint", None) or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"
            return StorageError(f"{what} {loc}: cannot reach the storage endpoint ({endpoint}): {detail}")
        return StorageError(f"{what} {loc}: {code} during {op}" + (f": {detail}" if detail else ""))
    return StorageError(f"{what} {loc}: {text}")


# -- an export on object storage -------------------------------------------------------------------

def cache_root() -> Path:
    """Where exports fetched from object storage are kept: $ATTNCAL_CACHE_DIR, else the user cache."""
    env = os.environ.get(CACHE_ENV)
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attncal"
    return base / "exports"


def fetch_tree(loc: Location, digest: str) -> Path:
    """A local copy of the directory `loc` (an export), fetched once per machine and `digest` (the
    export's config hash, so a changed export is fetched again).  The copy is made in a temporary
    directory and renamed into place, so concurrent workers on one node never see half of it."""
    import pyarrow.fs as pafs

    dest = cache_root() / hashlib.sha256(f"{loc.url}\0{digest}".encode()).hexdigest()[:24]
    if (dest / "attncal.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
    fs, path = loc.resolve()
    try:
        pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise explain(exc, "export", loc) from None
    try:
        os.replace(tmp, dest)
    except OSError:  # another worker on this node finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
