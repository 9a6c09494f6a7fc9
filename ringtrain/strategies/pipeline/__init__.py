"""Model parallelism: one model split by layers into S stages on S ranks, pipelined, and
replicated R times data-parallel (``--pipeline-stages S``).  Framework-free: where each rank
sits (:mod:`.placement`), how a model splits (:mod:`.partition`), the order of a stage's forward
and backward passes (:mod:`.schedule`), the point-to-point messages between stages
(:mod:`.transport`), one step's and one evaluation's run through them (:mod:`.engine`), and the
run object both frameworks build on (:mod:`.run`).  See docs/pipeline.md."""
