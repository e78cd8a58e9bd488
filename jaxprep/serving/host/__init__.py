"""Host bookkeeping of the serving loop: the scheduler, the host checks, the vLLM adapter, the batch and its
host mirror, the engines (one rank, data parallel, overlapped) and the workloads. Nothing here is traced; it
calls the device transitions one floor down (`jaxprep.serving.state`, `transitions`, `step`)."""
