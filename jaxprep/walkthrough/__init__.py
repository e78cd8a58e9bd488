"""Chunked prefill step by step: the driving, the records and the tables of `jaxprep walkthrough`
and the notebooks.

```python
for record in jaxprep.walkthrough.walk(WalkthroughOptions()):  # example A (docs/semantics.md), to the end
    print(jaxprep.walkthrough.format_step(record))
```
"""

from jaxprep.walkthrough.drive import WalkthroughOptions, run_walkthrough, walk
from jaxprep.walkthrough.record import OUTPUT_FIELDS, StepRecord, prepare_record
from jaxprep.walkthrough.text import format_step
from jaxprep.walkthrough.views import (AttentionPattern, KVCacheView, attention_pattern, kv_cache_view,
                                       token_table_states)

__all__ = [
    "AttentionPattern", "KVCacheView", "OUTPUT_FIELDS", "StepRecord", "WalkthroughOptions", "attention_pattern",
    "format_step", "kv_cache_view", "prepare_record", "run_walkthrough", "token_table_states", "walk",
]
