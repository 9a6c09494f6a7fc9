"""The strategy axis: one registry from (framework, strategy) to run object, each strategy's flags
in its own package.  No process is started: the flags are parsed and checked as the commands do,
and the run objects are looked up by name, never imported here."""

from __future__ import annotations

import importlib.util

import pytest

from launch.cli import build_parser
from ringtrain import flags
from ringtrain.errors import UserError
from ringtrain.strategies import registry

CONTRACT = ("NAME", "HELP", "NEEDS_MPI", "add_args", "implied", "check_unused", "validate",
            "check_world")


def parse(*argv: str):
    return registry.validate(build_parser("torch").parse_args(list(argv)))


@pytest.mark.parametrize("name", sorted(registry.STRATEGIES))
def test_every_strategy_keeps_the_contract_docs_architecture_gives(name):
    strategy = registry.STRATEGIES[name]
    assert strategy.options.NAME == name
    assert all(hasattr(strategy.options, attr) for attr in CONTRACT)
    assert set(strategy.runs) == set(flags.FRAMEWORKS)
    for target in [*strategy.runs.values(), *strategy.elastic.values()]:
        module, _, attr = target.partition(":")
        assert attr and importlib.util.find_spec(module) is not None, target


def test_stages_imply_the_pipeline_and_spelling_it_out_is_the_same_job():
    implied, spelt = parse("--pipeline-stages", "2"), parse("--strategy", "pipeline",
                                                             "--pipeline-stages", "2")
    assert implied.strategy == spelt.strategy == "pipeline"
    assert vars(implied) == vars(spelt)
    assert registry.entry("tf", spelt) == "tf_models.pipeline:KerasPipelineRun"


def test_the_default_is_the_ring_and_elastic_is_its_own_job():
    assert parse().strategy == "ring"
    assert registry.entry("torch", parse()) == "torch_models.run:TorchRun"
    assert registry.entry("torch", parse("--elastic")) == "torch_models.elastic:train"
    assert registry.entry("tf", parse("--strategy", "ps")) == "tf_models.ps:KerasPSRun"


@pytest.mark.parametrize("argv,needle", [
    (["--strategy", "pipeline"], "--strategy pipeline needs --pipeline-stages S of 2 or more"),
    (["--strategy", "ring", "--pipeline-stages", "2"], "--strategy ring with --pipeline-stages 2"),
    (["--staleness", "2"], "--ps-servers and --staleness set up parameter servers"),
    (["--microbatches", "2"], "--microbatches works with --pipeline-stages 2 or more"),
    (["--strategy", "ps", "--pipeline-stages", "2"], "--strategy ps cannot run with --pipeline-stages"),
])
def test_a_strategy_s_flags_without_it_are_one_line(argv, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        parse(*argv)


def test_the_world_checks_are_the_chosen_strategy_s():
    registry.check_world(parse("--pipeline-stages", "2"), 4)
    with pytest.raises(UserError, match="must divide the number of processes"):
        registry.check_world(parse("--pipeline-stages", "2"), 3)
    with pytest.raises(UserError, match="leaves no worker"):
        registry.check_world(parse("--strategy", "ps"), 1)
    with pytest.raises(UserError, match="power-of-two"):
        registry.check_world(parse("--adasum"), 3)


def test_ray_is_told_why_a_strategy_needs_mpi():
    assert registry.needs_mpi(parse()) is None
    assert "Gloo" in registry.needs_mpi(parse("--strategy", "ps"))
    assert "Gloo" in registry.needs_mpi(parse("--pipeline-stages", "2"))


@pytest.mark.parametrize("stages,batch,micro", [
    (2, 64, 8),   # the smallest divisor of the batch >= 4S
    (4, 64, 16),
    (3, 64, 16),  # 12 does not divide 64
    (2, 6, 3),    # a batch below 4S: the most micro-batches of at least 2 rows
    (4, 4, 2),
    (2, 1, 1),
])
def test_the_default_micro_batch_count_is_the_smallest_divisor_of_the_batch_from_4s(stages, batch,
                                                                                    micro):
    args = parse("--pipeline-stages", str(stages), "--batch-size", str(batch))
    assert (args.microbatches, args.microbatches_default) == (micro, True)
    assert registry.validate(args).microbatches_default  # validated twice: still the default


def test_an_explicit_micro_batch_count_is_kept():
    args = parse("--pipeline-stages", "2", "--batch-size", "64", "--microbatches", "2")
    assert (args.microbatches, args.microbatches_default) == (2, False)


def test_the_banner_says_when_m_is_the_default():
    from ringtrain.strategies.pipeline.options import microbatches_note

    assert microbatches_note(parse("--pipeline-stages", "2")) == " (the default: M >= 4S)"
    assert microbatches_note(parse("--pipeline-stages", "2", "--batch-size", "6")) == (
        " (the default: the batch is below 4S)")
    assert microbatches_note(parse("--pipeline-stages", "2", "--microbatches", "8")) == ""


def test_a_strategys_own_summary_record_needs_no_change_to_the_summary():
    """What a run object's summary_fields() returns lands in --metrics-out: a declared field (the
    pipeline's, the servers') in its place, any other at the document's top level."""
    import json

    from ringtrain.output.summary import Summary

    summary = Summary(framework="torch", versions={}, controller="mpi", world_size=2,
                      batch_size_per_rank=8, global_batch_size=16, base_lr=0.1, effective_lr=0.2,
                      lr_scaling="linear")
    summary.set_fields({"pipeline": {"stages": 2}, "newstrategy": {"shards": 3}})
    document = json.loads(summary.to_json())
    assert document["pipeline"] == {"stages": 2} and document["ps"] is None
    assert document["newstrategy"] == {"shards": 3} and "extra" not in document
