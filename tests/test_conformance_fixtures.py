"""The tiny-model fixtures' helpers (``ds4_core.testing.conformance``): a model's seed follows its name."""

from __future__ import annotations

from ds4_core.testing.conformance import built_once


def test_a_models_seed_does_not_depend_on_which_name_is_asked_for_first(tmp_path_factory):
    configs = {"a": {}, "b": {}, "c": {}}
    seeds = []
    for order in (("a", "b", "c"), ("c", "a", "b")):
        get = built_once(tmp_path_factory, lambda directory, config, seed: seed, configs, seed_offset=11)
        seeds.append({name: get(name)[1] for name in order})
    assert seeds[0] == seeds[1] == {"a": 11, "b": 12, "c": 13}
