"""The parts that ``python -m bench --only PART`` runs, one module each (``throughput``,
``allreduce`` for ``collectives``, ``accuracy``, ``emulated_cluster`` for ``cluster``, ``floor``,
``owndata`` for ``data``, ``param_servers`` for ``ps``, ``model_parallel`` for ``pipeline``), the
standalone ``python -m bench.parts.owndata`` and ``python -m bench.parts.cluster_cells``, and what
drives them: ``config`` and ``smoke`` (their sizes), ``training_runs`` (one measured training
run), ``machine`` and ``profiling``.  They launch the programs of :mod:`bench.workers`."""
