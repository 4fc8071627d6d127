"""Hostile input to the Python entry points: a result or one HiCacheError, nothing else.

- Every bundled model config with each key it holds replaced by a hostile value (true, 8.9, "8",
  0, -8, 10**30, inf, nan, a list, a mapping): ModelSpec.from_hf_config and plan_stack either
  raise a HiCacheError or give exactly the plan of the unmodified config (the key is one the
  reader does not use); never another exception, never a different plan.
- Layouts x pool kinds over every bundled model: a plan or a LayoutError/ConfigError.
- Wrong types at each public entry (paths, pool names, settings objects, pins).
- hypothesis: JSON text, nested documents with non-finite floats and huge integers, raw bytes as
  .json/.toml/.yaml files, through parse_extra_config, StorageSettings, resolve_host_memory and
  load_extra_config; HiCacheConfig from mappings (real and unknown keys, nested and dotted,
  numbers past every bound, nesting past the recursion limit, non-string keys) and from
  HICACHE_* variables holding any text; config files with a key given twice; the storage tier's
  and the directory store's settings with any number.
- Every field of every settings class with edge values (1e308, inf, NaN, 10**400, 10**5000,
  nesting past the recursion limit, non-string and unknown keys, pairs): a result or a
  HiCacheError with a short message.
The cache face (async and sync), the stores, open_runtime and LayerBinding are fuzzed in
tests/test_fuzz_cache_api.py.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.adapters.storage import DirectorySettings
from hicache.bootstrap import HiCacheConfig, load_extra_config, load_model_config, load_model_spec
from hicache.bootstrap.config import bundled_models
from hicache.bootstrap.config_keys import KEYS
from hicache.cache.values import CacheSettings
from hicache.domain import (
    DType,
    HiCacheError,
    Layout,
    LayoutError,
    ModelSpec,
    PlanSettings,
    PoolName,
    StorageSettings,
    parse_extra_config,
    plan_stack,
    resolve_host_memory,
)
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.pins import PinTable
from hicache.domain.sizing import BudgetSizing, RatioSizing
from hicache.domain.slots import GroupAllocator, PageAllocator
from hicache.domain.tiers import WriteSettings
from hicache.engine.storage_settings import StorageTierSettings
from tests.fuzz_values import (
    DOCUMENTS,
    HOSTILE_DOCUMENTS,
    HOSTILE_NUMBERS,
    JSON_LEAVES,
    deep,
    typed_or,
)

pytestmark = pytest.mark.timeout(60)

HOSTILE: dict[str, object] = {
    "true": True,
    "float": 8.9,
    "string": "8",
    "zero": 0,
    "negative": -8,
    "huge": 10**30,
    "inf": math.inf,
    "nan": math.nan,
    "list": [1.5],
    "mapping": {"a": 1},
}
MODELS = bundled_models()


def _leaves(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for k, v in d.items():
        if k.startswith("_"):
            continue  # provenance notes of the fixtures
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        elif isinstance(v, (int, float, list)) and k != "architectures":
            yield (*prefix, k)


def _mutations(name: str) -> list[tuple[tuple[str, ...], str]]:
    return [(path, v) for path in _leaves(load_model_config(name)) for v in HOSTILE]


MUTATION_COUNT = sum(len(_mutations(m)) for m in MODELS)


def _plan_or_error(config: dict[str, Any]) -> dict[str, Any] | HiCacheError:
    try:
        return plan_stack(ModelSpec.from_hf_config(config)).as_json()
    except HiCacheError as e:
        return e


@pytest.mark.parametrize("model", MODELS)
def test_hostile_values_in_model_configs_are_typed_errors_or_unused(model: str) -> None:
    base = load_model_config(model)
    expected = _plan_or_error(base)
    assert isinstance(expected, dict)
    wrong = []
    for path, label in _mutations(model):
        config = copy.deepcopy(base)
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = HOSTILE[label]
        try:
            got = _plan_or_error(config)
        except Exception as e:  # any exception that is not a HiCacheError is the bug
            wrong.append(f"{'.'.join(path)}={label}: {type(e).__name__}: {e}")
            continue
        if isinstance(got, dict) and got != expected:
            wrong.append(f"{'.'.join(path)}={label}: accepted with a different plan")
    assert not wrong, "\n".join(wrong[:20])


@pytest.mark.parametrize("model", MODELS)
def test_every_layout_for_every_pool_plans_or_is_a_typed_error(model: str) -> None:
    spec = load_model_spec(model)
    pools = [p.name for p in plan_stack(spec).pools]
    for pool in [*PoolName]:
        for layout in Layout:
            result = typed_or(
                lambda p=pool, la=layout: plan_stack(
                    spec, PlanSettings(pool_layouts={p.value: la.value})
                )
            )
            if isinstance(result, HiCacheError):
                # a pool the model lacks is refused by name (never ignored); a pool the plan
                # has refuses a layout only as a LayoutError
                if pool not in pools:
                    assert "does not have" in str(result), (pool, layout, result)
                    continue
                assert isinstance(result, LayoutError), (pool, layout, result)
                continue
            assert pool in pools, (pool, layout, "a layout for a missing pool was accepted")
            plan = result
            if pool in pools:
                assert next(p for p in plan.pools if p.name is pool).layout is layout


SPEC = load_model_spec("llama-3.1-8b-instruct")
PLAN = plan_stack(SPEC)
FIXTURE = Path(load_model_spec.__code__.co_filename).parents[1] / "fixtures" / "models"

API_CALLS: dict[str, Callable[[], object]] = {
    "from_hf_config(None)": lambda: ModelSpec.from_hf_config(None),  # type: ignore[arg-type]
    "from_hf_config(list)": lambda: ModelSpec.from_hf_config([1]),  # type: ignore[arg-type]
    "load_model_spec(int)": lambda: load_model_spec(5),  # type: ignore[arg-type]
    "load_model_spec(NUL)": lambda: load_model_spec("a\x00b"),
    "load_model_spec(long)": lambda: load_model_spec("/" + "x" * 5000),
    "load_model_spec(missing Path)": lambda: load_model_spec(Path("/no/such/config.json")),
    "load_extra_config(int)": lambda: load_extra_config(5),  # type: ignore[arg-type]
    "load_extra_config(missing Path)": lambda: load_extra_config(Path("/no/such.yaml")),
    "StorageSettings(backend=5)": lambda: StorageSettings(backend=5),  # type: ignore[arg-type]
    "StorageSettings(extra=5)": lambda: StorageSettings(extra_config=5),  # type: ignore[arg-type]
    "resolve_host_memory(5)": lambda: resolve_host_memory(5),  # type: ignore[arg-type]
    "resolve_host_memory(pinned=5)": lambda: resolve_host_memory(None, 5),  # type: ignore[arg-type]
    "plan_stack(str)": lambda: plan_stack("llama"),  # type: ignore[arg-type]
    "plan_stack(settings=str)": lambda: plan_stack(SPEC, "x"),  # type: ignore[arg-type]
    "plan_stack(settings=unknown key)": lambda: plan_stack(SPEC, {"tpsize": 2}),
    "PlanSettings(tp_size=True)": lambda: PlanSettings(tp_size=True),
    "PlanSettings(tp_size=2.0)": lambda: PlanSettings(tp_size=2.0),  # type: ignore[arg-type]
    "PlanSettings(tp_size='2')": lambda: PlanSettings(tp_size="2"),  # type: ignore[arg-type]
    "PlanSettings(tp_size=1e30)": lambda: PlanSettings(tp_size=10**30),
    "PlanSettings(page_size=0)": lambda: PlanSettings(page_size=0),
    "PlanSettings(pool_layouts=[1])": lambda: PlanSettings(pool_layouts=[1]),  # type: ignore[arg-type]
    "PlanSettings(pool_layouts={5: x})": lambda: PlanSettings(pool_layouts={5: "page_first"}),  # type: ignore[dict-item]
    "PlanSettings(storage=5)": lambda: PlanSettings(storage=5),  # type: ignore[arg-type]
    "PlanSettings(kv_dtype=5)": lambda: PlanSettings(kv_dtype=5),  # type: ignore[arg-type]
    "GroupAllocator.allocate(list)": lambda: GroupAllocator(PLAN).allocate([1]),  # type: ignore[arg-type]
    "GroupAllocator.allocate(True)": lambda: GroupAllocator(PLAN).allocate({"kv": True}),  # type: ignore[dict-item]
    "GroupAllocator.allocator(5)": lambda: GroupAllocator(PLAN).allocator(5),  # type: ignore[arg-type]
    "GroupAllocator.free(int pages)": lambda: GroupAllocator(PLAN).free({"kv": 0}),  # type: ignore[dict-item]
    "PageAllocator.free(None)": lambda: PageAllocator(4).free(None),  # type: ignore[arg-type]
    "PinTable.pin(None)": lambda: PinTable().pin(None),  # type: ignore[arg-type]
    "PinTable.pin({5: ...})": lambda: PinTable().pin({5: [0]}),  # type: ignore[dict-item]
    "PinTable.count(5, 0)": lambda: PinTable().count(5, 0),  # type: ignore[arg-type]
    "DType.parse(5)": lambda: DType.parse(5),  # type: ignore[arg-type]
    "PoolName.parse(None)": lambda: PoolName.parse(None),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", sorted(API_CALLS))
def test_wrong_types_at_the_python_entry_points_are_typed_errors(call: str) -> None:
    with pytest.raises(HiCacheError):
        API_CALLS[call]()


def test_paths_pool_name_strings_and_backend_names_are_accepted(tmp_path: Path) -> None:
    assert load_model_spec(FIXTURE / "llama-3.1-8b-instruct.json") == SPEC
    extra = tmp_path / "extra.yaml"
    extra.write_text("allocator: shm\n")
    assert load_extra_config(extra) == {"allocator": "shm"}
    assert resolve_host_memory("shm").kind.name == "shm"
    assert plan_stack(SPEC, {"tp_size": 2}) == plan_stack(SPEC, PlanSettings(tp_size=2))
    allocator = GroupAllocator(PLAN)
    taken = allocator.allocate({"kv": 2})
    assert taken["kv"] == taken[PoolName.KV] == (0, 1)
    pins = PinTable()
    pins.pin({"kv": [0]})
    assert pins.is_pinned(PoolName.KV, 0)
    allocator.free({"kv": list(taken["kv"])})


FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(text=st.one_of(st.text(max_size=60), DOCUMENTS.map(lambda d: json.dumps(d))))
def test_extra_config_text_parses_or_is_a_config_error(text: str) -> None:
    result = typed_or(lambda: parse_extra_config(text))
    assert isinstance(result, (dict, HiCacheError))


@FUZZ
@given(doc=st.dictionaries(st.text(max_size=8), DOCUMENTS, max_size=4), allocator=JSON_LEAVES)
def test_extra_config_mappings_resolve_or_are_config_errors(
    doc: dict[str, Any], allocator: object
) -> None:
    def resolve() -> object:
        storage = StorageSettings(backend="dynamic", extra_config={**doc, "allocator": allocator})
        return resolve_host_memory(storage)

    result = typed_or(resolve)
    assert isinstance(result, HiCacheError) or allocator in ("shm", "anonymous", "mooncake")


@FUZZ
@given(data=st.binary(max_size=200), suffix=st.sampled_from([".json", ".toml", ".yaml", ".yml"]))
def test_any_bytes_as_an_extra_config_file_load_or_are_config_errors(
    data: bytes, suffix: str, tmp_path: Path
) -> None:
    path = tmp_path / f"extra{suffix}"
    path.write_bytes(data)
    result = typed_or(lambda: load_extra_config(f"@{path}"))
    assert isinstance(result, (dict, HiCacheError))


KEY_NAMES = st.one_of(
    st.sampled_from([k.name for k in KEYS]), st.sampled_from(["plan", "storage", "runtime"])
)


def _as_json(doc: object) -> str:
    """``doc`` as JSON text; a document json cannot write (too deep, a 5000-digit integer) as
    the deepest text it stands for."""
    try:
        return json.dumps(doc, default=str)
    except (RecursionError, ValueError):
        return "[" * 3000 + "]" * 3000


def _config_or_error(fn: Callable[[], object]) -> object:
    result = typed_or(fn)
    assert isinstance(result, (HiCacheConfig, HiCacheError)), type(result)
    if isinstance(result, HiCacheError):
        assert len(str(result)) < 2000  # values are shown bounded, never repr'd whole
    return result


@FUZZ
@given(
    doc=st.dictionaries(
        st.one_of(KEY_NAMES, st.text(max_size=10), st.integers()), HOSTILE_DOCUMENTS, max_size=4
    )
)
def test_any_mapping_builds_a_config_or_is_a_config_error(doc: dict[Any, Any]) -> None:
    _config_or_error(lambda: HiCacheConfig.from_mapping(doc))


@FUZZ
@given(key=st.sampled_from([k.name for k in KEYS]), value=HOSTILE_DOCUMENTS)
def test_any_value_of_any_key_is_accepted_bounded_or_a_config_error(
    key: str, value: object
) -> None:
    result = _config_or_error(lambda: HiCacheConfig.from_mapping({key: value}))
    if isinstance(result, HiCacheConfig):
        got = result.value(key)
        if isinstance(got, float):
            assert (math.isfinite(got) and abs(got) <= 1e6) or key == "plan.host_ratio"


@FUZZ
@given(
    var=st.sampled_from([k.env for k in KEYS]),
    text=st.one_of(
        st.text(max_size=40),
        st.sampled_from(["1e308", "1e400", "inf", "-inf", "nan", "1" + "0" * 400, "-1"]),
        st.integers(min_value=1, max_value=5000).map(lambda n: "[" * n + "]" * n),
        st.integers(min_value=1, max_value=5000).map(lambda n: '{"a":' * n + "1" + "}" * n),
        HOSTILE_DOCUMENTS.map(_as_json),
    ),
)
def test_any_text_in_a_variable_builds_a_config_or_is_a_config_error(var: str, text: str) -> None:
    _config_or_error(lambda: HiCacheConfig.load(env={var: text}))


@FUZZ
@given(
    key=st.sampled_from([k.name for k in KEYS]),
    form=st.sampled_from(["json", "yaml", "json-dotted", "yaml-dotted"]),
)
def test_a_key_given_twice_in_a_config_file_is_always_refused(
    key: str, form: str, tmp_path: Path
) -> None:
    *parents, leaf = key.split(".")
    if form == "json":
        inner = f'{{"{leaf}": null, "{leaf}": null}}'
        for part in reversed(parents):
            inner = f'{{"{part}": {inner}}}'
        text, suffix = inner, ".json"
    elif form == "yaml":
        lines = [f"{'  ' * i}{p}:" for i, p in enumerate(parents)]
        pad = "  " * len(parents)
        text, suffix = "\n".join([*lines, f"{pad}{leaf}: null", f"{pad}{leaf}: null"]), ".yaml"
    else:
        nested: object = None
        for part in reversed(key.split(".")):
            nested = {part: nested}
        doc = {**nested, key: None}  # type: ignore[dict-item]
        text = json.dumps(doc)
        suffix = ".json" if form == "json-dotted" else ".yaml"
    path = tmp_path / f"dup{suffix}"
    path.write_text(text)
    with pytest.raises(HiCacheError, match="given twice"):
        HiCacheConfig.load(path, env={})


SECONDS = st.one_of(HOSTILE_NUMBERS, st.booleans(), st.text(max_size=4), st.none())


@FUZZ
@given(
    field=st.sampled_from(
        [
            "timeout_base_s",
            "timeout_per_ki_token_s",
            "timeout_max_s",
            "call_deadline_s",
            "breaker_cooldown_s",
        ]
    ),
    value=SECONDS,
)
def test_storage_tier_seconds_are_finite_and_bounded_or_refused(field: str, value: object) -> None:
    extra = {"timeout_max_s": 1e6} if field != "timeout_max_s" else {}
    result = typed_or(lambda: StorageTierSettings(**{field: value}, **extra))
    if isinstance(result, StorageTierSettings):
        got = getattr(result, field)
        assert math.isfinite(got)
        assert 0 <= got <= 1e6


@FUZZ
@given(field=st.sampled_from(["timeout_s", "stale_tmp_s"]), value=SECONDS)
def test_directory_store_seconds_are_finite_and_bounded_or_refused(
    field: str, value: object
) -> None:
    result = typed_or(lambda: DirectorySettings.from_config({field: value}))
    if isinstance(result, DirectorySettings):
        got = getattr(result, field)
        assert got is None or (math.isfinite(got) and 0 <= got <= 1e6)


SETTINGS_CLASSES = [
    PlanSettings,
    CacheSettings,
    WriteSettings,
    CheckpointPolicy,
    RatioSizing,
    BudgetSizing,
    StorageTierSettings,
    StorageSettings,
    DirectorySettings,
]
EDGE_VALUES: dict[str, Callable[[], object]] = {
    "1e308": lambda: 1e308,
    "inf": lambda: math.inf,
    "nan": lambda: math.nan,
    "10**400": lambda: 10**400,
    "10**5000": lambda: 10**5000,
    "deep": lambda: deep(5000),
    "non-string keys": lambda: {1: 2, "a": 3},
    "unknown keys": lambda: {"nope": 1},
    "pairs": lambda: [("a", 1)],
}
SETTINGS_CASES = [
    (cls.__name__, field.name, value)
    for cls in SETTINGS_CLASSES
    for field in attrs.fields(cls)
    if field.init
    for value in EDGE_VALUES
]


@pytest.mark.parametrize(("cls", "field", "value"), SETTINGS_CASES)
def test_edge_values_in_any_settings_field_are_a_typed_error_shown_short(
    cls: str, field: str, value: str
) -> None:
    klass = next(c for c in SETTINGS_CLASSES if c.__name__ == cls)
    result = typed_or(lambda: klass(**{field: EDGE_VALUES[value]()}))
    if isinstance(result, HiCacheError):
        assert len(str(result)) < 1000


def test_case_count_is_at_least_300() -> None:
    """The cases of this module (the CLI fuzz in tests/cli/test_fuzz_cli.py adds its own)."""
    cases = MUTATION_COUNT + len(MODELS) * len(PoolName) * len(Layout) + len(API_CALLS)
    assert cases >= 300
