"""Everything uniprefill does inside vLLM, in one package; nothing here imports vLLM at import time.

- `plugin`: the `vllm.general_plugins` entry point and the backend vLLM compiles with
  (`compilation_config.backend = "uniprefill.vllm.plugin.vllm_backend"`); `checks`: the engine
  settings it depends on, checked at construction.
- `graph`: reading vLLM's backbone graph (attention sites, layer names); `rewrite`: the token-drop
  rewrite of that graph.
- `drop`: the drop point's runtime (`VllmDropRuntime`); `layout`, `layout_checks`: the token layouts
  of a step; `metadata`: eligibility and the drop-history store; `window`: sliding-window layers
  after a drop; `graph_decode`: decode under CUDA graphs after drops.
- `runner_hook`: request ids and finished requests from vLLM's model runner.

Former module names (`uniprefill.vllm_plugin`, `uniprefill.vllm_runner_hook`) are these modules
under their old names, so configurations and scripts written for them keep working.
"""
