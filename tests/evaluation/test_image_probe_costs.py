"""Image probes at submission (service.evaluation.classifier_probes.check_image_probes, run by the API
for evaluate and calibrate): issue 35, findings 3 and 6. A strip is refused from its header naming
the probe and its size; a large image is checked without its pixels decoded (the API process's peak
memory, measured in a fresh interpreter, does not grow by what the image declares: before, it grew
by what a 4000 × 4000 RGB probe decodes to)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest
from PIL import Image

from service.errors import InvalidInput
from service.evaluation.classifier_probes import check_image_probes
from tests.helpers.images import b64, digit_record

CLASSES = {i: f"class_{i}" for i in range(10)}
MAX_PIXELS = 40_000_000
MB = 1 << 20


def test_a_strip_probe_is_refused_naming_it() -> None:
    buffer = io.BytesIO()
    Image.new("L", (1, 40_000), 0).save(buffer, format="PNG")
    probes = {"forget": [digit_record(0), {"image": b64(buffer.getvalue()), "label": 1}]}
    with pytest.raises(InvalidInput, match=r"forget\[1\]: the image is 1×40000, its longer side over 100"):
        check_image_probes(probes, CLASSES, MAX_PIXELS)


_MEASURE = textwrap.dedent(
    """
    import json, struct, zlib
    from pathlib import Path
    from service.evaluation.classifier_probes import check_image_probes
    from tests.helpers.images import b64, digit_record

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    side = 4000
    compressor = zlib.compressobj(9)
    rows = b"".join(compressor.compress(b"\\x00" + bytes(3 * side)) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    png = b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    probes = {"forget": [digit_record(0)], "retain": [{"image": b64(png), "label": 1}]}
    check_image_probes({"forget": [digit_record(0)]}, {i: f"class_{i}" for i in range(10)}, 40_000_000)  # warm

    def status_kb(field):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
        return int(line.split()[1])

    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from what is resident now
    before = status_kb("VmRSS")
    for _ in range(3):
        check_image_probes(probes, {i: f"class_{i}" for i in range(10)}, 40_000_000)
    print(json.dumps({"grew_kb": status_kb("VmHWM") - before}))
    """
)


def test_a_large_probe_is_checked_without_decoding_its_pixels() -> None:
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=300, check=True)
    grew = json.loads(done.stdout.splitlines()[-1])["grew_kb"] * 1024
    print(f"\nchecking a 4000×4000 probe three times: peak RSS grew {grew / MB:.1f} MB")  # noqa: T201
    assert grew < 16 * MB, f"the check's peak grew {grew / MB:.0f} MB: it decoded the image"
