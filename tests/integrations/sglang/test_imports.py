"""The torchvision stand-in: SGLang's module-level ``import torchvision`` worked where none is
installed, any use of it fails loudly instead of computing something wrong, and it is withdrawn
once SGLang's modules are imported, so the rest of the process still sees no torchvision."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from hicache.integrations.sglang_imports import STAND_IN  # noqa: E402

pytestmark = pytest.mark.sglang


def test_the_stand_in_served_sglangs_import_refuses_to_run_and_is_withdrawn() -> None:
    vision = sys.modules[
        "sglang.srt.multimodal.internvl_utils"
    ].T  # import torchvision.transforms as T
    if getattr(vision, "__doc__", None) != STAND_IN:
        return  # a real torchvision is installed: nothing was stood in
    with pytest.raises(ImportError, match="torchvision is not installed"):
        vision.Resize(224)
    assert "torchvision" not in sys.modules
    assert importlib.util.find_spec("torchvision") is None
