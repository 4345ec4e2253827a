"""Other libraries' names for our keys (`posttrain.config.aliases`): the unknown-key message
answers a TRL, veRL or OpenRLHF name with the real key, before any spelling guess."""

import re

import pytest

from posttrain.config import ConfigError, build_config, iter_fields
from posttrain.config.aliases import alias_table, iter_aliases
from posttrain.config.core import coerce, from_dict, valid_keys
from posttrain.config.docs import COMMANDS, render_alias_tables

# The names of issue 30, item 9: what a TRL or veRL user types → what they get pointed to.
# Before the table, several got a misleading spelling guess (learning_rate → critic.learning_rate,
# max_completion_length → data.max_prompt_length, beta → algorithm.lam, save_strategy →
# trainer.strategy) or none (num_generations).
EXPECTED = [
    ("grpo", "learning_rate=1e-6", "trainer.learning_rate=1e-6"),
    ("sft", "learning_rate=2e-5", "trainer.learning_rate=2e-5"),
    ("grpo", "num_generations=4", "rollout.n=4"),
    ("grpo", "max_completion_length=128", "rollout.max_new_tokens=128"),
    ("grpo", "beta=0.04", "algorithm.kl.coef=0.04"),
    ("dpo", "beta=0.2", "algorithm.beta=0.2"),
    ("grpo", "loss_type=grpo", "actor.policy_loss.loss_agg_mode=seq-mean-token-mean"),
    ("grpo", "loss_type=dr_grpo", "actor.policy_loss.loss_agg_mode=seq-mean-token-sum-norm"),
    ("grpo", "loss_type=dapo", "actor.policy_loss.loss_agg_mode=token-mean"),
    ("dpo", "loss_type=ipo", "algorithm.loss_type=ipo"),
    ("grpo", "num_iterations=2", "actor.ppo_epochs=2"),
    ("grpo", "epsilon_high=0.28", "actor.policy_loss.clip_high=0.28"),
    ("grpo", "epsilon=0.2", "actor.policy_loss.clip_low=0.2"),
    ("sft", "gradient_accumulation_steps=4", "data.train_batch_size"),
    ("grpo", "gradient_accumulation_steps=4", "data.train_batch_size"),
    ("grpo", "use_vllm=true", "rollout.engine=vllm"),
    ("grpo", "sync_ref_model=true", "algorithm.ref_sync_steps"),
    ("dpo", "sync_ref_model=true", "algorithm.ref_sync_steps"),
    ("sft", "save_strategy=steps", "trainer.save_steps"),
    ("sft", "per_device_train_batch_size=4", "trainer.micro_batch_size=4"),
    ("grpo", "per_device_train_batch_size=4", "actor.micro_batch_size=4"),
    ("grpo", "scale_rewards=false", "algorithm.norm_adv_by_std=none"),
    ("grpo", "temperature=0.7", "rollout.temperature=0.7"),
    ("grpo", "actor_rollout_ref.rollout.n=16", "rollout.n=16"),
    ("grpo", "data.max_response_length=512", "rollout.max_new_tokens=512"),
    ("grpo", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor.ppo_mini_batch_size=8"),
    ("grpo", "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.learning_rate=1e-6"),
    ("grpo", "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor.policy_loss.clip_high=0.28"),
    ("ppo", "algorithm.kl_ctrl.kl_coef=0.001", "algorithm.kl.coef=0.001"),
    ("grpo", "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "algorithm.kl.kind=k3"),
    ("grpo", "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.kl.in_loss=true"),
    ("grpo", "data.val_files=[test.parquet]", "data.eval_files=[test.parquet]"),
    ("ppo", "critic.optim.lr=1e-5", "critic.learning_rate=1e-5"),
    ("ppo", "trainer.critic_warmup=5", "critic.warmup_steps=5"),
    ("grpo", "trainer.save_freq=10", "trainer.save_steps=10"),
    ("grpo", "trainer.n_gpus_per_node=2", "trainer.n_workers_per_node=2"),
    ("grpo", "n_samples_per_prompt=8", "rollout.n=8"),  # OpenRLHF
]


def config_error(command, override):
    with pytest.raises(ConfigError) as err:
        build_config(COMMANDS[command], None, ["model.init=tiny", override])
    return str(err.value)


@pytest.mark.parametrize(("command", "override", "fix"), EXPECTED, ids=[f"{c}:{o}" for c, o, _ in EXPECTED])
def test_issue_names_get_the_real_key(command, override, fix):
    message = config_error(command, override)
    name = override.partition("=")[0]
    assert message.startswith(f"unknown key {name}: ")
    assert f"Did you mean {fix}?" in message


def table_rows():
    """(command, their name, our key) for every alias whose name is not itself one of our keys."""
    for command, cls in COMMANDS.items():
        keys = set(valid_keys(cls))
        for name, (key, _) in alias_table(cls).items():
            if name not in keys:
                yield command, name, key


def nested(dotted, value):
    """{a: {b: value}} for `a.b`: what build_config hands from_dict for the override a.b=value."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_alias_in_the_table_is_answered_with_its_key(command):
    # from_dict is the check build_config runs on the merged tree (without OmegaConf's merge,
    # which would make these ~600 cases take seconds).
    rows = [(name, key) for c, name, key in table_rows() if c == command]
    assert len(rows) > 20
    for name, key in rows:
        with pytest.raises(ConfigError) as err:
            from_dict(COMMANDS[command], nested(name, 1))
        message = str(err.value)
        assert re.search(rf"^unknown key {re.escape(name)}: \S+'s {re.escape(name)} (is {re.escape(key)} here|has no key "
                         rf"of its own here).*Did you mean {re.escape(key)}[=?]", message), message


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_alias_points_at_a_missing_key_or_shadows_another(command):
    cls = COMMANDS[command]
    keys = set(valid_keys(cls))
    table = alias_table(cls)  # raises when one name is declared on two keys
    assert len(table) > 20
    types = {key: tp for key, tp, *_ in iter_fields(cls)}
    for key, alias in iter_aliases(cls):
        assert key in keys, f"{alias.library} {alias.name} points at {key}, not a key of posttrain {command}"
        # An alias spelt like one of our keys must be that key: otherwise it could never fire.
        assert alias.name not in keys or alias.name == key, (alias.name, key)
        for _, ours in alias.values or ():
            assert coerce(ours, types[key], key) == ours  # every translated value is one the key takes


def test_veRL_actor_keys_are_rl_only():
    sft = {name for name in alias_table(COMMANDS["sft"])}
    assert "actor_rollout_ref.actor.optim.lr" not in sft and "learning_rate" in sft
    assert "actor_rollout_ref.actor.optim.lr" in alias_table(COMMANDS["grpo"])


def test_aliases_come_before_spelling_and_sections():
    # The spelling guess alone would say trainer.strategy, critic.learning_rate, algorithm.lam.
    assert "Did you mean trainer.save_steps?" in config_error("sft", "save_strategy=no")
    assert "Did you mean trainer.learning_rate=" in config_error("grpo", "learning_rate=1e-6")
    assert "algorithm.lam" not in config_error("grpo", "beta=0.04")
    # A section prefix of ours in front of a TRL name still finds it.
    assert "Did you mean data.train_batch_size?" in config_error("sft", "trainer.gradient_accumulation_steps=4")
    # Spelling slips keep their own answer.
    assert "Did you mean trainer.learning_rate?" in config_error("grpo", "trainer.lerning_rate=1")


def test_values_that_translate_say_how():
    message = config_error("grpo", "loss_type=sigmoid")  # a DPO value: no GRPO aggregation of that name
    assert ("actor.policy_loss.loss_agg_mode here (grpo → seq-mean-token-mean, bnpo → token-mean, "
            "dapo → token-mean, dr_grpo → seq-mean-token-sum-norm)") in message
    assert message.endswith("Did you mean actor.policy_loss.loss_agg_mode?")
    assert "algorithm.kl.in_loss=true" in config_error("grpo", "beta=0.04")  # TRL's β > 0 turns the KL on
    assert "per_device_train_batch_size × gradient_accumulation_steps" in config_error(
        "sft", "gradient_accumulation_steps=4")


def test_the_docs_table_and_help_show_the_aliases(capsys):
    from posttrain.cli import main

    table = render_alias_tables()
    assert "| `num_generations` | `rollout.n` | grpo, ppo |  |" in table
    assert "| `use_vllm` | `rollout.engine` | grpo, ppo | `true` → `vllm`, `false` → `auto` |" in table
    assert "| `beta` | `algorithm.beta` | dpo |  |" in table
    with pytest.raises(SystemExit):
        main(["grpo", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "Also: TRL num_generations; veRL actor_rollout_ref.rollout.n; OpenRLHF n_samples_per_prompt." in help_text


def test_a_bad_value_of_our_own_key_stays_a_type_error():
    # max_steps is also TRL's name: the value, not the key, is wrong here.
    assert config_error("sft", "trainer.max_steps=ten") == "trainer.max_steps: expected int | null, got 'ten' (str)"
    assert "Did you mean algorithm.filter_groups=true?" in config_error("grpo", "algorithm.filter_groups.enable=true")
    # veRL's algorithm.adv_estimator is ours, but one of its values is spelt differently.
    assert config_error("grpo", "algorithm.adv_estimator=reinforce_plus_plus") == (
        "algorithm.adv_estimator: reinforce_plus_plus is veRL's name for reinforce_pp here. "
        "Did you mean algorithm.adv_estimator=reinforce_pp?")
    assert "'dr_grpo' | 'rloo' | 'reinforce_pp'" in config_error("grpo", "algorithm.adv_estimator=remax")
