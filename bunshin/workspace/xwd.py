"""XWD (X Window Dump, what ``xwd -root`` writes) to pixels and PNG.

Facts of the format (X11's XWDFile.h, file version 7): a header of 25 big-endian
CARD32s (``header_size`` bytes in all, the window's name after the 100 fixed bytes),
then ``ncolors`` 12-byte colour entries, then ``bytes_per_line * height`` bytes of
pixels in ``byte_order`` (0: least significant byte first). Xvfb at depth 24 gives a
TrueColor (or, seen once a GTK app is up, DirectColor: its colormap is applied) ZPixmap
of 32 bits per pixel with masks ff0000/ff00/ff, at depth 16 one of 16 bits
(f800/7e0/1f). Only those are read; anything else is refused.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from PIL import Image

from ..errors import RuntimeFailure

_HEADER = struct.Struct(">25I")
#: The largest screen side read (what a workspace sends is untrusted: no giant images).
MAX_SIDE = 16384
_ZPIXMAP = 2
_TRUECOLOR = 4
_DIRECTCOLOR = 5
_COLOR = struct.Struct(">IHHHBB")


@dataclass(frozen=True)
class XwdHeader:
    """The fields of an XWD header this reader uses."""

    header_size: int
    version: int
    pixmap_format: int
    depth: int
    width: int
    height: int
    byte_order: int
    bits_per_pixel: int
    bytes_per_line: int
    visual_class: int
    masks: tuple[int, int, int]
    ncolors: int


def header(data: bytes) -> XwdHeader:
    if len(data) < _HEADER.size:
        raise RuntimeFailure(f"screenshot: {len(data)} bytes is too short for an XWD header",
                             hint="the X server did not answer xwd; is the desktop still running?")
    f = _HEADER.unpack_from(data)
    return XwdHeader(header_size=f[0], version=f[1], pixmap_format=f[2], depth=f[3], width=f[4],
                     height=f[5], byte_order=f[7], bits_per_pixel=f[11], bytes_per_line=f[12],
                     visual_class=f[13], masks=(f[14], f[15], f[16]), ncolors=f[19])


def _raw_mode(h: XwdHeader) -> str:
    lsb = h.byte_order == 0
    # xwd on a screen with more than one visual (a GTK app's 32-bit ARGB windows) labels the
    # dump 24 bits per pixel, DirectColor, yet writes 4 bytes a pixel (its bytes_per_line)
    padded = h.bits_per_pixel == 24 and h.bytes_per_line >= 4 * h.width
    if (h.bits_per_pixel == 32 or padded) and h.masks == (0xFF0000, 0xFF00, 0xFF):
        return "BGRX" if lsb else "XRGB"
    if h.bits_per_pixel == 16 and h.masks == (0xF800, 0x7E0, 0x1F) and lsb:
        return "BGR;16"
    raise RuntimeFailure(
        f"screenshot: XWD of {h.bits_per_pixel} bits per pixel with masks {[hex(m) for m in h.masks]}"
        " is not read here", hint="start the desktop at depth 24 (the default) or 16")


def to_image(data: bytes) -> Image.Image:
    """The RGB image an XWD dump holds."""
    h = header(data)
    if h.version != 7 or h.pixmap_format != _ZPIXMAP or h.visual_class not in (_TRUECOLOR, _DIRECTCOLOR):
        raise RuntimeFailure(f"screenshot: XWD version {h.version}, format {h.pixmap_format}, visual "
                             f"{h.visual_class}: only a version 7 TrueColor or DirectColor ZPixmap is read",
                             hint="start the desktop with Xvfb at depth 24 (the default)")
    if not (0 < h.width <= MAX_SIDE and 0 < h.height <= MAX_SIDE and 100 <= h.header_size <= 65536
            and h.ncolors <= 65536 and h.bytes_per_line >= h.width * h.bits_per_pixel // 8):
        raise RuntimeFailure(f"screenshot: an XWD header that describes no screen ({h.width}x{h.height}, "
                             f"{h.bytes_per_line} bytes a line, header {h.header_size} bytes)",
                             hint="something in the workspace answered in xwd's place; create a new desktop")
    start = h.header_size + 12 * h.ncolors
    end = start + h.bytes_per_line * h.height
    if len(data) < end:
        raise RuntimeFailure(f"screenshot: XWD of {h.width}x{h.height} is cut short ({len(data)} of {end} bytes)",
                             hint="the X server went away mid-dump; take the screenshot again")
    img = Image.frombuffer("RGB", (h.width, h.height), data[start:end], "raw", _raw_mode(h),
                           h.bytes_per_line, 1)
    lut = _direct_lut(h, data) if h.visual_class == _DIRECTCOLOR else None
    return img.point(lut) if lut is not None else img.copy()


def _direct_lut(h: XwdHeader, data: bytes) -> list[int] | None:
    """DirectColor pixels index a colormap per channel (Xvfb's default visual once a GTK
    app is up); the lookup table from the dump's colormap, ``None`` when it is the identity
    (or absent: 8-bit channels read as they are)."""
    if h.bits_per_pixel not in (24, 32) or h.ncolors != 256:
        return None
    red, green, blue = list(range(256)), list(range(256)), list(range(256))
    for i in range(256):
        pixel, r, g, b, _flags, _pad = _COLOR.unpack_from(data, h.header_size + 12 * i)
        red[(pixel >> 16) & 0xFF], green[(pixel >> 8) & 0xFF], blue[pixel & 0xFF] = r >> 8, g >> 8, b >> 8
    lut = red + green + blue
    return None if lut == list(range(256)) * 3 else lut


def to_png(data: bytes) -> bytes:
    """PNG bytes of an XWD dump (the same pixels always give the same bytes)."""
    buf = io.BytesIO()
    to_image(data).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()
