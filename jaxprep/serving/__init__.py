"""Device-resident serving: checked, donated state transitions, a vLLM-style host scheduler, a
tiny paged-KV transformer and the jitted serving step that ties them together; `VllmAdapter`, the door
from vLLM's scheduler.

```python
config = ServingConfig(prep=PrepConfig(max_num_reqs=8, max_model_len=256, max_num_batched_tokens=64,
                                       block_size=16, num_blocks=64))
engine = Engine(config, ModelConfig(), seed=0)
engine.warmup()
engine.submit(workload.requests, workload.arrival_steps)
finished = engine.run()
```
"""

from jaxprep.serving.host.batch import ServingBatch
from jaxprep.serving.host.checks import HostRows
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host.engine import Engine, LoopStats
from jaxprep.models.tiny import KVCache, ModelConfig, ServingModel, dense_forward, init_params, paged_forward
from jaxprep.serving.host.vllm import AdapterStep, VllmAdapter
from jaxprep.serving.host.vllm_config import AdapterUsageError, serving_config_from_vllm
from jaxprep.serving.host.vllm_checks import InvalidSchedulerOutputError
from jaxprep.serving.host.scheduler import BlockAllocator, Request, Scheduler, SchedulerOutput
from jaxprep.serving.update_packing import PackedStep, pack_step, payload_buckets, step_payload_buckets
from jaxprep.serving.state import (ERROR_BITS, PAD_ROW, AddRequests, AppendBlocks, FinishRequests, InvalidUpdateError,
                                   ResumeRequests, Schedule, ServingState, StepUpdates, table_names)
from jaxprep.serving.step import NO_TOKEN, serve_step, update_and_prepare
from jaxprep.serving.host.workload import DenseCheck, Workload, check_against_dense, random_workload

__all__ = [
    "AddRequests", "AppendBlocks", "BlockAllocator", "DenseCheck", "Engine", "FinishRequests", "HostRows",
    "InvalidUpdateError", "KVCache", "LoopStats", "ModelConfig", "NO_TOKEN", "PAD_ROW", "Request", "Schedule",
    "Scheduler", "SchedulerOutput", "ServingBatch", "ServingConfig", "ServingModel", "ServingState", "StepUpdates",
    "Workload", "check_against_dense", "dense_forward", "init_params", "paged_forward", "update_and_prepare",
    "random_workload", "serve_step",
    "ERROR_BITS", "InvalidSchedulerOutputError", "PackedStep", "VllmAdapter", "AdapterStep", "AdapterUsageError",
    "serving_config_from_vllm",
    "ResumeRequests", "pack_step", "payload_buckets", "step_payload_buckets", "table_names",
]
