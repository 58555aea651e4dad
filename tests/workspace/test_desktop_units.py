"""Unit: desktop specs, key names and XWD decoding (no X server needed)."""

from __future__ import annotations

import io
import struct

import pytest
from PIL import Image

from bunshin.errors import InvalidArgument, RuntimeFailure
from bunshin.workspace import keys, xwd
from bunshin.workspace.desktop import DesktopSpec


def test_spec_parse_forms():
    assert DesktopSpec.parse(None) is None and DesktopSpec.parse(False) is None
    assert DesktopSpec.parse(True) == DesktopSpec() and DesktopSpec().size == (1280, 800)
    assert DesktopSpec.parse("640x480").size == (640, 480)
    assert DesktopSpec.parse("800x600x16").depth == 16
    assert DesktopSpec.parse({"width": 1024, "height": 768, "vnc": True}).vnc
    spec = DesktopSpec(width=900, window_manager="none")
    assert DesktopSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("bad", ["12x", "640x480x8", "10x10", "99999x100", {"width": "wide"}, {"colour": 1},
                                 {"window_manager": "kwin"}, {"browser": "dillo; rm -rf /"}, 3])
def test_spec_refuses_bad_values(bad):
    with pytest.raises(InvalidArgument) as e:
        DesktopSpec.parse(bad)
    assert e.value.message


@pytest.mark.parametrize(("combo", "want"), [
    ("ctrl+s", "ctrl+s"), ("Return", "Return"), ("enter", "Return"), ("ESC", "Escape"),
    ("ctrl+shift+Tab", "ctrl+shift+Tab"), ("alt+F4", "alt+F4"), ("pageup", "Page_Up"), ("+", "plus"),
    ("ctrl++", "ctrl+plus"), ("cmd+c", "super+c"), ("a", "a"), ("/", "slash"),
])
def test_key_combos(combo, want):
    assert keys.xdotool_combo(combo) == want


@pytest.mark.parametrize("bad", ["", "ctrl+", "hyper", "ctrl+foo", "é", "ctrl++s", "F25"])
def test_unknown_keys_are_refused(bad):
    with pytest.raises(InvalidArgument):
        keys.xdotool_combo(bad)


def _xwd(width: int, height: int, pixels: bytes, *, bpp: int = 32, masks=(0xFF0000, 0xFF00, 0xFF),
         ncolors: int = 0, name: bytes = b"root\0", visual: int = 4, bpl: int | None = None,
         colormap: bytes | None = None) -> bytes:
    """An XWD file as xwd writes it (header big-endian, pixels least significant byte first)."""
    bpl = width * bpp // 8 if bpl is None else bpl
    header_size = 100 + len(name)
    fields = [header_size, 7, 2, 24, width, height, 0, 0, 32, 0, 32, bpp, bpl, visual, *masks, 8, 256, ncolors,
              width, height, 0, 0, 0]
    colors = b"\0" * 12 * ncolors if colormap is None else colormap
    return struct.pack(">25I", *fields) + name + colors + pixels


def _colormap(f) -> bytes:
    """256 DirectColor entries: entry i maps channel value i to f(i)."""
    return b"".join(struct.pack(">IHHHBB", (i << 16) | (i << 8) | i, f(i) * 257, f(i) * 257, f(i) * 257, 7, 0)
                    for i in range(256))


def test_xwd_of_a_screen_with_a_gtk_app_directcolor_labelled_24_bits():
    """What xwd -root writes once a GTK app (32-bit ARGB windows) is up: DirectColor, 24 bits
    per pixel in the header, 4 bytes a pixel in fact, and the colormap to apply."""
    px = bytes([10, 20, 30, 0, 200, 100, 50, 0])
    same = xwd.to_image(_xwd(2, 1, px, bpp=24, bpl=8, visual=5, ncolors=256, colormap=_colormap(lambda i: i)))
    assert [same.getpixel((x, 0)) for x in range(2)] == [(30, 20, 10), (50, 100, 200)]
    inv = xwd.to_image(_xwd(2, 1, px, bpp=24, bpl=8, visual=5, ncolors=256, colormap=_colormap(lambda i: 255 - i)))
    assert inv.getpixel((0, 0)) == (225, 235, 245)


def test_xwd_to_png_keeps_every_pixel():
    # 3x2: red, green, blue / white, black, grey, as BGRX little-endian words
    px = bytes([0, 0, 255, 0, 0, 255, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0, 0, 0, 0, 0, 128, 128, 128, 0])
    img = Image.open(io.BytesIO(xwd.to_png(_xwd(3, 2, px, ncolors=2))))
    assert img.size == (3, 2)
    assert [img.getpixel((x, y)) for y in range(2) for x in range(3)] == [
        (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0), (128, 128, 128)]


def test_xwd_16_bit():
    word = (0b11111 << 11) | 0  # pure red in 5-6-5
    img = xwd.to_image(_xwd(1, 1, struct.pack("<H", word), bpp=16, masks=(0xF800, 0x7E0, 0x1F)))
    assert img.getpixel((0, 0))[0] >= 248 and img.getpixel((0, 0))[1:] == (0, 0)


def test_xwd_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeFailure, match="too short"):
        xwd.to_png(b"\0" * 10)
    with pytest.raises(RuntimeFailure, match="cut short"):
        xwd.to_png(_xwd(4, 4, b"\0" * 20))
    with pytest.raises(RuntimeFailure, match="not read here"):
        xwd.to_png(_xwd(1, 1, b"\0\0\0\0", masks=(0xFF, 0xFF00, 0xFF0000)))


@pytest.mark.parametrize(("width", "height", "bpl"), [(100000, 1, 400000), (0, 5, 0), (10, 10, 1), (5, 99999, 20)])
def test_xwd_headers_that_describe_no_screen_are_refused(width, height, bpl):
    """A workspace answers in xwd's place: lying sizes give a clear error, never a giant image."""
    with pytest.raises(RuntimeFailure, match="describes no screen|cut short"):
        xwd.to_png(_xwd(width, height, b"\0" * 64, bpl=bpl))
