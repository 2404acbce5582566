"""``common.overrides``: Python values as Hydra overrides, checked by composing them for real."""

from __future__ import annotations

from vapo_async.common.overrides import as_overrides, hydra_value


def test_hydra_value() -> None:
    assert [hydra_value(v) for v in (None, True, False, 0.2, 8, "sequence")] == \
        ["null", "true", "false", "0.2", "8", "sequence"]


def test_as_overrides_takes_a_list_a_mapping_or_nothing() -> None:
    assert as_overrides(None) == []
    assert as_overrides(["model=/m", "engine.seed=3"]) == ["model=/m", "engine.seed=3"]
    assert as_overrides({"model": "/m", "engine.kv_cache_bytes": None, "engine.enforce_eager": True,
                         "sampling.temperature": 0.5}) == \
        ["model=/m", "engine.kv_cache_bytes=null", "engine.enforce_eager=true", "sampling.temperature=0.5"]


def test_the_overrides_compose_to_the_values() -> None:
    """What ``as_overrides`` writes, Hydra reads back as the same Python values (generator config)."""
    from hydra import compose, initialize
    from omegaconf import OmegaConf

    from vapo_async.generator.config import GeneratorConfig, register_configs

    register_configs()
    values = {"engine.kv_cache_bytes": None, "engine.enforce_eager": False, "sampling.temperature": 0.7,
              "max_prompts": 3, "generator_id": "g-1"}
    with initialize(version_base=None, config_path=None):
        cfg: GeneratorConfig = OmegaConf.to_object(compose(config_name="generator", overrides=as_overrides(values)))
    assert (cfg.engine.kv_cache_bytes, cfg.engine.enforce_eager, cfg.sampling.temperature, cfg.max_prompts,
            cfg.generator_id) == (None, False, 0.7, 3, "g-1")
