"""The engines weight_sync pushes to: Hugging Face ``transformers`` models (``adapters.hf``),
vLLM (``adapters.vllm``: in-process engines, its weight-transfer API, ``vllm serve``) and SGLang
(``adapters.sglang``: servers over HTTP, or Ray actors serving the same endpoints). Each imports
its engine only when used, so none is a dependency of the core library."""
