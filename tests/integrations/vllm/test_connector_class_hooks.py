"""A bad kv_connector_extra_config is refused while vLLM builds its configuration, before any
model loads, and full CUDA graphs are turned piecewise for the layer-wise hooks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hicache.domain import ConfigError

pytest.importorskip("vllm")

from vllm.config import (
    CompilationConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)

from hicache.integrations.vllm import HiCacheConnector
from tests.integrations.vllm.sched_harness import _model_dir

BAD = {"host_gib": float("nan")}


def _vllm_config(root: Path, extra: dict[str, Any], mode: str = "NONE") -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(_model_dir(root, 2)),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=256,
        ),
        compilation_config=CompilationConfig(cudagraph_mode=mode),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )


def test_the_connector_asks_for_piecewise_cuda_graphs_for_its_layer_hooks() -> None:
    assert HiCacheConnector.requires_piecewise_for_cudagraph({"host_gib": 1}) is True


def test_the_cuda_graph_hook_refuses_a_bad_extra_config_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="'host_gib'"):
        HiCacheConnector.requires_piecewise_for_cudagraph(BAD)
    with pytest.raises(ConfigError, match="'protocl'"):
        HiCacheConnector.requires_piecewise_for_cudagraph(
            {"storage_backend": "mooncake", "storage_extra_config": {"protocl": "tcp"}}
        )


def test_vllm_config_with_full_cuda_graphs_is_refused_before_any_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The CPU platform has no CUDA graphs; pretend it has, as CUDA does, so that VllmConfig
    # runs its connector check (vllm/config/vllm.py, "requires PIECEWISE").
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True)
    )
    with pytest.raises(ValueError, match="kv_connector_extra_config 'host_gib' = nan"):
        _vllm_config(tmp_path, BAD, "FULL_AND_PIECEWISE")
    with caplog.at_level("WARNING"):
        _vllm_config(tmp_path, {"host_gib": 1}, "FULL_AND_PIECEWISE")
    assert "Overriding cudagraph_mode from FULL_AND_PIECEWISE to PIECEWISE" in caplog.text


def test_the_layout_hook_refuses_a_bad_extra_config(tmp_path: Path) -> None:
    good = _vllm_config(tmp_path, {"host_gib": 1})
    assert HiCacheConnector.get_required_kvcache_layout(good) is None
    assert good.kv_transfer_config is not None
    good.kv_transfer_config.kv_connector_extra_config = {"host_gib": 1e308}
    with pytest.raises(ConfigError, match="'host_gib'"):
        HiCacheConnector.get_required_kvcache_layout(good)


def test_on_rocm_vllm_resolves_a_layout_whose_blocks_are_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ROCm's attention backend lists LHBNC (heads outside the blocks, refused by the
    connector) before LBHNC: the connector's answer makes vLLM's own resolution pick LBHNC."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    rocm_sets = [["LHBNC", "LBHNC"]]  # vllm/v1/attention/backends/rocm_attn.py
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True)
    config = _vllm_config(tmp_path, {"host_gib": 1})
    assert resolve_kv_cache_layout(config, rocm_sets).name == "LBHNC"
    # elsewhere the connector leaves vLLM's choice alone (CUDA: LBNHC, the CPU: LBHNC)
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: False)
    config = _vllm_config(tmp_path, {"host_gib": 1})
    assert HiCacheConnector.get_required_kvcache_layout(config) is None
    assert resolve_kv_cache_layout(config, rocm_sets).name == "LHBNC"


def test_a_layout_the_connector_cannot_copy_is_refused_before_any_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True)
    )
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LHBNC")
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT='LHBNC' keeps the heads outside"):
        _vllm_config(tmp_path, {"host_gib": 1}, "FULL_AND_PIECEWISE")
    for usable in ("BLNHC", "HND"):  # a layout whose blocks are one run, or its older name
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", usable)
        _vllm_config(tmp_path, {"host_gib": 1}, "FULL_AND_PIECEWISE")


def _check(text: str, **env: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        "from hicache.integrations.vllm.check import check\n"
        "rc = check(sys.argv[1:])\n"
        "assert 'vllm' not in sys.modules, 'the check imported vLLM'\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, text],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **env},
        check=False,
    )


def test_the_check_command_refuses_a_bad_extra_config_in_one_line_without_vllm() -> None:
    out = _check('{"storage_backend": "mooncake", "storage_extra_config": {"protocl": "tcp"}}')
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: ")
    assert "'protocl'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert _check('{"host_gib": Infinity}').returncode == 2


def test_the_check_command_refuses_a_layout_the_connector_cannot_copy() -> None:
    out = _check('{"host_gib": 1}', VLLM_KV_CACHE_LAYOUT="BHLNC")
    assert out.returncode == 2, out.stderr
    assert "VLLM_KV_CACHE_LAYOUT='BHLNC' keeps the heads outside the blocks" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    unknown = _check('{"host_gib": 1}', VLLM_KV_CACHE_LAYOUT="XYZ")
    assert "is no KV cache layout vLLM 0.32 names" in unknown.stderr
    assert _check('{"host_gib": 1}', VLLM_KV_CACHE_LAYOUT="LBNHC").returncode == 0


def test_the_check_command_prints_the_resolved_settings(tmp_path: Path) -> None:
    out = _check(
        json.dumps(
            {"host_gib": 2, "storage_backend": "directory", "storage_path": str(tmp_path / "kv")}
        )
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["host_bytes"] == 2 << 30
    assert doc["storage_path"] == str(tmp_path / "kv")
    assert not (tmp_path / "kv").exists()
