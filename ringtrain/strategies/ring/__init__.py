"""The ring: every rank holds the whole model and Horovod's ring allreduce averages the gradients
(the run objects are ``torch_models.run.TorchRun`` and ``tf_models.run.KerasRun``; the loops
``ringtrain.training.fixed_loop`` and, under ``--elastic``, ``ringtrain.training.elastic``)."""
