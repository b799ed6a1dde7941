"""Image references of dataset rows: where they point, whether they can be read, and decoding.

A reference is a local path (absolute, or relative to the data file's folder, then to the
working directory), a `file://` URL, an `http(s)://` URL (downloaded once into the swiftlm
cache), a `data:image/...;base64,` URL or bare base64 (ms-swift accepts both). Checking a
reference verifies the file (`PIL.Image.verify`, which reads every PNG chunk) and decodes the
pixels of other formats (JPEG at 1/8 scale), so a row whose image is missing, corrupt,
truncated or of an unsupported format is named before training with the other bad rows; the
full pixels are decoded when the sample is encoded (`load_image`), and a decoding failure
there is named the same way. Nothing is ever replaced by another image.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import hashlib
import io
import os
from pathlib import Path

from swiftlm.data.rows import RowError

# What PIL decodes that vision processors take (RGB conversion is done on load).
SUPPORTED_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "MPO")
URL_SCHEMES = ("http://", "https://")
# Largest image downloaded from an http(s) URL (photos are a few MiB).
MAX_DOWNLOAD_BYTES = 32 << 20

# The folder of the data file whose rows are being read (set by data.loading).
_data_folder: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "data_folder", default=None
)


@contextlib.contextmanager
def relative_to(folder: Path | None):
    """Resolve relative image paths of the rows read inside this block against `folder`."""
    token = _data_folder.set(folder)
    try:
        yield
    finally:
        _data_folder.reset(token)


def _image_error(message: str) -> RowError:
    return RowError("bad image", message)


def resolve_image(reference: str, where: str) -> str:
    """A checked, self-contained form of `reference`: an absolute path, or the data URL of
    inline base64. Raises RowError naming `where` (e.g. "image 2") when it cannot be read."""
    if reference.startswith("data:"):
        _check_bytes(_data_url_bytes(reference, where), where, "inline image")
        return reference
    if reference.startswith(URL_SCHEMES):
        path = _downloaded(reference, where)
    else:
        path = _local_path(reference, where)
        if path is None:
            inline = _bare_base64(reference)
            if inline is None:
                raise _image_error(f"{where} {_short(reference)} does not exist; {_where_paths()}")
            _check_bytes(inline, where, "inline base64 image")
            return "data:image;base64," + reference
    _check_bytes(path.read_bytes(), where, str(path))
    return str(path)


def load_image(reference: str, max_pixels: int = 0):
    """Decode a reference made by `resolve_image` into an RGB PIL image, scaled down (aspect
    kept) to at most `max_pixels` pixels when that is set (--max_pixels)."""
    from PIL import Image

    data = _data_url_bytes(reference, "image") if reference.startswith("data:") else None
    with Image.open(io.BytesIO(data) if data is not None else reference) as image:
        image.load()
        image = image.convert("RGB")
    width, height = image.size
    if max_pixels and width * height > max_pixels:
        scale = (max_pixels / (width * height)) ** 0.5
        size = (max(1, int(width * scale)), max(1, int(height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image


def _local_path(reference: str, where: str) -> Path | None:
    text = reference[len("file://") :] if reference.startswith("file://") else reference
    path = Path(text).expanduser()
    candidates = [path] if path.is_absolute() else [*_folders(path), Path.cwd() / path]
    for candidate in candidates:
        try:
            if candidate.is_file():
                return candidate.resolve()
            if candidate.exists():
                raise _image_error(f"{where} {_short(reference)} is not a file")
        except OSError:  # a name the file system refuses (too long: bare base64), no path
            continue
    return None


def _folders(path: Path) -> list[Path]:
    folder = _data_folder.get()
    return [folder / path] if folder is not None else []


def _where_paths() -> str:
    folder = _data_folder.get()
    place = f"the data file's folder ({folder}) or " if folder is not None else ""
    return f"relative paths are looked up in {place}the working directory ({Path.cwd()})"


def _short(reference: str) -> str:
    return repr(reference if len(reference) <= 120 else reference[:117] + "...")


def _data_url_bytes(reference: str, where: str) -> bytes:
    header, _, payload = reference.partition(",")
    if not header.endswith(";base64") or not payload:
        raise _image_error(
            f"{where} is a data URL without base64 content; write data:image/png;base64,..."
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _image_error(f"{where} has invalid base64 in its data URL ({exc})") from None


def _bare_base64(reference: str) -> bytes | None:
    """The bytes of a bare base64 image (long, no file extension, decodes), else None."""
    if len(reference) < 64 or "." in reference[-6:]:
        return None
    try:
        data = base64.b64decode(reference, validate=True)
    except (binascii.Error, ValueError):
        return None
    # A leading "/" is an absolute path, unless it is a JPEG's base64 ("/9j/": FF D8 FF).
    if reference.startswith("/") and not data.startswith(b"\xff\xd8"):
        return None
    return data


def _check_bytes(data: bytes, where: str, name: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
            image.verify()
        if kind != "PNG":  # verify() reads every PNG chunk, but little of the other formats
            _decode_small(data)
    except UnidentifiedImageError:
        raise _image_error(
            f"{where} ({name}) is not an image PIL can read; give a {', '.join(SUPPORTED_FORMATS[:5])} file"
        ) from None
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for damaged files
        raise _image_error(f"{where} ({name}) is damaged: {exc}") from None
    if kind not in SUPPORTED_FORMATS:
        raise _image_error(
            f"{where} ({name}) is a {kind} image, which vision processors do not take; convert it "
            f"to PNG or JPEG"
        )


def _decode_small(data: bytes) -> None:
    """Decode an image's pixels to find truncated or damaged data (verify() passes a JPEG cut
    in half); a JPEG is decoded at 1/8 scale, which still reads every coded block."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.draft("RGB", (1, 1))
        image.load()


def _downloaded(url: str, where: str) -> Path:
    """The cached copy of an http(s) image, downloaded once."""
    from swiftlm.models.loader import cache_root

    target = cache_root() / "images" / hashlib.sha256(url.encode()).hexdigest()[:32]
    if target.is_file():
        return target
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - user's data
            data = response.read(MAX_DOWNLOAD_BYTES + 1)
    except OSError as exc:
        raise _image_error(
            f"{where} {_short(url)} could not be downloaded ({exc}); download it and give its path"
        ) from None
    if len(data) > MAX_DOWNLOAD_BYTES:  # a server fetches URLs its clients send: bound them
        raise _image_error(
            f"{where} {_short(url)} is larger than {MAX_DOWNLOAD_BYTES >> 20} MiB; give a "
            "smaller image"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    partial.write_bytes(data)
    partial.rename(target)
    return target
