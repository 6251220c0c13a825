"""The architecture sweep's image part, whole, through its own live server: every image family
transformers classifies with gets a line, and the line says ``edited`` (with the variant loaded back
by transformers and its tensors moved) or ``refused`` with the service's reason.

Which families are edited is pinned too, so that a family that starts to fail (or to pass) shows up
here and not only in the script's output; the service's reason for the layers it leaves alone
(grouped and depthwise convs) must be quoted on the line.
"""

from __future__ import annotations

import re

import pytest

from engram_fixtures.image_families import IMAGE_FAMILIES
from scripts.architecture_sweep import main

# Families whose every conv has groups == 1 (or that have only Linear layers besides the patch conv).
FULLY_EDITED = {"vit", "deit", "beit", "swin", "resnet", "clip_vision"}
# Families with layers the service does not edit: edited elsewhere, those layers named as not edited,
# with the reason on the line. Grouped and depthwise convs; SigLIP's attention-pooling head, an
# nn.MultiheadAttention that applies its out_proj functionally (F.multi_head_attention_forward reads the
# weight), so no forward hook could ever see that layer's input.
PARTLY_EDITED = {
    "convnext": "groups",
    "regnet": "groups",
    "efficientnet": "groups",
    "mobilenet_v1": "groups",
    "mobilenet_v2": "groups",
    "siglip_vision": "nn.MultiheadAttention",
}
REFUSED: dict[str, str] = {}


@pytest.mark.slow
def test_every_image_family_has_a_line_edited_or_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert FULLY_EDITED | set(PARTLY_EDITED) | set(REFUSED) == set(IMAGE_FAMILIES)
    assert main(["--images"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert set(IMAGE_FAMILIES) <= set(lines), sorted(set(IMAGE_FAMILIES) - set(lines))
    for family in IMAGE_FAMILIES:
        line = lines[family]
        assert re.search(r"^\S+\s+(edited: \d+ layers \(\d+ conv\), \d+ tensors moved|refused)", line), line
        assert "ERROR" not in line, line
    for family in FULLY_EDITED | set(PARTLY_EDITED):
        edited = re.search(r"edited: (\d+) layers \((\d+) conv\), (\d+) tensors moved", lines[family])
        assert edited is not None, lines[family]
        layers, convs, moved = map(int, edited.groups())
        assert layers > 0 and moved > 0 and convs >= 1, lines[family]  # the patch embedding is a conv too
        if family in PARTLY_EDITED:
            assert "layers not edited" in lines[family] and PARTLY_EDITED[family] in lines[family], lines[family]
        else:
            assert "not edited" not in lines[family], lines[family]
    for family, reason in REFUSED.items():
        assert "refused" in lines[family] and reason in lines[family], lines[family]
