"""The torchvision stand-in: SGLang's module-level ``import torchvision`` worked where none is
installed, any use of it fails loudly instead of computing something wrong, and it is withdrawn
once SGLang's modules are imported, so the rest of the process still sees no torchvision; where
a torchvision can be found, nothing is stood in."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from hicache.integrations.sglang.sglang_imports import (  # noqa: E402
    STAND_IN,
    allow_sglang_without_torchvision,
    withdraw_stand_in,
)

pytestmark = pytest.mark.sglang


def test_the_stand_in_served_sglangs_import_refuses_to_run_and_is_withdrawn() -> None:
    vision = sys.modules[
        "sglang.srt.multimodal.internvl_utils"
    ].T  # import torchvision.transforms as T
    if getattr(vision, "__doc__", None) != STAND_IN:
        pytest.skip("a real torchvision is installed: SGLang imported it, nothing was stood in")
    with pytest.raises(ImportError, match="torchvision is not installed"):
        vision.Resize(224)
    assert "torchvision" not in sys.modules
    assert importlib.util.find_spec("torchvision") is None


def test_nothing_is_stood_in_where_a_torchvision_can_be_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "torchvision" in sys.modules:
        pytest.skip("a torchvision is already imported in this process")
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text("FOUND = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert allow_sglang_without_torchvision() is False
        import torchvision  # type: ignore[import-not-found]

        assert torchvision.FOUND  # the one on the path, not a stand-in
        assert getattr(torchvision, "__doc__", None) != STAND_IN
    finally:
        withdraw_stand_in()
        sys.modules.pop("torchvision", None)
