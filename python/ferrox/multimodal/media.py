"""Where an image comes from: a PIL image, raw bytes, a data: URL, an http(s) URL or a local file.

vLLM's rules, so a vLLM client's requests work unchanged: http(s) fetches time out after
VLLM_IMAGE_FETCH_TIMEOUT seconds (default 5) and refuse bodies over `max_bytes`; a data: URL must be
base64; a local file (file:// URL or plain path) is read only from inside the folder that
--allowed-local-media-path names, after symlinks and `..` are resolved. `load_image` serves the
offline API (synchronous, urllib); `fetch_image` serves the server (aiohttp, never blocks the event
loop on a download or a decode).

Images keep their mode here (RGBA, L, P...): turning them into RGB belongs to the image processor,
which follows the model's preprocessor_config.json (multimodal/image_processor.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias, TypeVar

from PIL import Image

from ferrox.errors import InvalidArgumentError

T = TypeVar("T")

TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_TIMEOUT_S = 5.0
MAX_IMAGE_BYTES = 20 * 2**20
_CHUNK = 64 * 2**10

ImageSource: TypeAlias = Image.Image | bytes | str | os.PathLike[str]


class MediaError(InvalidArgumentError):
    """An image that cannot be had: unreadable URL, refused path, too large, not decodable.

    A ValueError (through InvalidArgumentError, so the server answers 400); the message says what is
    wrong, and the caller prefixes the request field (`messages[0].content[1].image_url.url`)."""


# vLLM's --allowed-media-domains: the only hosts http(s) media may come from (None: any). Set once per
# process from the engine config (`allow_media_domains`); redirects are then not followed, so a listed
# host cannot hand the fetch to another.
_allowed_domains: frozenset[str] | None = None


def allow_media_domains(domains: list[str] | None) -> None:
    global _allowed_domains
    _allowed_domains = None if domains is None else frozenset(d.lower() for d in domains)


def _check_domain(url: str) -> None:
    if _allowed_domains is None:
        return
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in _allowed_domains:
        raise MediaError(f"{url}: the host {host!r} is not in --allowed-media-domains "
                         f"({', '.join(sorted(_allowed_domains))})")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise MediaError(f"fetching {req.full_url} answered a redirect ({code} to {newurl}), which is not followed "
                         "under --allowed-media-domains")


def image_fetch_timeout() -> float:
    """Seconds an http(s) image fetch may take: $VLLM_IMAGE_FETCH_TIMEOUT, else 5 (vLLM's default)."""
    return fetch_timeout(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def fetch_timeout(env: str, default: float) -> float:
    """Seconds from the environment variable `env` (vLLM's VLLM_*_FETCH_TIMEOUT), else `default`."""
    value = os.environ.get(env, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidArgumentError(f"{env} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise InvalidArgumentError(f"{env} must be > 0, got {value!r}")
    return seconds


def load_image(source: ImageSource, *, allowed_local_media_path: str | None = None,
               timeout: float | None = None, max_bytes: int = MAX_IMAGE_BYTES) -> Image.Image:
    """The decoded image of `source` (offline API; blocks). `timeout` None reads image_fetch_timeout()."""
    if isinstance(source, Image.Image):
        return _loaded(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source))
    if isinstance(source, os.PathLike):
        return decode_image(_read_local(os.fspath(source), allowed_local_media_path))
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image, bytes, a URL or a path, got {type(source).__name__}")
    scheme = _scheme(source)
    if scheme in ("http", "https"):
        return decode_image(_download(source, timeout if timeout is not None else image_fetch_timeout(), max_bytes))
    if scheme == "data":
        return decode_image(decode_data_url(source))
    return decode_image(_read_local(_local_path(source, scheme), allowed_local_media_path))


async def fetch_image(url: str, *, allowed_local_media_path: str | None = None,
                      timeout: float | None = None, max_bytes: int = MAX_IMAGE_BYTES) -> Image.Image:
    """The decoded image at `url` (server): load_image's rules, with the download on aiohttp and
    file reads and decodes on a worker thread, so the event loop keeps serving other requests."""
    if not isinstance(url, str):
        raise MediaError(f"an image URL must be a string, got {type(url).__name__}")
    scheme = _scheme(url)
    if scheme == "data":
        # A large JPEG takes tens of milliseconds to decode: off the event loop like the rest.
        return await asyncio.to_thread(lambda: decode_image(decode_data_url(url)))
    if scheme in ("http", "https"):
        data = await _download_async(url, timeout if timeout is not None else image_fetch_timeout(), max_bytes)
        return await asyncio.to_thread(decode_image, data)
    path = _local_path(url, scheme)
    return await asyncio.to_thread(lambda: decode_image(_read_local(path, allowed_local_media_path)))


def read_media_url(url: str, *, what: str, env: str, timeout: float, max_bytes: int,
                   allowed_local_media_path: str | None) -> bytes:
    """The bytes a video's or audio clip's URL names (blocks): http(s) downloaded against one `timeout` deadline (env:
    the variable that sets it, for the error), a data: URL decoded, a file read from inside
    allowed_local_media_path; each at most max_bytes."""
    scheme = _scheme(url)
    if scheme in ("http", "https"):
        return _download(url, timeout, max_bytes, what=what, env=env)
    data = (decode_data_url(url) if scheme == "data"
            else _read_local(_local_path(url, scheme, what), allowed_local_media_path))
    return capped(data, max_bytes, what)


def capped(data: bytes, max_bytes: int, what: str) -> bytes:
    """`data`, refused when over max_bytes (a file or data URL the caller passed, as a download is refused)."""
    if len(data) > max_bytes:
        raise MediaError(f"the {what} is larger than {max_bytes} bytes")
    return data


async def fetch_media_url(url: str, decode: Callable[[bytes], T], *, what: str, env: str, timeout: float,
                          max_bytes: int, allowed_local_media_path: str | None) -> T:
    """read_media_url's bytes decoded (server): the download on aiohttp, file reads and the decode on a worker thread,
    so the event loop keeps serving other requests."""
    if _scheme(url) in ("http", "https"):
        data = await _download_async(url, timeout, max_bytes, what=what, env=env)
        return await asyncio.to_thread(decode, data)
    return await asyncio.to_thread(lambda: decode(read_media_url(
        url, what=what, env=env, timeout=timeout, max_bytes=max_bytes,
        allowed_local_media_path=allowed_local_media_path)))


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:<type>;base64,<payload>` URL (vLLM takes base64 data URLs only)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("a data URL needs a ',' before its payload (data:image/png;base64,...)")
    if not header.lower().endswith(";base64"):
        raise MediaError(f"a data URL must be base64 (data:image/png;base64,...), got {header[:64]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL's payload is not valid base64: {e}") from None


def decode_image(data: bytes) -> Image.Image:
    """A fully decoded PIL image from encoded bytes (PNG, JPEG, WebP, GIF...), in its own mode."""
    try:
        # EPS is left out: PIL decodes it by running Ghostscript on the file, not something to do
        # with bytes from a request.
        return _loaded(Image.open(io.BytesIO(data), formats=_decodable_formats()))
    except MediaError:
        raise
    except Exception as e:  # PIL's decoders raise OSError, SyntaxError, ValueError, struct.error...
        raise MediaError(f"not a decodable image: {e}") from None


def image_hash(image: Image.Image) -> str:
    """sha256 hex of what the pixels are: mode, size, raw pixel bytes, and the palette and
    transparency a P or L image needs to mean colours. Equal images hash equal wherever they came
    from; the hash keeps prefix-cache blocks of different images apart (multimodal/inputs.py)."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}\x00{image.size[0]}x{image.size[1]}\x00".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette is not None:
        digest.update(b"palette\x00" + bytes(palette))
    if image.info.get("transparency") is not None:
        digest.update(f"transparency\x00{image.info['transparency']!r}\x00".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _decodable_formats() -> list[str]:
    Image.init()
    return [name for name in Image.ID if name != "EPS"]


def _loaded(image: Image.Image) -> Image.Image:
    try:
        image.load()
    except Exception as e:  # a truncated file opens, then fails here
        raise MediaError(f"not a decodable image: {e}") from None
    return image


def _scheme(url: str) -> str:
    """The URL's scheme, lower case; '' for a plain path. One letter is a Windows drive, not a scheme."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if ":" in url else ""
    return "" if len(scheme) == 1 else scheme


def _local_path(url: str, scheme: str, what: str = "image") -> str:
    if scheme == "":
        return url
    if scheme != "file":
        raise MediaError(f"unsupported {what} URL scheme {scheme!r}: use http(s)://, data:, or file://")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file:// URL must name a file on this machine, got host {parts.netloc!r}")
    return urllib.request.url2pathname(parts.path)


def _read_local(path: str, allowed_local_media_path: str | None) -> bytes:
    """The file's bytes, if it lies inside `allowed_local_media_path` once symlinks and `..` resolve."""
    if allowed_local_media_path is None:
        raise MediaError("local files need --allowed-local-media-path (the folder images may be read from)")
    root = Path(allowed_local_media_path).resolve()
    if not root.is_dir():
        raise MediaError(f"--allowed-local-media-path {allowed_local_media_path!r} is not a folder")
    target = Path(path).resolve()
    if not target.is_relative_to(root):
        raise MediaError(f"{path!r} is outside --allowed-local-media-path {str(root)!r}")
    try:
        return target.read_bytes()  # the resolved path: what was checked is what is read
    except OSError as e:
        raise MediaError(f"cannot read {path!r}: {e.strerror or e}") from None


def _download(url: str, timeout: float, max_bytes: int, what: str = "image", env: str = TIMEOUT_ENV) -> bytes:
    """The body at `url`, read in chunks against one deadline (urllib's timeout is per socket read,
    so a server dripping bytes would otherwise hold the caller far past it)."""
    _check_domain(url)
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "ferrox"})
    opener = urllib.request.build_opener(_NoRedirect) if _allowed_domains is not None else urllib.request.build_opener()
    try:
        with opener.open(request, timeout=timeout) as response:
            _check_length(url, response.headers.get("Content-Length"), max_bytes, what)
            body = bytearray()
            while chunk := response.read(_CHUNK):
                body += chunk
                if len(body) > max_bytes:
                    raise MediaError(f"the {what} at {url} is larger than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError
            return bytes(body)
    except urllib.error.HTTPError as e:
        raise MediaError(f"fetching {url} failed: HTTP {e.code} {e.reason}") from None
    except (TimeoutError, OSError) as e:  # URLError is an OSError; socket timeouts arrive wrapped or bare
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise MediaError(f"fetching {url} timed out after {timeout:g} s ({env})") from None
        raise MediaError(f"fetching {url} failed: {getattr(e, 'reason', e)}") from None


async def _download_async(url: str, timeout: float, max_bytes: int, what: str = "image",
                          env: str = TIMEOUT_ENV) -> bytes:
    import aiohttp  # the server's dependency; the offline API never needs it

    _check_domain(url)
    follow = _allowed_domains is None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), trust_env=True) as session:
            async with session.get(url, headers={"User-Agent": "ferrox"}, allow_redirects=follow) as response:
                if not follow and 300 <= response.status < 400:
                    raise MediaError(f"fetching {url} answered a redirect ({response.status} to "
                                     f"{response.headers.get('Location')}), which is not followed under "
                                     "--allowed-media-domains")
                if response.status >= 400:
                    raise MediaError(f"fetching {url} failed: HTTP {response.status} {response.reason}")
                _check_length(url, response.headers.get("Content-Length"), max_bytes, what)
                body = bytearray()
                async for chunk in response.content.iter_chunked(_CHUNK):
                    body += chunk
                    if len(body) > max_bytes:
                        raise MediaError(f"the {what} at {url} is larger than {max_bytes} bytes")
                return bytes(body)
    except asyncio.TimeoutError:
        raise MediaError(f"fetching {url} timed out after {timeout:g} s ({env})") from None
    except aiohttp.ClientError as e:
        raise MediaError(f"fetching {url} failed: {e}") from None


def _check_length(url: str, header: str | None, max_bytes: int, what: str = "image") -> None:
    """Refuse early when the server announces a body over the cap (the read still counts bytes)."""
    if header is not None and header.isdigit() and int(header) > max_bytes:
        raise MediaError(f"the {what} at {url} is larger than {max_bytes} bytes (Content-Length {header})")
