"""Parameter servers (``--strategy ps``): ranks 0..P-1 hold the parameters and the optimizer, the
others compute gradients; asynchronous SGD with bounded staleness (docs/parameter-servers.md).

The engine (:mod:`.engine`: servers, workers, clocks, the wire format), its MPI transport
(:mod:`.transport`), the run object's framework-free half (:mod:`.run`), and the flags
(:mod:`.options`)."""
