"""Former name of `uniprefill.vllm.runner_hook` (the vLLM code moved into `uniprefill.vllm` on 2026-12-02).

The module object IS `uniprefill.vllm.runner_hook`, so `compilation_config.backend =
"uniprefill.vllm_plugin.vllm_backend"`, the entry point and monkeypatching through either name
all reach the same code and state.
"""

import sys

from uniprefill.vllm import runner_hook as _module

sys.modules[__name__] = _module
