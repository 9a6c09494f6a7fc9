"""Jobs on a Ray cluster (``python -m launch.ray``): the driver's side (joining or starting the
cluster, placing the workers with Horovod's ``RayExecutor``, watching nodes, saying in one line
how a job ended) and the workers' (running the trainer in a Ray actor, reporting its outcome).
The command itself (its flags and their checks) is ``launch/ray.py``."""
