"""Media inputs: reading and checking image/video references, and the OpenAI part mapping."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from pathlib import Path

import pytest
from PIL import Image
from support import free_port

from mlx_server.errors import InvalidRequest
from mlx_server.models.media import MediaLimits, collect_media, decode_image, is_video_container
from mlx_server.models.media_read import read_bytes
from mlx_server.protocols.openai.chat.adapter import to_chat_request
from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest

LIMITS = MediaLimits()


def png(w: int = 32, h: int = 24, color=(200, 30, 30), fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def one_image(ref: str, limits: MediaLimits = LIMITS, **extra):
    messages = [{"role": "user", "content": [{"type": "image", "image": ref, **extra}]}]
    return collect_media(messages, limits)


def bad(ref: str, limits: MediaLimits = LIMITS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        one_image(ref, limits)
    assert e.value.param == "messages[0].content[0]"
    assert e.value.message.startswith("messages[0].content[0]")
    return e.value


# ---- accepted references -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"])
def test_data_urls_of_each_supported_format_decode(fmt):
    media = one_image(data_url(png(40, 30, fmt=fmt), f"image/{fmt.lower()}"))
    (img,) = media.images
    assert img.size == (40, 30) and img.mode == "RGB"


def test_base64_wrapped_over_lines_and_unpadded_is_accepted():
    b64 = base64.b64encode(png()).decode().rstrip("=")
    wrapped = "\n".join(b64[i : i + 60] for i in range(0, len(b64), 60))
    assert one_image(f"data:image/png;base64,{wrapped}").images[0].size == (32, 24)


def test_file_url_absolute_path_and_unencoded_spaces(tmp_path):
    p = tmp_path / "my photo.png"
    p.write_bytes(png(20, 10))
    for ref in (str(p), f"file://{str(p).replace(' ', '%20')}", f"file://{p}"):
        assert one_image(ref).images[0].size == (20, 10), ref


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    img = one_image(data_url(png(40, 20, fmt="JPEG", exif=exif), "image/jpeg")).images[0]
    assert img.size == (20, 40)


def test_low_detail_shrinks_large_images_only():
    big = one_image(data_url(png(2000, 1000)), detail="low").images[0]
    assert max(big.size) == 512 and big.size[0] == 2 * big.size[1]
    small = one_image(data_url(png(100, 50)), detail="low").images[0]
    assert small.size == (100, 50)


def test_images_keep_prompt_order_across_messages():
    messages = [
        {"role": "user", "content": [{"type": "image", "image": data_url(png(10, 10))}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}]},
        {"role": "user", "content": [{"type": "image", "image": data_url(png(30, 10))}]},
    ]
    assert [im.size for im in collect_media(messages, LIMITS).images] == [(10, 10), (30, 10)]


# ---- refused references --------------------------------------------------------------------


def test_undecodable_base64():
    assert "not valid base64" in bad("data:image/png;base64,@@@not-base64@@@").message


def test_data_url_without_base64_or_of_another_type():
    assert "base64" in bad("data:image/png,rawbytes").message
    assert "unsupported media type 'text/plain'" in bad(data_url(b"hi", "text/plain")).message


def test_truncated_image_is_not_decodable():
    assert "could not be decoded" in bad(data_url(png(64, 64)[:80])).message


def test_other_formats_are_refused():
    err = bad(data_url(png(8, 8, fmt="PPM"), "image/x-portable-pixmap"))
    assert "supported format" in err.message
    assert "supported format" in bad(data_url(b"GIF87a but not really")).message


def test_missing_path_directory_and_non_image_file(tmp_path):
    assert "does not exist" in bad(str(tmp_path / "nope.png")).message
    assert "is not a file" in bad(str(tmp_path)).message
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "supported format" in bad(f"file://{text}").message


def test_relative_paths_and_other_schemes_are_refused():
    for ref in ("images/cat.png", "ftp://host/cat.png", "cat"):
        assert "unsupported media URL" in bad(ref).message


def test_remote_urls_are_refused_by_default():
    err = bad("https://example.com/cat.png")
    assert "--allow-remote-images" in err.message


def test_byte_and_pixel_caps():
    assert "limit of 0.0 MB" in bad(data_url(png()), MediaLimits(max_image_bytes=10)).message
    err = bad(data_url(png(100, 100)), MediaLimits(max_image_pixels=9_999))
    assert "100x100" in err.message and "9,999" in err.message


def test_byte_cap_applies_to_files(tmp_path):
    p = tmp_path / "a.png"
    p.write_bytes(png(64, 64))
    assert "MB" in bad(str(p), MediaLimits(max_image_bytes=100)).message


def test_image_count_cap_names_the_first_part_over_it():
    url = data_url(png())
    content = [{"type": "image", "image": url}] * 3
    with pytest.raises(InvalidRequest) as e:
        collect_media([{"role": "user", "content": content}], MediaLimits(max_images=2))
    assert e.value.param == "messages[0].content[2]" and "at most 2" in e.value.message


def test_param_hint_names_the_protocol_location():
    part = {"type": "image", "image": "/does/not/exist.png", "param": "messages[3].images[1]"}
    with pytest.raises(InvalidRequest) as e:
        collect_media([{"role": "user", "content": [part]}], LIMITS)
    assert e.value.param == "messages[3].images[1]"


# ---- remote fetching when allowed ---------------------------------------------------------


@pytest.fixture(scope="module")
def http_images():
    body = png(16, 16)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/huge.png":
                self.send_response(200)
                self.send_header("Content-Length", str(50 << 20))
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_fetch_when_allowed(http_images):
    limits = MediaLimits(allow_remote=True, fetch_timeout=5)
    assert one_image(f"{http_images}/cat.png", limits).images[0].size == (16, 16)
    assert "404" in bad(f"{http_images}/missing.png", limits).message
    assert (
        "limit of 1.0 MB"
        in bad(
            f"{http_images}/huge.png", MediaLimits(allow_remote=True, max_image_bytes=1 << 20)
        ).message
    )


def test_unreachable_remote_url_is_a_400():
    limits = MediaLimits(allow_remote=True, fetch_timeout=3)
    assert "could not fetch" in bad(f"http://127.0.0.1:{free_port()}/x.png", limits).message


# ---- videos --------------------------------------------------------------------------------


def test_video_container_signatures():
    assert is_video_container(b"\x00\x00\x00\x18ftypmp42")
    assert is_video_container(b"RIFF\x10\x1e\x00\x00AVI LIST")
    assert is_video_container(b"\x1a\x45\xdf\xa3\x01\x00")
    assert not is_video_container(b"#EXTM3U\n#EXT-X-")
    assert not is_video_container(png()[:16])


def test_video_bytes_go_to_a_temporary_file_that_is_removed(tmp_path):
    avi = b"RIFF\x10\x1e\x00\x00AVI LIST" + b"\x00" * 64
    part = {"type": "video", "video": data_url(avi, "video/avi")}
    media = collect_media([{"role": "user", "content": [part]}], LIMITS)
    (path,) = media.videos
    assert Path(path).read_bytes() == avi
    media.cleanup()
    assert not Path(path).exists()


def test_non_video_file_is_refused(tmp_path):
    p = tmp_path / "list.m3u8"
    p.write_text("#EXTM3U\nfile:///etc/passwd\n")
    with pytest.raises(InvalidRequest) as e:
        collect_media([{"role": "user", "content": [{"type": "video", "video": str(p)}]}], LIMITS)
    assert "not a video" in e.value.message


def test_read_bytes_reads_local_files(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"abc")
    assert read_bytes(str(p), "w", LIMITS, 10) == b"abc"
    with pytest.raises(InvalidRequest):
        decode_image(b"abc", "w", LIMITS)


# ---- OpenAI parts → neutral parts ---------------------------------------------------------


def chat(messages, vision=True):
    return to_chat_request(ChatCompletionRequest(messages=messages), vision=vision)


def test_openai_parts_become_neutral_parts_in_order():
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,AA", "detail": "low"},
                },
                {"type": "image_url", "image_url": "file:///tmp/b.png"},
                {"type": "input_image", "image_url": "/tmp/c.png"},
                {"type": "video_url", "video_url": {"url": "/tmp/v.mp4"}},
            ],
            "images": ["/tmp/legacy.png"],
            "videos": ["/tmp/legacy.mp4"],
        }
    ]
    content = chat(msgs).messages[0]["content"]
    assert content == [
        {"type": "text", "text": "compare"},
        {
            "type": "image",
            "image": "data:image/png;base64,AA",
            "param": "messages[0].content[1]",
            "detail": "low",
        },
        {"type": "image", "image": "file:///tmp/b.png", "param": "messages[0].content[2]"},
        {"type": "image", "image": "/tmp/c.png", "param": "messages[0].content[3]"},
        {"type": "video", "video": "/tmp/v.mp4", "param": "messages[0].content[4]"},
        {"type": "image", "image": "/tmp/legacy.png", "param": "messages[0].images[0]"},
        {"type": "video", "video": "/tmp/legacy.mp4", "param": "messages[0].videos[0]"},
    ]


def test_text_only_content_stays_a_string():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert chat(msgs).messages[0]["content"] == "a\nb"
    assert chat([{"role": "user", "content": "hi"}]).messages[0]["content"] == "hi"


def test_media_to_a_text_model_and_audio_are_400s():
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    with pytest.raises(InvalidRequest) as e:
        chat([{"role": "user", "content": [{"type": "text", "text": "x"}, img]}], vision=False)
    assert e.value.param == "messages[0].content[1]" and "text only" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        chat([{"role": "user", "content": "x", "images": ["/a.png"]}], vision=False)
    assert e.value.param == "messages[0]"
    audio = {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}
    with pytest.raises(InvalidRequest) as e:
        chat([{"role": "user", "content": [audio]}])
    assert "audio" in e.value.message
