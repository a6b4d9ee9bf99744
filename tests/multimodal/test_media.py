"""Image sources (multimodal/media.py): data URLs, local files inside --allowed-local-media-path only,
http(s) against a local aiohttp server (both the offline urllib path and the server's aiohttp path),
the size cap and the timeout, and the pixel hash."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from ferrox.errors import InvalidArgumentError
from ferrox.multimodal.media import (
    MediaError,
    allow_media_domains,
    decode_image,
    fetch_image,
    image_fetch_timeout,
    image_hash,
    load_image,
)
from PIL import Image


def _image(mode: str = "RGB", size: tuple[int, int] = (6, 4), seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()


# -- data URLs, bytes, PIL images -------------------------------------------------------------------

def test_png_data_url_keeps_mode_and_pixels():
    for mode in ("RGB", "RGBA", "L"):
        image = _image(mode)
        assert _same_pixels(load_image(_data_url(_encoded(image))), image)


def test_jpeg_data_url_decodes():
    image = _image(size=(16, 8))
    loaded = load_image(_data_url(_encoded(image, "JPEG"), "image/jpeg"))
    assert (loaded.mode, loaded.size, loaded.format) == ("RGB", (16, 8), "JPEG")
    assert _same_pixels(loaded, Image.open(io.BytesIO(_encoded(image, "JPEG"))))


def test_bytes_and_pil_image_sources():
    image = _image()
    assert _same_pixels(load_image(_encoded(image)), image)
    assert load_image(image) is image


def test_bad_base64_is_a_media_error():
    with pytest.raises(MediaError, match="not valid base64"):
        load_image("data:image/png;base64,iVBOR*w0KGgo=")
    with pytest.raises(MediaError, match="must be base64"):
        load_image("data:image/png,rawbytes")
    with pytest.raises(MediaError, match="','"):
        load_image("data:image/png;base64")


def test_corrupt_and_truncated_images_are_media_errors():
    with pytest.raises(MediaError, match="not a decodable image"):
        load_image(_data_url(b"definitely not an image"))
    with pytest.raises(MediaError, match="not a decodable image"):
        decode_image(_encoded(_image(size=(64, 64)))[:60])


def test_media_error_is_a_bad_request():
    assert issubclass(MediaError, InvalidArgumentError) and issubclass(MediaError, ValueError)


def test_unknown_scheme_is_named():
    with pytest.raises(MediaError, match="'ftp'"):
        load_image("ftp://example.com/cat.png")
    with pytest.raises(MediaError, match="'s3'"):
        asyncio.run(fetch_image("s3://bucket/cat.png"))


def test_fetch_image_takes_data_urls():
    image = _image()
    assert _same_pixels(asyncio.run(fetch_image(_data_url(_encoded(image)))), image)


# -- local files ------------------------------------------------------------------------------------

@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "cat.png").write_bytes(_encoded(_image()))
    (tmp_path / "secret.png").write_bytes(_encoded(_image(seed=1)))
    return allowed


def test_local_file_inside_the_allowed_folder(media_dir: Path):
    path = media_dir / "sub" / "cat.png"
    for source in (str(path), path, path.as_uri(), f"file://localhost{path}"):
        assert _same_pixels(load_image(source, allowed_local_media_path=str(media_dir)), _image())
    got = asyncio.run(fetch_image(path.as_uri(), allowed_local_media_path=str(media_dir)))
    assert _same_pixels(got, _image())


def test_local_files_need_the_flag(media_dir: Path):
    path = media_dir / "sub" / "cat.png"
    for source in (str(path), path.as_uri()):
        with pytest.raises(MediaError, match="local files need --allowed-local-media-path"):
            load_image(source)
    with pytest.raises(MediaError, match="local files need --allowed-local-media-path"):
        asyncio.run(fetch_image(path.as_uri()))


def test_local_file_outside_the_allowed_folder_is_refused(media_dir: Path):
    secret = media_dir.parent / "secret.png"
    escapes = [str(secret), secret.as_uri(), str(media_dir / "sub" / ".." / ".." / "secret.png"),
               f"file://{media_dir}/../secret.png"]
    for source in escapes:
        with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
            load_image(source, allowed_local_media_path=str(media_dir))
    with pytest.raises(MediaError, match="outside"):
        asyncio.run(fetch_image(secret.as_uri(), allowed_local_media_path=str(media_dir)))


def test_symlink_out_of_the_allowed_folder_is_refused(media_dir: Path):
    link = media_dir / "innocent.png"
    os.symlink(media_dir.parent / "secret.png", link)
    with pytest.raises(MediaError, match="outside"):
        load_image(str(link), allowed_local_media_path=str(media_dir))
    # A symlinked allowed folder itself is fine: the check compares resolved paths.
    alias = media_dir.parent / "alias"
    os.symlink(media_dir, alias)
    assert load_image(str(alias / "sub" / "cat.png"), allowed_local_media_path=str(alias)).size == (6, 4)


def test_missing_local_file_and_bad_host(media_dir: Path):
    with pytest.raises(MediaError, match="cannot read"):
        load_image(str(media_dir / "nope.png"), allowed_local_media_path=str(media_dir))
    with pytest.raises(MediaError, match="host 'example.com'"):
        load_image("file://example.com/etc/passwd", allowed_local_media_path=str(media_dir))


# -- http(s) ----------------------------------------------------------------------------------------

PNG = _encoded(_image(size=(8, 5)))


async def _png(_: web.Request) -> web.Response:
    return web.Response(body=PNG, content_type="image/png")


async def _big(_: web.Request) -> web.Response:
    return web.Response(body=b"\x89PNG" + bytes(4096), content_type="image/png")


async def _big_chunked(request: web.Request) -> web.StreamResponse:
    """No Content-Length: the cap must hold while reading."""
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    for _ in range(8):
        await response.write(bytes(1024))
    return response


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(2)
    return web.Response(body=PNG, content_type="image/png")


async def _missing(_: web.Request) -> web.Response:
    return web.Response(status=404, text="no such image")


async def _redirect(_: web.Request) -> web.Response:
    raise web.HTTPFound("/cat.png")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """An aiohttp server on 127.0.0.1 (a random port) in a thread of its own, so both the synchronous
    load_image and an asyncio.run(fetch_image(...)) in the test's thread can reach it."""
    app = web.Application()
    app.add_routes([web.get("/cat.png", _png), web.get("/big", _big), web.get("/big-chunked", _big_chunked),
                    web.get("/slow", _slow), web.get("/missing", _missing),
                    web.get("/redirect", _redirect)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def _both(url: str, **kwargs) -> list[Image.Image]:
    """The image through load_image (urllib) and through fetch_image (aiohttp)."""
    return [load_image(url, **kwargs), asyncio.run(fetch_image(url, **kwargs))]


def test_http_image(server: str):
    for got in _both(f"{server}/cat.png"):
        assert _same_pixels(got, Image.open(io.BytesIO(PNG)))


def test_http_size_cap(server: str):
    for path in ("/big", "/big-chunked"):
        with pytest.raises(MediaError, match="larger than 1000 bytes"):
            load_image(f"{server}{path}", max_bytes=1000)
        with pytest.raises(MediaError, match="larger than 1000 bytes"):
            asyncio.run(fetch_image(f"{server}{path}", max_bytes=1000))
    assert all(got.size == (8, 5) for got in _both(f"{server}/cat.png", max_bytes=len(PNG)))


def test_http_timeout(server: str):
    with pytest.raises(MediaError, match="timed out after 0.2 s"):
        load_image(f"{server}/slow", timeout=0.2)
    with pytest.raises(MediaError, match="timed out after 0.2 s"):
        asyncio.run(fetch_image(f"{server}/slow", timeout=0.2))


def test_http_timeout_default_from_vllm_env(server: str, monkeypatch: pytest.MonkeyPatch):
    assert image_fetch_timeout() == 5.0
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.25")
    assert image_fetch_timeout() == 0.25
    with pytest.raises(MediaError, match="timed out after 0.25 s"):
        asyncio.run(fetch_image(f"{server}/slow"))
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(InvalidArgumentError, match="VLLM_IMAGE_FETCH_TIMEOUT"):
        image_fetch_timeout()


def test_http_errors(server: str):
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/missing")
    with pytest.raises(MediaError, match="HTTP 404"):
        asyncio.run(fetch_image(f"{server}/missing"))
    unused = f"http://127.0.0.1:{_free_port()}/cat.png"
    with pytest.raises(MediaError, match="fetching .* failed"):
        load_image(unused)
    with pytest.raises(MediaError, match="fetching .* failed"):
        asyncio.run(fetch_image(unused))


def test_allowed_media_domains(server: str):
    """vLLM's --allowed-media-domains: only the listed hosts, and no redirects then (a listed host could hand
    the fetch anywhere); without a list a redirect is followed."""
    assert all(got.size == (8, 5) for got in _both(f"{server}/redirect"))
    try:
        allow_media_domains(["127.0.0.1"])
        assert all(got.size == (8, 5) for got in _both(f"{server}/cat.png"))
        with pytest.raises(MediaError, match="redirect .* not followed under --allowed-media-domains"):
            load_image(f"{server}/redirect")
        with pytest.raises(MediaError, match="redirect .* not followed under --allowed-media-domains"):
            asyncio.run(fetch_image(f"{server}/redirect"))
        allow_media_domains(["images.example.com"])
        for fetch in (load_image, lambda url: asyncio.run(fetch_image(url))):
            with pytest.raises(MediaError, match="host '127.0.0.1' is not in --allowed-media-domains"):
                fetch(f"{server}/cat.png")
    finally:
        allow_media_domains(None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- image_hash -------------------------------------------------------------------------------------

def test_image_hash_follows_the_pixels():
    image = _image(size=(16, 16))
    assert image_hash(image) == image_hash(load_image(_data_url(_encoded(image))))  # same pixels, new object
    other = image.copy()
    other.putpixel((3, 3), tuple((c + 1) % 256 for c in image.getpixel((3, 3))))
    assert image_hash(other) != image_hash(image)
    assert image_hash(image.convert("RGBA")) != image_hash(image)  # mode
    flat = Image.new("RGB", (4, 8))
    assert image_hash(flat) != image_hash(Image.new("RGB", (8, 4)))  # same bytes, other size
    assert len(image_hash(image)) == 64 and int(image_hash(image), 16) >= 0


def test_image_hash_sees_the_palette():
    indices = Image.new("P", (4, 4))
    red, blue = indices.copy(), indices.copy()
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)
    assert red.tobytes() == blue.tobytes() and image_hash(red) != image_hash(blue)
