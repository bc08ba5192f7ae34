"""Training images as the client gathers them before uploading anything: a folder, a zip file,
or a zip at an HTTPS URL, with `name.txt` captions beside the images.

Everything is checked here, before a single byte is uploaded: the folder exists, the zip is a
zip with safe names (no absolute paths, no "..": a zip-slip cannot reach outside the prefix)
and bounded sizes, and every image decodes. A bad input is an `InvalidArgument` naming the
flag and the file. Files that are neither images (by suffix) nor `.txt` captions, such as a
`notes.pdf` beside the photos, are skipped, never uploaded: pass `skipped=[]` to learn which
(the CLI prints them). Hidden files and macOS resource forks are left out without a word.
"""

from __future__ import annotations

import io
import ipaddress
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import aiohttp

from lorafleet.core.errors import InvalidArgument, StorageError
from lorafleet.core.spec_checks import check_path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_SUFFIX = ".txt"
# The scheduler signs at most this many upload URLs per request.
MAX_FILES = 1_000
# Bounds on a zip (compressed download and uncompressed content) and on one image.
MAX_ZIP_BYTES = 1 << 30
MAX_UNCOMPRESSED_BYTES = 2 << 30
MAX_FILE_BYTES = 64 << 20
MAX_CAPTION_BYTES = 64 << 10
# Pixels of one image (PIL's own decompression-bomb limit is about this).
MAX_IMAGE_PIXELS = 89_478_485


@dataclass(frozen=True)
class TrainingFile:
    """One file to upload: its name under the prefix and its bytes."""

    name: str
    data: bytes


def _is_training_name(name: str) -> bool:
    return PurePosixPath(name).suffix.lower() in (*IMAGE_SUFFIXES, CAPTION_SUFFIX)


def _check_files(field: str, files: list[TrainingFile], source: str) -> list[TrainingFile]:
    images = [f for f in files if PurePosixPath(f.name).suffix.lower() in IMAGE_SUFFIXES]
    if not images:
        raise InvalidArgument(
            field, f"no images in {source} (looked for {', '.join(IMAGE_SUFFIXES)})"
        )
    if len(files) > MAX_FILES:
        raise InvalidArgument(field, f"{source} holds {len(files)} files; at most {MAX_FILES}")
    for f in files:
        check_path(field, f.name)
        if f.name.lower().endswith(CAPTION_SUFFIX):
            if len(f.data) > MAX_CAPTION_BYTES:
                raise InvalidArgument(field, f"{f.name}: a caption over {MAX_CAPTION_BYTES} bytes")
            try:
                f.data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgument(field, f"{f.name}: a caption that is not UTF-8") from None
        else:
            check_image(field, f)
    return files


def check_image(field: str, file: TrainingFile) -> None:
    """Decodes the image completely; a file that is not one is refused by name."""
    from PIL import Image

    if len(file.data) > MAX_FILE_BYTES:
        raise InvalidArgument(field, f"{file.name}: over {MAX_FILE_BYTES >> 20} MiB")
    try:
        with Image.open(io.BytesIO(file.data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidArgument(field, f"{file.name}: {width}x{height} is too many pixels")
            image.load()
    except InvalidArgument:
        raise
    except Exception as exc:  # PIL raises many kinds for a file that is not an image
        raise InvalidArgument(field, f"{file.name}: not a readable image ({_why(exc)})") from None


def _why(exc: Exception) -> str:
    """PIL's reason for a file it cannot decode, in words a user can act on: its own messages
    name the in-memory buffer (`cannot identify image file <_io.BytesIO object at 0x...>`),
    which says nothing about the user's file."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "its contents are not in any image format PIL knows"
    text = str(exc).split(" <_io.", 1)[0].strip().rstrip(":") or type(exc).__name__
    return text[:200]


def read_folder(
    directory: str | Path, *, field: str = "images", skipped: list[str] | None = None
) -> list[TrainingFile]:
    """The images and captions directly in a folder, checked. The names of other files (not
    hidden ones) are appended to `skipped` when it is given."""
    root = Path(directory)
    if not root.exists():
        raise InvalidArgument(field, f"no such folder: {root}")
    if not root.is_dir():
        raise InvalidArgument(field, f"{root} is not a folder (use --images-zip for a zip file)")
    entries = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    files = [TrainingFile(p.name, p.read_bytes()) for p in entries if _is_training_name(p.name)]
    if skipped is not None:
        skipped.extend(p.name for p in entries if not _is_training_name(p.name))
    return _check_files(field, files, str(root))


def read_zip(
    source: str | Path | bytes,
    *,
    field: str = "images_zip",
    name: str | None = None,
    skipped: list[str] | None = None,
) -> list[TrainingFile]:
    """The images and captions inside a zip (any folder depth; names flattened to the file
    name, so `rex/1.png` and `rex/1.txt` stay side by side), checked. The names of other
    members (not hidden ones, not macOS resource forks) are appended to `skipped` when given."""
    label = name or (str(source) if not isinstance(source, bytes) else "the zip")
    if not isinstance(source, bytes):
        path = Path(source)
        if not path.is_file():
            raise InvalidArgument(field, f"no such file: {path}")
        if path.stat().st_size > MAX_ZIP_BYTES:
            raise InvalidArgument(field, f"{path} is over {MAX_ZIP_BYTES >> 20} MiB")
    try:
        archive = zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (zipfile.BadZipFile, OSError) as exc:
        raise InvalidArgument(field, f"{label} is not a zip file ({exc})") from None
    files: list[TrainingFile] = []
    seen: set[str] = set()
    total = 0
    with archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            member = PurePosixPath(info.filename.replace("\\", "/"))
            if member.is_absolute() or ".." in member.parts or ":" in info.filename:
                raise InvalidArgument(field, f"{label}: unsafe name {info.filename!r}")
            if member.parts[0] == "__MACOSX" or member.name.startswith("."):
                continue  # macOS resource forks and hidden files
            if not _is_training_name(member.name):
                if skipped is not None:
                    skipped.append(info.filename)
                continue
            if member.name in seen:
                raise InvalidArgument(
                    field, f"{label}: two files named {member.name!r} in different folders"
                )
            seen.add(member.name)
            if info.file_size > MAX_FILE_BYTES:
                raise InvalidArgument(field, f"{label}: {info.filename} is too large")
            total += info.file_size
            if total > MAX_UNCOMPRESSED_BYTES:
                raise InvalidArgument(
                    field, f"{label} unpacks to over {MAX_UNCOMPRESSED_BYTES >> 20} MiB"
                )
            try:
                with archive.open(info) as stream:
                    # Read one byte past the declared size: a lying header cannot inflate more.
                    data = stream.read(info.file_size + 1)
            except (zipfile.BadZipFile, OSError, RuntimeError) as exc:
                raise InvalidArgument(field, f"{label}: {info.filename}: {exc}") from None
            if len(data) > info.file_size:
                raise InvalidArgument(field, f"{label}: {info.filename} is larger than declared")
            files.append(TrainingFile(member.name, data))
    return _check_files(field, files, label)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def fetch_zip(
    url: str,
    *,
    field: str = "images_url",
    timeout_s: float = 600.0,
    max_bytes: int = MAX_ZIP_BYTES,
    allow_http_loopback: bool = False,
) -> bytes:
    """Downloads a zip over HTTPS (bounded). Plain http is refused, except to a loopback
    address with `allow_http_loopback` (tests)."""
    parts = urlsplit(url)
    insecure_ok = allow_http_loopback and parts.scheme == "http" and _loopback(parts.hostname or "")
    if parts.scheme != "https" and not insecure_ok:
        raise InvalidArgument(field, f"must be an https:// URL (got {url!r})")
    if not parts.hostname:
        raise InvalidArgument(field, f"no host in {url!r}")
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(url) as response,
        ):
            if response.status != 200:
                raise InvalidArgument(field, f"{url} answered HTTP {response.status}")
            if (response.content_length or 0) > max_bytes:
                raise InvalidArgument(field, f"{url} is over {max_bytes >> 20} MiB")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise InvalidArgument(field, f"{url} is over {max_bytes >> 20} MiB")
                chunks.append(chunk)
    except aiohttp.ClientError as exc:
        raise StorageError(f"{field}: download of {url} failed: {exc}", retryable=True) from None
    except TimeoutError:
        raise StorageError(f"{field}: download of {url} timed out", retryable=True) from None
    return b"".join(chunks)
