"""Runs vLLM with HiCacheConnector in a child process and prints what happened as JSON.

``python -m tests.integrations.vllm.runner SPEC.json`` where SPEC is {"model": folder,
"mode": "inproc" | "mp", "tp": 1, "llm": {more LLM keyword arguments}, "prompts": [[token
ids] | {"tokens": [token ids], "salt": cache_salt, "lora": adapter name}, ...], "loras":
{adapter name: folder} (LoRA adapters: the LLM needs "enable_lora": true), "phases": [...]};
each phase starts one LLM (``connector``: the
kv_connector_extra_config, or null for none; ``load_policy`` is "always" unless it says;
``llm``: more keyword arguments, over the spec's; ``tp``: its tensor parallel size, over the
spec's; ``env``: environment variables set before it starts)
and runs its ``steps``: ["gen", [prompt indexes]] | ["followup", i, n] (the next turn of a
chat: prompt i, its last output and n more tokens) | ["reset"] (vLLM's prefix cache) |
["reset_all"] (and hicache's host tier) | ["flag", folder, name, text or null] (FaultyStore's
flag files) | ["damage", store folder] (flip a byte in every stored object) | ["metrics"]
(vLLM's counters of the connector, {"name{label=value}": value}: the LLM needs
``disable_log_stats`` False) | ["sleep", s]. The last stdout
line is ``HICACHE-RESULT {"phases": [[step result, ...], ...], "block_sizes": [each phase's
block size as vLLM settled it]}``; a "gen" result is a list of {"tokens", "cached" (vLLM's
num_cached_tokens), "ms"}.

One process per call: vLLM keeps global state (its platform, the connector group) that does
not reset between processes' LLM instances cleanly across modes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def make_model(folder: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A tiny LlamaForCausalLM with random weights (initializer_range 0.25: varied tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.25,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def make_lora(folder: Path, *, layers: int = 2, rank: int = 8, seed: int = 1) -> Path:
    """A LoRA adapter for make_model's Llama (q, k, v and o projections of every layer), in
    PEFT's files (adapter_config.json, adapter_model.safetensors); B is not zero, so the
    adapter changes the KV and the output."""
    import torch
    from safetensors.torch import save_file

    if (folder / "adapter_config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (256, 256),
        "k_proj": (128, 256),
        "v_proj": (128, 256),
        "o_proj": (256, 256),
    }
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for name, (out, inp) in shapes.items():
            base = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.2
            tensors[f"{base}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.2
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(shapes),
        "base_model_name_or_path": None,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _followup(prompt: list[int], reply: list[int], n: int) -> list[int]:
    import random

    rng = random.Random(7)
    return prompt + reply + [rng.randrange(1, 1000) for _ in range(n)]


def _llm(
    model: str,
    connector: dict[str, object] | None,
    name: str = "HiCacheConnector",
    tp: int = 1,
    extra: dict[str, object] | None = None,
) -> object:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if connector is not None:
        # every hit loaded unless the spec says otherwise: the tests count hits exactly, and
        # load_policy "measured" would make them depend on this machine's timings
        if name == "HiCacheConnector":
            connector = {"load_policy": "always", **connector}
        module = (
            "hicache.integrations.vllm"
            if name == "HiCacheConnector"
            else "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
        )
        kv = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=connector,
            kv_load_failure_policy="recompute",
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=32,
        enforce_eager=True,
        max_model_len=8192,
        max_num_batched_tokens=8192,
        kv_transfer_config=kv,
        seed=0,
        tensor_parallel_size=tp,
        **(extra or {}),
    )


METRICS = ("vllm:hicache_", "vllm:prompt_tokens_cached_by_source", "vllm:external_prefix_cache")


def _metrics(llm: object) -> dict[str, float]:
    """vLLM's counters of the connector: ``name`` or ``name{label=value}`` -> value."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():  # type: ignore[attr-defined]
        if not m.name.startswith(METRICS) or not hasattr(m, "value"):
            continue
        extra = {k: v for k, v in m.labels.items() if k not in ("engine", "model_name")}
        name = m.name + (
            "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else ""
        )
        out[name] = out.get(name, 0) + float(m.value)
    return out


def run(spec: dict[str, object]) -> dict[str, object]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=int(spec.get("max_tokens", 24)), ignore_eos=True
    )
    from vllm.lora.request import LoRARequest

    prompts: list[list[int]] = []
    extras: list[dict[str, object]] = []  # each prompt's cache_salt and LoRA adapter
    for p in spec["prompts"]:  # type: ignore[attr-defined]
        prompts.append(list(p["tokens"]) if isinstance(p, dict) else list(p))
        extras.append(dict(p) if isinstance(p, dict) else {})
    loras = {
        name: LoRARequest(name, i + 1, str(path))
        for i, (name, path) in enumerate(sorted(dict(spec.get("loras", {})).items()))  # type: ignore[call-overload]
    }

    def inputs(i: int, tokens: list[int]) -> dict[str, object]:
        salt = extras[i].get("salt")
        return {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}

    out: list[list[object]] = []
    blocks: list[int] = []
    last: dict[int, list[int]] = {}  # prompt index -> its last output
    for phase in spec["phases"]:  # type: ignore[attr-defined]
        os.environ.update(phase.get("env", {}))  # read by vLLM as it starts this phase's LLM
        llm = _llm(
            str(spec["model"]),
            phase.get("connector"),
            phase.get("name", "HiCacheConnector"),
            int(phase.get("tp", spec.get("tp", 1))),  # a phase may run at another TP size
            {**spec.get("llm", {}), **phase.get("llm", {})},  # type: ignore[dict-item]
        )
        # The attention block vLLM settled on (hybrid models: set by the state page's size).
        blocks.append(llm.llm_engine.vllm_config.cache_config.block_size)  # type: ignore[attr-defined]
        results: list[object] = []
        for step in phase["steps"]:
            if step[0] in ("gen", "followup"):
                import time

                which = list(step[1]) if step[0] == "gen" else [step[1]]
                if step[0] == "gen":
                    batch = [inputs(i, prompts[i]) for i in which]
                else:
                    batch = [inputs(step[1], _followup(prompts[step[1]], last[step[1]], step[2]))]
                adapters = [loras.get(str(extras[i].get("lora"))) for i in which]
                t0 = time.perf_counter()
                got = llm.generate(  # type: ignore[attr-defined]
                    batch,
                    params,
                    use_tqdm=False,
                    lora_request=adapters if any(adapters) else None,
                )
                ms = (time.perf_counter() - t0) * 1000
                if step[0] == "gen":
                    last.update(
                        {i: list(r.outputs[0].token_ids) for i, r in zip(step[1], got, strict=True)}
                    )
                results.append(
                    [
                        {
                            "tokens": list(r.outputs[0].token_ids),
                            "cached": r.num_cached_tokens,
                            "ms": ms,
                        }
                        for r in got
                    ]
                )
            elif step[0] == "reset":
                results.append(bool(llm.reset_prefix_cache()))  # type: ignore[attr-defined]
            elif step[0] == "reset_all":  # vLLM's prefix cache and hicache's host tier
                results.append(bool(llm.reset_prefix_cache(reset_connector=True)))  # type: ignore[attr-defined]
            elif step[0] == "flag":  # ["flag", folder, name, text or null]
                flag = Path(step[1]) / step[2]
                if step[3] is None:
                    flag.unlink(missing_ok=True)
                else:
                    flag.write_text(str(step[3]))
                results.append(step[2])
            elif step[0] == "metrics":  # vLLM's counters so far (needs disable_log_stats False)
                results.append(_metrics(llm))
            elif step[0] == "sleep":
                import time

                time.sleep(float(step[1]))
                results.append(step[1])
            elif step[0] == "damage":
                n = 0
                for f in sorted(Path(step[1]).rglob("*.obj")):
                    data = bytearray(f.read_bytes())
                    data[-100] ^= 0xFF
                    f.write_bytes(bytes(data))
                    n += 1
                results.append(n)
        out.append(results)
        del llm
        import gc

        gc.collect()
    return {"phases": out, "block_sizes": blocks}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("mode") == "inproc":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = run(spec)
    print("HICACHE-RESULT " + json.dumps(result), flush=True)
    os._exit(0)
