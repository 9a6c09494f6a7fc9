"""The strategies, one package each: how the ranks share the work of training one model.

* :mod:`.ring`: every rank holds the whole model; Horovod's ring allreduce averages the
  gradients (synchronous data parallelism; ``--elastic`` keeps it going as workers come and go).
* :mod:`.pipeline`: the model split by layers into S stages, pipelined, R replicas of the
  pipeline trained data-parallel (model parallelism; docs/pipeline.md).
* :mod:`.ps`: parameter servers hold the parameters, workers push gradients, with bounded
  staleness (asynchronous SGD; docs/parameter-servers.md).

Each package owns its flags and their checks (its ``options`` module) and its framework-free
engine; the framework halves are in ``torch_models/`` and ``tf_models/``.  The one table from
(framework, strategy) to run object is :mod:`.registry`; docs/architecture.md says how to add a
strategy.
"""
