"""The torchvision stand-in: SGLang's module-level ``import torchvision`` works where none is
installed, and any use of it fails loudly instead of computing something wrong."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from hicache.integrations.sglang_imports import STAND_IN, allow_sglang_without_torchvision  # noqa: E402

pytestmark = pytest.mark.sglang


def test_the_stand_in_is_used_only_without_a_real_torchvision_and_refuses_to_run() -> None:
    import torchvision

    if getattr(torchvision, "__doc__", None) != STAND_IN:
        # A real torchvision: nothing is stood in.
        assert allow_sglang_without_torchvision() is False
        return
    assert allow_sglang_without_torchvision() is True
    assert importlib.util.find_spec("torchvision.transforms") is not None
    import torchvision.transforms as T

    with pytest.raises(ImportError, match="torchvision is not installed"):
        T.Resize(224)
    assert "torchvision" in sys.modules
