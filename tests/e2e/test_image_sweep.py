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
# Families with grouped or depthwise convs: edited elsewhere, those layers named as not edited.
PARTLY_EDITED = {"convnext", "regnet", "efficientnet", "mobilenet_v1", "mobilenet_v2"}
# Refused, and the reason the line must quote. SigLIP's attention-pooling head is an
# nn.MultiheadAttention, whose out_proj it applies functionally (F.multi_head_attention_forward reads
# the weight): the layout lists out_proj as editable but no forward hook sees its input, so no concept
# has statistics for it and the unlearn is a 409 naming it.
REFUSED = {"siglip_vision": "head.attention.out_proj"}


@pytest.mark.slow
def test_every_image_family_has_a_line_edited_or_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert FULLY_EDITED | PARTLY_EDITED | set(REFUSED) == set(IMAGE_FAMILIES)
    assert main(["--images"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert set(IMAGE_FAMILIES) <= set(lines), sorted(set(IMAGE_FAMILIES) - set(lines))
    for family in IMAGE_FAMILIES:
        line = lines[family]
        assert re.search(r"^\S+\s+(edited: \d+ layers \(\d+ conv\), \d+ tensors moved|refused)", line), line
        assert "ERROR" not in line, line
    for family in FULLY_EDITED | PARTLY_EDITED:
        edited = re.search(r"edited: (\d+) layers \((\d+) conv\), (\d+) tensors moved", lines[family])
        assert edited is not None, lines[family]
        layers, convs, moved = map(int, edited.groups())
        assert layers > 0 and moved > 0 and convs >= 1, lines[family]  # the patch embedding is a conv too
        if family in PARTLY_EDITED:
            assert "layers not edited" in lines[family] and "groups" in lines[family], lines[family]
        else:
            assert "not edited" not in lines[family], lines[family]
    for family, reason in REFUSED.items():
        assert "refused" in lines[family] and reason in lines[family], lines[family]
