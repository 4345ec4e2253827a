"""One source of truth for names: each config Literal that picks a variant lists exactly
the keys of the `posttrain.algos` table the variant is picked from."""

import typing

import pytest

import posttrain.algos as algos
from posttrain.config.algorithm import (
    AlgorithmConfig,
    KLConfig,
    PolicyLossConfig,
    PPOAlgorithmConfig,
    RolloutCorrectionConfig,
)
from posttrain.config.preference import DPOAlgorithmConfig

FIELDS = [
    (AlgorithmConfig, "adv_estimator", "ADV_ESTIMATORS"),
    (PPOAlgorithmConfig, "adv_estimator", "ADV_ESTIMATORS"),
    (AlgorithmConfig, "norm_adv_by_std", "GRPO_SCALES"),
    (PolicyLossConfig, "loss_agg_mode", "AGG_MODES"),
    (PolicyLossConfig, "level", "RATIO_LEVELS"),
    (KLConfig, "kind", "KL_KINDS"),
    (DPOAlgorithmConfig, "loss_type", "DPO_LOSS_TYPES"),
    (RolloutCorrectionConfig, "rollout_is", "IS_LEVELS"),
    (RolloutCorrectionConfig, "rollout_is_mode", "IS_MODES"),
]


def literal_values(tp: typing.Any) -> list:
    """The values of a Literal field type, through `X | None`."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in literal_values(arg)]


@pytest.mark.parametrize("cls, name, table", FIELDS, ids=lambda x: getattr(x, "__name__", x))
def test_config_literal_equals_registry_keys(cls, name, table):
    values = literal_values(typing.get_type_hints(cls)[name])
    assert len(values) == len(set(values)), f"{cls.__name__}.{name} repeats a value"
    assert sorted(values) == sorted(getattr(algos, table)), (
        f"{cls.__name__}.{name} and posttrain.algos.{table} name different variants"
    )


def test_every_variant_table_has_its_config_field():
    tables = {n for n in algos.__all__ if n.isupper() and isinstance(getattr(algos, n), dict)}
    assert tables == {table for _, _, table in FIELDS}
